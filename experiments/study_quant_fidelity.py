"""How far each rollout precision moves a pretrained model's next-token log-probs, before any
training: SmolLM2-135M (dense, or upcycled to an MoE as issue 37's policy) on a few short texts,
each rollout engine's copy (quantized as `fp4stack rl` builds it) against the float32 model:
mean negative log-prob, and the mean and max |log p_engine - log p_model| over the texts'
tokens, scored as one left-padded batch. Shows whether a model is robust enough to NVFP4 for an
RL comparison of rollout precisions to start from its BF16 weights (docs/results/rl.md).

    FP4STACK_SMOLLM2_GGUF=SmolLM2-135M-Instruct.Q4_1.gguf \\
        python experiments/study_quant_fidelity.py \\
        --precisions bf16,fp8,w4a16,nvfp4,nvfp4-token,quads --upcycle 0,8

The built-in texts give about 60 scored tokens: enough to see NVFP4 break a model, not to rank
two close precisions. `--text-file F --chunks K --chunk-tokens N` scores K windows of N tokens
of F's text instead (static compensation channels come from the K windows after them), and
`--trainer qat-w` scores against the QUADS trainer's function rather than the float32 model.
"""

from __future__ import annotations

import argparse
import copy
import json

import torch
from study_upcycle_loss import TEXTS

from fp4stack.device import resolve_device
from fp4stack.models import hf
from fp4stack.models.hf_import import gpt_from_hf
from fp4stack.models.upcycle import upcycle_gpt
from fp4stack.rl import policy as lm
from fp4stack.rl.fast_rollout import build_engine
from fp4stack.rl.policies import left_padded


def padded_batch(token_ids: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The texts left-padded into one batch, as the rollout engine lays rows out."""
    tokens, mask, _ = left_padded([(t, []) for t in token_ids], pad)
    return tokens, mask


def file_chunks(encode, path: str, chunks: int, chunk_tokens: int) -> list[list[int]]:
    """`chunks` consecutive windows of `chunk_tokens` token ids of the text in `path` (its
    whitespace collapsed); ValueError when the text is too short for them."""
    with open(path, encoding="utf-8") as f:
        ids = encode(" ".join(f.read().split()))
    if len(ids) < chunks * chunk_tokens:
        raise ValueError(f"{path}: {len(ids)} tokens, fewer than --chunks x --chunk-tokens = "
                         f"{chunks * chunk_tokens}")
    return [ids[i * chunk_tokens:(i + 1) * chunk_tokens] for i in range(chunks)]


@torch.no_grad()
def fidelity(model: torch.nn.Module, precisions: list[str], tokens: torch.Tensor,
             mask: torch.Tensor, dtype: torch.dtype | None, engine: str = "auto",
             trainer: str | None = None, calibration: list[list[int]] | None = None,
             four_over_six: bool = False) -> list[dict]:
    """A row per precision: the engine's mean NLL and its |dlogp| against `model` (float32), or
    against `model` converted to the `trainer` recipe (qat-w: the QUADS trainer's function);
    `engine` as RLConfig.engine (auto: the fast engine on CUDA, the reference one elsewhere).
    A precision is a rollout name with an optional share and mode, as `rl-compare` names runs
    (quads@0.5, quads@0.5:static); static channels are fixed from `calibration`.
    four_over_six: the engines' and the trainer's NVFP4 block scales by Four Over Six
    (RLConfig.four_over_six); their rows are named NAME+4over6."""
    from fp4stack.convert import quantize_model
    from fp4stack.nn.recipe import four_over_six as with_four_over_six
    from fp4stack.nn.recipe import recipe
    from fp4stack.rl.compare import parse_run

    reference = model
    suffix = "+4over6" if four_over_six else ""
    if trainer is not None:
        reference = copy.deepcopy(model)
        r = recipe(trainer)
        quantize_model(reference, with_four_over_six(r) if four_over_six else r)
    scored = torch.nn.functional.pad(mask[:, 1:] & mask[:, :-1], (1, 0))
    want = lm.token_logprobs(reference, tokens, mask)[scored]
    rows = [{"precision": f"{trainer}{suffix}" if trainer else "float32",
             "nll": -want.mean().item()}]
    for precision in precisions:
        run = parse_run(precision)
        rollout = build_engine(engine, model, None, run["rollout"], dtype=dtype,
                               compensation=run.get("compensation"),
                               compensation_mode=run.get("compensation_mode"),
                               four_over_six=four_over_six)
        rollout.sync(reference)
        if run.get("compensation_mode") == "static":
            if not calibration:
                raise ValueError(f"{precision}: static channels need calibration sequences")
            rollout.calibrate(calibration)
        got = lm.token_logprobs(rollout.model, tokens, mask)[scored]
        diff = (got - want).abs()
        rows.append({"precision": precision + suffix, "nll": -got.mean().item(),
                     "dlogp_mean": diff.mean().item(), "dlogp_max": diff.max().item()})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--precisions", default="bf16,fp8,w4a16,nvfp4,nvfp4-token,quads")
    p.add_argument("--upcycle", default="0,8", help="experts (0: the dense model), top-2 copies "
                   "with 1%% noise, as configs/rl/smollm2-worked.yaml")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="the engines' dtype (bfloat16: as on a GPU)")
    p.add_argument("--device", default="auto", help="cpu, cuda or auto")
    p.add_argument("--engine", default="auto", choices=("auto", "fast", "reference"))
    p.add_argument("--out", help="also write the rows as JSON here")
    p.add_argument("--text-file", help="score windows of this text instead of the built-in texts")
    p.add_argument("--chunks", type=int, default=8, help="windows of --text-file (default 8)")
    p.add_argument("--chunk-tokens", type=int, default=256, help="tokens a window (default 256)")
    p.add_argument("--trainer", help="score against the model converted to this recipe (qat-w: "
                   "the QUADS trainer) instead of the float32 model")
    p.add_argument("--four-over-six", action="store_true",
                   help="Four Over Six NVFP4 block scales in the engines and the trainer alike")
    args = p.parse_args()
    loaded = hf.load(args.model)
    device = resolve_device(args.device)
    dense = gpt_from_hf(loaded.model).eval().to(device)
    if args.text_file is None:
        texts, calibration = [loaded.tokenizer.encode(t) for t in TEXTS], None
    else:  # static channels are fixed from the windows after the scored ones
        windows = file_chunks(loaded.tokenizer.encode, args.text_file, 2 * args.chunks,
                              args.chunk_tokens)
        texts, calibration = windows[:args.chunks], windows[args.chunks:]
    tokens, mask = padded_batch(texts, loaded.tokenizer.pad_token_id or 0)
    tokens, mask = tokens.to(device), mask.to(device)
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else None
    rows = []
    for experts in (int(e) for e in args.upcycle.split(",")):
        model = dense if experts == 0 else upcycle_gpt(dense, experts, 2, expert_noise=0.01,
                                                       seed=0).eval().to(device)
        for r in fidelity(model, args.precisions.split(","), tokens, mask, dtype, args.engine,
                          args.trainer, calibration, args.four_over_six):
            rows.append({"experts": experts, **r})
    print(f"{loaded.description}; {len(texts)} texts, {int(mask.sum()) - len(texts)} scored "
          f"tokens; engines in {args.dtype} on {device}")
    print("| model | rollout | NLL (nats/token) | mean abs dlogp | max abs dlogp |\n"
          "|---|---|---:|---:|---:|")
    for r in rows:
        name = "dense" if r["experts"] == 0 else f"{r['experts']} experts"
        print(f"| {name} | {r['precision']} | {r['nll']:.3f} | {r.get('dlogp_mean', 0):.3f} | "
              f"{r.get('dlogp_max', 0):.2f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": loaded.description, "dtype": args.dtype, "device": str(device),
                       "engine": args.engine, "text_file": args.text_file,
                       "trainer": args.trainer,
                       "texts": len(texts), "scored_tokens": int(mask.sum()) - len(texts),
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
