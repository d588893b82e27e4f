"""The `fp4stack` command.

Each subcommand is one `Command`: a name, a one-line help, a function that adds its arguments to
its parser, and a function that runs it from the parsed arguments and returns an exit status.
A new subcommand (pretrain, rl, bench, ...) is one more entry in COMMANDS; its heavy imports go
inside its run function so `fp4stack --help` stays fast.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from . import __version__


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    description: str = ""


# ------------------------------------------------------------------------------ quant-error


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _quant_error_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rows", type=_positive_int, default=1024, help="tensor rows (default 1024)")
    p.add_argument("--cols", type=_positive_int, default=1024, help="tensor cols (default 1024)")
    p.add_argument("--seed", type=int, default=0, help="seed of the tensors and of SR (default 0)")
    p.add_argument(
        "--format", choices=("table", "json"), default="table",
        help="table (aligned text, default) or json (for scripts)",
    )
    p.add_argument(
        "--device", default="cpu",
        help="cpu (default), cuda, cuda:N, or auto (cuda when available)",
    )


def _quant_error_run(args: argparse.Namespace) -> int:
    from .analysis import quant_error

    try:
        meta = quant_error.metadata(args.rows, args.cols, args.seed, args.device)
        results = quant_error.error_table(args.rows, args.cols, args.seed, args.device)
    except (ValueError, RuntimeError) as e:
        print(f"fp4stack quant-error: error: {e}", file=sys.stderr)
        return 2
    if args.format == "json":
        doc = {**meta, "results": [r.to_dict() for r in results]}
        print(json.dumps(doc, indent=2))
    else:
        print(quant_error.format_table(results, meta))
    return 0


QUANT_ERROR = Command(
    name="quant-error",
    help="quantization error of NVFP4 variants and FP8 baselines on a few tensor distributions",
    description=(
        "Quantize -> dequantize test tensors (Gaussian, Student-t, outlier channels, low-rank "
        "weight-like) with NVFP4 (RNE, SR, 2D, Hadamard, Four Over Six) and FP8 E4M3 (per-tensor, "
        "per-row, 1x128) and print the relative Frobenius error and the SQNR of each."
    ),
    add_arguments=_quant_error_arguments,
    run=_quant_error_run,
)

COMMANDS: tuple[Command, ...] = (QUANT_ERROR,)


# ------------------------------------------------------------------------------------ main


def build_parser(commands: Sequence[Command] = COMMANDS) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fp4stack",
        description="fp4stack: stable, fast NVFP4 (4-bit) training of LLMs.",
    )
    parser.add_argument("--version", action="version", version=f"fp4stack {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for cmd in commands:
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.description or cmd.help)
        cmd.add_arguments(p)
        p.set_defaults(run=cmd.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
