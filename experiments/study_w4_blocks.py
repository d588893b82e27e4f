"""Where NVFP4 weights cost an RL policy its skill: each transformer block's share.

Issue 37's arms found every policy with NVFP4 weights (naive W4A4, W4A16 with the qat-w trainer,
QUADS) starting near 0 greedy pass@1 where the same BF16 weights scored 0.445. This builds the
policy of an RL config after its SFT warm-up (cached in --cache), converts copies of it to a
weight-quantizing recipe (qat-w: the QUADS trainer's function, NVFP4 weights and unquantized
activations; or nvfp4: W4A4) with one block, or the first or last k blocks, left in high
precision, and scores each copy's teacher-forced negative log-prob of the reference completions
of --prompts held-out task examples. A block's share is the part of the whole model's NLL gap
(quantized against float) that keeping it removes; the shares of single blocks need not add up
to 1 (the blocks' errors interact).

    FP4STACK_SMOLLM2_GGUF=SmolLM2-135M-Instruct.Q4_1.gguf python experiments/study_w4_blocks.py \\
        --config experiments/configs/smollm2_dense_sft_probe.yaml \\
        --cache runs/rl/smollm2-dense-probe/sft --recipes qat-w,nvfp4 --json out.json

`--whole-only` scores each recipe's fully quantized copy alone, to compare weight quantizers
(e.g. `--recipes qat-w,qat-w-4over6`: Four Over Six block scales on the weights).
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch
from study_sft_start import completion_batch
from tqdm.auto import tqdm

from fp4stack.convert import DEFAULT_SKIP, quantize_model
from fp4stack.data.tasks import load_task
from fp4stack.device import resolve_device
from fp4stack.nn.recipe import recipe as get_recipe
from fp4stack.rl import policy as lm
from fp4stack.rl.config import load_rl_config
from fp4stack.rl.start import prepare_policy


@torch.no_grad()
def completion_logprobs(model, batch) -> torch.Tensor:
    tokens, mask, target = batch
    return lm.token_logprobs(model, tokens, mask)[target].float()


def variants(n_blocks: int, keeps: list[int]) -> list[tuple[str, tuple[str, ...], dict]]:
    """(name, extra skip patterns, recipe overrides) of every conversion scored: none kept,
    each single block kept, the first k and the last k kept for k in `keeps` (n_blocks 0 and
    no keeps: the whole model quantized only)."""
    out = [("all quantized", (), {})]
    out += [(f"block {i} kept", (f"layers.{i}.",), {}) for i in range(n_blocks)]
    out += [(f"first {k} kept", (), {"keep_first_blocks": k}) for k in keeps]
    out += [(f"last {k} kept", (), {"keep_last_blocks": k}) for k in keeps]
    out += [(f"first and last {k} kept", (), {"keep_first_blocks": k, "keep_last_blocks": k})
            for k in keeps]
    return out


def study(model, batch, recipe_name: str, n_blocks: int, keeps: list[int]) -> list[dict]:
    """A row per variant: the copy's completion NLL, its mean |dlogp| against `model` and the
    share of the all-quantized copy's NLL gap it removes."""
    want = completion_logprobs(model, batch)
    float_nll = -want.mean().item()
    rows = []
    todo = variants(n_blocks, keeps)
    for name, skip, overrides in tqdm(todo, desc=recipe_name, unit="variant"):
        recipe = get_recipe(recipe_name).with_(**overrides)
        q = copy.deepcopy(model)
        quantize_model(q, recipe, skip=DEFAULT_SKIP + skip)
        got = completion_logprobs(q, batch)
        rows.append({"recipe": recipe_name, "variant": name, "nll": -got.mean().item(),
                     "dlogp_mean": (got - want).abs().mean().item()})
        del q
    gap = rows[0]["nll"] - float_nll
    for r in rows:
        r["float_nll"] = float_nll
        r["share_removed"] = (rows[0]["nll"] - r["nll"]) / gap if gap else None
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="an RL config (configs/rl/*.yaml)")
    p.add_argument("--cache", default=None, help="where the SFT warm-up is kept (default: none)")
    p.add_argument("--recipes", default="qat-w", help="weight-quantizing recipes (comma-separated)")
    p.add_argument("--prompts", type=int, default=64, help="held-out examples scored")
    p.add_argument("--keeps", default="1,2,4", help="k of the first / last k blocks kept")
    p.add_argument("--whole-only", action="store_true",
                   help="score each recipe's fully quantized copy only (compare recipes)")
    p.add_argument("--json", default=None, help="also write the rows as JSON here")
    args = p.parse_args()
    t0 = time.perf_counter()
    cfg = load_rl_config(args.config)
    device = resolve_device(cfg.device)
    task = load_task(cfg.task, **cfg.task_options)
    torch.manual_seed(cfg.seed)
    model, tokenizer = prepare_policy(cfg, task, device,
                                      Path(args.cache) if args.cache else None, log=print)
    model = model.float().eval()
    stream = task.train_examples(cfg.seed + 777)  # prompts no run of this seed trains on
    batch = completion_batch(tokenizer, task, [next(stream) for _ in range(args.prompts)], device)
    n_blocks = len(model.model.layers)
    keeps = [int(k) for k in args.keeps.split(",")]
    rows = []
    for recipe in args.recipes.split(","):
        rows += study(model, batch, recipe, *((0, []) if args.whole_only else (n_blocks, keeps)))
    print(f"{args.prompts} held-out examples, {int(batch[2].sum())} completion tokens, "
          f"{n_blocks} blocks, float NLL {rows[0]['float_nll']:.4f}; "
          f"{time.perf_counter() - t0:.0f} s on {device}")
    print("| recipe | variant | NLL | mean abs dlogp | share of the gap removed |\n"
          "|---|---|---:|---:|---:|")
    for r in rows:
        share = "-" if r["share_removed"] is None else f"{r['share_removed']:.3f}"
        print(f"| {r['recipe']} | {r['variant']} | {r['nll']:.4f} | {r['dlogp_mean']:.4f} | "
              f"{share} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
