"""Where an RL policy starts after its SFT warm-up, per task level and warm-up length.

GRPO needs room to climb: a policy that the warm-up already brought to ~0.9 greedy pass@1 can
gain few points, and one whose samples all fail gets no signal. For each (level, SFT steps) this
builds the policy of an RL config (e.g. SmolLM2 upcycled to 8 experts), warms it up as `fp4stack
rl` would, and prints the greedy pass@1 on the test set, the mean reward of sampled responses at
temperature 1 (what GRPO's groups see), their mean length in tokens and the share of groups with
mixed rewards (the groups that give a gradient). Answers which task setting issue 37's runs use
(docs/results/rl.md).

    FP4STACK_SMOLLM2_GGUF=SmolLM2-135M-Instruct.Q4_1.gguf python experiments/study_sft_start.py \\
        --config configs/rl/smollm2-worked.yaml --levels 2,3 --sft-steps 25,50,200
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from fp4stack.data.tasks import load_task
from fp4stack.device import resolve_device
from fp4stack.rl.config import load_rl_config
from fp4stack.rl.fast_rollout import build_engine
from fp4stack.rl.policies import encode_example
from fp4stack.rl.trainer import evaluate, prepare_policy


def sampled_stats(engine, task, examples, group: int, seed: int) -> dict[str, float]:
    """Mean reward, mean response length and the share of groups whose rewards differ, over
    `group` samples per example at the engine's temperature."""
    prompts = [encode_example(engine.tokenizer, e.prompt)[0]
               for e in examples for _ in range(group)]
    gen = torch.Generator(device=engine.device).manual_seed(seed)
    rollout = engine.generate(prompts, gen)
    responses = rollout.responses()
    rewards = [task.score(engine.tokenizer.decode(r), e)
               for r, e in zip(responses, (e for e in examples for _ in range(group)), strict=True)]
    groups = [rewards[i:i + group] for i in range(0, len(rewards), group)]
    return {"sampled_reward": sum(rewards) / len(rewards),
            "mean_tokens": sum(len(r) for r in responses) / len(responses),
            "mixed_groups": sum(len(set(g)) > 1 for g in groups) / len(groups)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="an RL config (configs/rl/*.yaml)")
    p.add_argument("--levels", default="2,3", help="task levels (comma-separated)")
    p.add_argument("--sft-steps", default="25,50,200", help="warm-up lengths (comma-separated)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: the config's")
    p.add_argument("--group", type=int, default=8, help="samples per prompt for the sampled stats")
    p.add_argument("--prompts", type=int, default=64, help="prompts for the sampled stats")
    p.add_argument("--out", default=None, help="JSON file for the rows")
    args = p.parse_args()
    rows = []
    for level in (int(v) for v in args.levels.split(",")):
        for steps in (int(v) for v in args.sft_steps.split(",")):
            t0 = time.perf_counter()
            base = load_rl_config(args.config)
            cfg = load_rl_config(args.config, sft_steps=steps,
                                 task_options={**base.task_options, "level": level},
                                 max_new_tokens=args.max_new_tokens)
            device = resolve_device(cfg.device)
            task = load_task(cfg.task, **cfg.task_options)
            torch.manual_seed(cfg.seed)
            model, tokenizer = prepare_policy(cfg, task, device, None, log=lambda s: None)
            engine = build_engine(cfg.engine, model, tokenizer, "bf16", temperature=1.0,
                                  max_new_tokens=cfg.max_new_tokens,
                                  dtype=torch.bfloat16 if device.type == "cuda" else None)
            stream = task.train_examples(cfg.seed + 777)  # prompts no run of this seed trains on
            examples = [next(stream) for _ in range(args.prompts)]
            row = {"level": level, "sft_steps": steps, "max_new_tokens": cfg.max_new_tokens,
                   "greedy_pass1": evaluate(engine, task, task.test_set()[:cfg.eval_size]),
                   **sampled_stats(engine, task, examples, args.group, cfg.seed),
                   "seconds": round(time.perf_counter() - t0, 1)}
            rows.append(row)
            print(json.dumps(row), flush=True)
            del engine, model
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
