"""`fp4stack pretrain` and `fp4stack compare`: arguments and run functions (registered in
fp4stack/cli.py).

    fp4stack pretrain --config configs/pretrain/tiny.yaml --recipe nvfp4
    torchrun --standalone --nproc_per_node=2 -m fp4stack.cli pretrain --config C.yaml
        --distributed fsdp2   (one command line)
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True,
                   help="YAML config (presets: configs/pretrain/"
                        "{tiny,tiny-moe,small,small-moe,medium}.yaml)")
    p.add_argument("--recipe", help="bf16, fp8, nvfp4, nvfp4-nvidia, lowrank, qat-w, ...; "
                   "PRESET@forward, @backward or @weights quantizes only that part of the "
                   "preset's linears; or a YAML file holding a recipe mapping, a preset "
                   "with fields changed (README, 'Quantized layers, recipes and models'; "
                   "default: the config's)")
    p.add_argument("--max-steps", type=int, help="optimizer steps (default: the config's)")
    add_ckpt_every_argument(p)
    p.add_argument("--out", help="output directory; '{recipe}' is replaced by the recipe name")
    p.add_argument("--data", help="data directory with train.bin, val.bin, manifest.json")
    p.add_argument("--seed", type=int, help="seed of init, data order and stochastic rounding")
    p.add_argument("--micro-batch-size", type=int,
                   help="sequences per forward on one rank (default: the config's); under "
                   "torchrun global_batch_size must be a multiple of it x the world size")
    p.add_argument("--device", help="auto (default), cpu, cuda, cuda:N")
    p.add_argument("--distributed", choices=("ddp", "fsdp2"),
                   help="under torchrun with several processes (default: the config's)")
    p.add_argument("--fsdp-gather", choices=("fp32", "nvfp4"),
                   help="what FSDP2 all-gathers the blocks' FP4 linear weights as: fp32 master "
                   "weights, or each rank's rows in NVFP4, the same values in 3.6x fewer bytes "
                   "than BF16 (default: the config's)")
    p.add_argument("--deterministic", action="store_true", default=None,
                   help="bitwise-reproducible run: torch's deterministic algorithms, no cuDNN "
                   "attention (slower attention on CUDA; default: the config's)")
    p.add_argument("--compile", nargs="?", const=True, default=None, metavar="MODE",
                   help="the model's forward and backward through torch.compile; MODE a "
                        "torch.compile mode without CUDA graphs (default, "
                        "max-autotune-no-cudagraphs)")
    p.add_argument("--weight-flips", action="store_true", default=None,
                   help="log how often the NVFP4 forward weights flip, and flip back, from step "
                   "to step (weight_flip_rate, weight_return_rate; default: the config's)")
    p.add_argument("--high-precision-tail", type=float, metavar="FRACTION",
                   help="run the last FRACTION of the learning-rate schedule (e.g. 0.2) with "
                   "the GEMMs and attention in BF16, a precision switch (default: the config's, "
                   "0)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its latest checkpoint")
    add_verbose_argument(p)


def add_ckpt_every_argument(p: argparse.ArgumentParser) -> None:
    """--ckpt-every, the same for `fp4stack pretrain` and `fp4stack compare`."""
    p.add_argument("--ckpt-every", type=int, metavar="N",
                   help="save a checkpoint every N steps, for --resume; 0: only the final one "
                   "(default: the config's)")


def add_verbose_argument(p: argparse.ArgumentParser) -> None:
    """--verbose, the same for `fp4stack pretrain` and `fp4stack compare`."""
    p.add_argument("--verbose", action="store_true",
                   help="list every module the recipe converted or kept in high precision "
                   "(default: one line of counts)")


def run(args: argparse.Namespace) -> int:
    from .config import load_config, recipe_arg
    from .trainer import NonFiniteLossError, train

    try:
        recipe = recipe_arg(args.recipe) if args.recipe else None
        cfg = load_config(args.config, recipe=recipe, max_steps=args.max_steps,
                          out=args.out, data=args.data, seed=args.seed, device=args.device,
                          distributed=args.distributed, fsdp_gather=args.fsdp_gather,
                          micro_batch_size=args.micro_batch_size,
                          deterministic=args.deterministic, weight_flips=args.weight_flips,
                          high_precision_tail=args.high_precision_tail,
                          ckpt_every=args.ckpt_every, compile=args.compile)
        train(cfg, resume=args.resume, verbose=args.verbose)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"fp4stack pretrain: error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:  # pyyaml / tqdm
        print(f"fp4stack pretrain: error: {e}; install the train extra: "
              "pip install 'fp4stack[train]'", file=sys.stderr)
        return 2
    except NonFiniteLossError as e:
        print(f"fp4stack pretrain: error: {e}", file=sys.stderr)
        return 1
    return 0


def add_compare_arguments(p: argparse.ArgumentParser) -> None:
    """`fp4stack compare`'s arguments."""
    p.add_argument("--config", required=True, help="YAML config shared by every run")
    p.add_argument("--recipes", default="bf16,nvfp4,nvfp4-nvidia,lowrank",
                   help="comma-separated recipes (default bf16,nvfp4,nvfp4-nvidia,lowrank): "
                   "preset names or YAML files with a recipe mapping (a preset with fields "
                   "changed); recipe+optimizer (e.g. bf16+adamw4, bf16+muon4) changes the "
                   "optimizer")
    p.add_argument("--seeds", default="0",
                   help="seeds every recipe runs at, comma-separated (default 0)")
    p.add_argument("--baseline-seeds", default="",
                   help="extra BF16 seeds, comma-separated, to show the noise floor (e.g. 1)")
    p.add_argument("--out", default="runs/compare", help="output directory (default runs/compare)")
    p.add_argument("--no-train", action="store_true",
                   help="train nothing: report on the runs already finished in --out")
    p.add_argument("--max-steps", type=int, help="override the config's max_steps")
    add_ckpt_every_argument(p)
    p.add_argument("--data", help="override the config's data directory")
    p.add_argument("--device", help="auto (default), cpu, cuda, cuda:N")
    p.add_argument("--deterministic", action="store_true", default=None,
                   help="bitwise-reproducible runs (no cuDNN attention; default: the config's)")
    add_jobs_argument(p)
    add_verbose_argument(p)


def add_jobs_argument(p: argparse.ArgumentParser) -> None:
    """--jobs, the same for `fp4stack compare` and `fp4stack rl-compare`."""
    p.add_argument("--jobs", type=int, default=1,
                   help="runs trained at once, each in its own process with its output in its "
                   "directory's run.log (default 1: one after another); host-bound runs (FP4 "
                   "recipes, rollouts) can share one GPU")


def run_compare(args: argparse.Namespace) -> int:
    """`fp4stack compare`: train what is missing, then print the table."""
    from pathlib import Path

    from ..parallel_runs import RunsFailedError
    from .compare import format_table, run_comparison

    recipes = [r for r in args.recipes.split(",") if r]
    try:
        seeds = _seeds(args.seeds, "--seeds")
        extra = _seeds(args.baseline_seeds, "--baseline-seeds")
        rows = run_comparison(args.config, recipes, args.out, seeds=seeds,
                              baseline_seeds=extra, train_missing=not args.no_train,
                              max_steps=args.max_steps, ckpt_every=args.ckpt_every,
                              data=args.data,
                              device=args.device, deterministic=args.deterministic,
                              verbose=args.verbose, jobs=args.jobs)
    except (ValueError, FileNotFoundError) as e:
        print(f"fp4stack compare: error: {e}", file=sys.stderr)
        return 2
    except RunsFailedError as e:
        print(f"fp4stack compare: {e}", file=sys.stderr)
        return 1
    print(format_table(rows))
    print(f"\nwritten: {Path(args.out) / 'compare.md'}, compare.json, compare.png")
    return 0


def _seeds(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated integers, got {text!r}") from None
