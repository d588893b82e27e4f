"""The `fp4stack` command: the table of subcommands, the parser and main.

Each subcommand is one `Command`: a name, a one-line help, a function that adds its arguments to
its parser, and a function that runs it from the parsed arguments and returns an exit status.
Both functions live in the command's own package (analysis/command.py, data/command.py,
train/command.py, rl/command.py), whose heavy imports go inside its run function; a new
subcommand is one more such module and one more entry in COMMANDS.
"""

from __future__ import annotations

import argparse
import os
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


def _lazy(module: str, add: str = "add_arguments", run: str = "run") -> dict:
    """The `add` and `run` functions of `module`, imported when they are first called, not
    when this module is (training pulls in heavy imports that importing cli should not pay for)."""
    from importlib import import_module

    def add_arguments(p: argparse.ArgumentParser) -> None:
        getattr(import_module(module, __package__), add)(p)

    def run_command(args: argparse.Namespace) -> int:
        return getattr(import_module(module, __package__), run)(args)

    return {"add_arguments": add_arguments, "run": run_command}


# ------------------------------------------------------------------------------- commands

QUANT_ERROR = Command(
    name="quant-error",
    help="quantization error of NVFP4 variants and FP8 baselines on a few tensor distributions",
    description=(
        "Quantize -> dequantize test tensors (Gaussian, Student-t, outlier channels, low-rank "
        "weight-like) with NVFP4 (RNE, SR, 2D, Hadamard, Four Over Six) and FP8 E4M3 (per-tensor, "
        "per-row, 1x128) and print the relative Frobenius error and the SQNR of each."
    ),
    **_lazy(".analysis.command", add="add_quant_error_arguments", run="run_quant_error_command"),
)

ANALYZE = Command(
    name="analyze",
    help="per-layer attribution of W4A4 output error to weight vs activation quantization",
    description=(
        "Run a few hundred tokens of built-in English text through an unquantized model and, for "
        "every linear layer (and fused MoE experts), measure the relative output error of "
        "weight-only (x Q(W)^T, the QUADS trainer), activation-only (Q(x) W^T) and W4A4 "
        "(Q(x) Q(W)^T) quantization, and how much of the W4A4-vs-trainer gap QUADS activation "
        "residual compensation removes at a few channel fractions."
    ),
    **_lazy(".analysis.command", add="add_analyze_arguments", run="run_analyze_command"),
)

DATA = Command(
    name="data",
    help="build pretraining data: corpora -> BPE tokenizer -> token shards",
    **_lazy(".data.command"),
)

PRETRAIN = Command(
    name="pretrain",
    help="pretrain a GPT from a YAML config with a recipe; torchrun for DDP/FSDP2",
    description=(
        "Pretrain a GPT on token shards (fp4stack data build) with a quantization recipe. Writes "
        "DIR/metrics.jsonl, checkpoints under DIR/checkpoints (--resume continues the latest "
        "exactly) and DIR/result.json. Under torchrun: DDP, or FSDP2 with --distributed fsdp2."
    ),
    **_lazy(".train.command"),
)

COMPARE = Command(
    name="compare",
    help="pretrain one config with several recipes; table of the loss gap to BF16 and a plot",
    description=(
        "Train the same config (seed, data order, tokens) once per recipe, then write "
        "DIR/compare.md (final validation loss, gap to BF16 in %, tokens/s), compare.json and "
        "compare.png (loss curves). Finished runs are reused."
    ),
    **_lazy(".train.command", add="add_compare_arguments", run="run_compare"),
)

RL = Command(
    name="rl",
    help="GRPO reinforcement learning with the rollout in bf16, fp8, nvfp4 or quads precision",
    description=(
        "Train a policy with GRPO on a task with verifiable rewards. The rollout engine runs in "
        "the precision --rollout names and is refitted from the trainer (self-checked) after "
        "every update. Writes DIR/metrics.jsonl (reward, k1, k3, |dlogp|, chi2, ESS, entropy, "
        "response length; pass@1 on evaluation steps) and DIR/result.json."
    ),
    **_lazy(".rl.command", add="add_rl_arguments", run="run_rl_command"),
)

RL_COMPARE = Command(
    name="rl-compare",
    help="RL from one start with bf16, fp8, nvfp4, nvfp4+TIS and quads rollouts; table and plot",
    description=(
        "Run GRPO once per rollout precision from the same SFT start, seed and prompts, then write "
        "DIR/rl_compare.md (final reward and pass@1, mean and max k3), rl_compare.json and "
        "rl_compare.png (k3 and reward per step). Finished runs are reused."
    ),
    **_lazy(".rl.command", add="add_compare_arguments", run="run_compare_command"),
)

COMMANDS: tuple[Command, ...] = (QUANT_ERROR, ANALYZE, DATA, PRETRAIN, COMPARE, RL, RL_COMPARE)


# ------------------------------------------------------------------------------------ main


def build_parser(commands: Sequence[Command] = COMMANDS) -> argparse.ArgumentParser:
    """The `fp4stack` parser with a subparser for each of `commands`."""
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
    """Run the command line `argv` (default sys.argv[1:]); returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    return args.run(args)


def program() -> None:
    """The `fp4stack` executable: `main` on sys.argv, then exit with its status."""
    status = main()
    if status == 0 and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # A torchrun rank whose run ended well has closed everything it writes. FSDP2's DTensor
        # caches keep the process group, and so gloo's worker threads, alive past
        # destroy_process_group: a worker that drops a tensor while the interpreter finalizes
        # aborts the process ("terminate called without an active exception") after the run
        # succeeded. Leaving without finalization cannot meet that.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    sys.exit(status)


if __name__ == "__main__":
    program()
