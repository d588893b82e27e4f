"""Trainer-rollout mismatch against the share of activation channels QUADS compensates.

One batch of rollouts from the RL config's starting policy (its SFT warm-up, cached in --cache),
scored by each engine precision and by the trainer it is paired with; prints k3, mean and max
|Δlogp| and the sequence ESS per row as a markdown table. Rows: BF16, FP8, naive NVFP4, W4A16
and NVFP4 with per-token activation scales, then QUADS with per-tensor and per-token scales at
each --fractions share. Runs on CPU in seconds for configs/rl/tiny.yaml.

    python experiments/study_quads_compensation.py --config configs/rl/tiny.yaml \
        --cache runs/rl-compare/tiny/sft

--modes dynamic,static adds, per share, the channels fixed once from calibration_size task
examples (as `compensation_mode: static` runs calibrate) beside the per-batch choice; --json
writes the rows.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
from pathlib import Path

import torch

from fp4stack.convert import quantize_model
from fp4stack.data.tasks import load_task
from fp4stack.rl import policy as lm
from fp4stack.rl.config import load_rl_config
from fp4stack.rl.metrics import mismatch_metrics
from fp4stack.rl.policies import calibration_sequences, encode_example
from fp4stack.rl.rollout import RolloutEngine
from fp4stack.rl.start import prepare_policy


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/rl/tiny.yaml")
    p.add_argument("--cache", default="runs/rl-compare/tiny/sft",
                   help="directory of the cached SFT policy (written if missing)")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--fractions", default="0.05,0.1,0.25,0.5,1.0")
    p.add_argument("--modes", default="dynamic",
                   help="compensation modes of the quads rows: dynamic, static or both")
    p.add_argument("--group", type=int, help="samples per prompt (default: the config's)")
    p.add_argument("--json", help="also write the rows here")
    p.add_argument("--sft-steps", type=int, help="warm-up steps (default: the config's)")
    p.add_argument("--max-new-tokens", type=int, help="default: the config's")
    args = p.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    cfg = load_rl_config(args.config, sft_steps=args.sft_steps,
                         max_new_tokens=args.max_new_tokens)
    task = load_task(cfg.task, **cfg.task_options)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, tok = prepare_policy(cfg, task, device, Path(args.cache), log=lambda *a: None)
    stream = task.train_examples(cfg.seed)
    examples = [next(stream) for _ in range(args.prompts)]
    group = args.group or cfg.group_size
    prompts = [encode_example(tok, e.prompt)[0] for e in examples for _ in range(group)]
    calibration = calibration_sequences(task, tok, cfg.calibration_size, cfg.seed)
    qat = copy.deepcopy(model)
    quantize_model(qat, "qat-w")
    fractions = [float(k) for k in args.fractions.split(",")]
    rows = [("bf16", None, None, model), ("fp8", None, None, model),
            ("nvfp4", None, None, model), ("nvfp4", None, None, qat),
            ("w4a16", None, None, qat), ("nvfp4-token", None, None, model),
            ("nvfp4-token", None, None, qat)]
    rows += [(p, k, mode, qat) for p in ("quads", "quads-token") for mode in modes
             for k in fractions]
    print("| rollout | compensated channels | mode | trainer | k3 | mean abs dlogp | "
          "max abs dlogp | sequence ESS |")
    print("|---|---:|---|---|---:|---:|---:|---:|")
    table = []
    for precision, fraction, mode, trainer in rows:
        engine = RolloutEngine(model, tok, precision, max_new_tokens=cfg.max_new_tokens,
                               compensation=fraction, compensation_mode=mode)
        engine.sync(trainer)
        if mode == "static":
            engine.calibrate(calibration)
        out = engine.generate(prompts, torch.Generator(device=device).manual_seed(cfg.seed))
        with torch.no_grad():
            lp = lm.token_logprobs(trainer, out.tokens, out.mask)
        m = mismatch_metrics(lp, out.logprobs, out.response_mask)
        share = "-" if fraction is None else f"{fraction:.1%}"
        name = "qat-w" if trainer is qat else "bf16"
        table.append({"rollout": precision, "compensation": fraction, "mode": mode,
                      "trainer": name, **{k: m[k] for k in ("k3", "logp_diff_mean",
                                                           "logp_diff_max", "ess")}})
        print(f"| {precision} | {share} | {mode or '-'} | {name} | {m['k3']:.2e} | "
              f"{m['logp_diff_mean']:.4f} | {m['logp_diff_max']:.3f} | {m['ess']:.3f} |",
              flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"config": args.config, "prompts": args.prompts, "group": group,
             "calibration_size": cfg.calibration_size, "device": str(device),
             "torch": torch.__version__, "date": datetime.date.today().isoformat(),
             "rows": table}, indent=1))


if __name__ == "__main__":
    main()
