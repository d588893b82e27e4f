"""Where an RL policy starts after its SFT warm-up, per task level, warm-up length and recipe.

GRPO needs room to climb: a policy that the warm-up already brought to ~0.9 greedy pass@1 can
gain few points, and one whose samples all fail gets no signal. For each (level, SFT steps) this
builds the policy of an RL config (e.g. SmolLM2 upcycled to 8 experts), warms it up as `fp4stack
rl` would, and prints the greedy pass@1 on the test set, the mean reward of sampled responses at
temperature 1 (what GRPO's groups see), their mean length in tokens and the share of groups with
mixed rewards (the groups that give a gradient). With --precisions, also where each rollout
precision starts from the same weights: its greedy pass@1 and the mean and max |log p_engine -
log p_policy| over the reference completions of --prompts held-out examples (the policy in
float32). --sft-recipes compares warm-ups in BF16 and quantization-aware (RLConfig.sft_recipe).
Answers which task setting and start issue 37's runs use (docs/results/rl.md).

    FP4STACK_SMOLLM2_GGUF=SmolLM2-135M-Instruct.Q4_1.gguf python experiments/study_sft_start.py \\
        --config configs/rl/smollm2-worked.yaml --levels 2 --sft-steps 60 \\
        --sft-recipes bf16,nvfp4@forward --precisions bf16,nvfp4,w4a16,quads@0.5
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from fp4stack.data.tasks import load_task
from fp4stack.device import resolve_device
from fp4stack.rl import policy as lm
from fp4stack.rl.compare import parse_run
from fp4stack.rl.config import load_rl_config
from fp4stack.rl.fast_rollout import build_engine
from fp4stack.rl.policies import encode_example, left_padded
from fp4stack.rl.start import prepare_policy
from fp4stack.rl.trainer import evaluate


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


@torch.no_grad()
def completion_batch(tokenizer, task, examples, device) -> tuple[torch.Tensor, ...]:
    """(tokens, mask, target) on `device`: the examples' prompts with their reference
    completions, one left-padded batch, target marking the completions' tokens."""
    rows = [encode_example(tokenizer, e.prompt, task.completion(e)) for e in examples]
    return tuple(t.to(device) for t in left_padded(rows, tokenizer.pad_id))


def completion_mismatch(engine, model, examples, task) -> dict[str, float]:
    """Mean and max |log p_engine - log p_model| over the reference completions' tokens of
    `examples` (teacher-forced, one left-padded batch), and the engine's mean negative log-prob
    of them."""
    tokens, mask, target = completion_batch(engine.tokenizer, task, examples, engine.device)
    got = lm.token_logprobs(engine.model, tokens, mask)[target].float()
    want = lm.token_logprobs(model, tokens, mask)[target].float()  # the engine is on its device
    diff = (got - want).abs()
    return {"dlogp_mean": diff.mean().item(), "dlogp_max": diff.max().item(),
            "completion_nll": -got.mean().item()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="an RL config (configs/rl/*.yaml)")
    p.add_argument("--levels", default="2,3", help="task levels (comma-separated)")
    p.add_argument("--sft-steps", default="25,50,200", help="warm-up lengths (comma-separated)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: the config's")
    p.add_argument("--group", type=int, default=8, help="samples per prompt for the sampled stats")
    p.add_argument("--prompts", type=int, default=64, help="prompts for the sampled stats")
    p.add_argument("--sft-recipes", default=None,
                   help="warm-up recipes (comma-separated; default: the config's sft_recipe)")
    p.add_argument("--precisions", default="bf16",
                   help="rollout precisions to start from the same weights, as rl-compare names "
                        "runs (e.g. bf16,nvfp4,w4a16,quads@0.5)")
    p.add_argument("--out", default=None, help="JSON file for the rows")
    args = p.parse_args()
    rows = []
    base = load_rl_config(args.config)
    recipes = (args.sft_recipes or base.sft_recipe).split(",")
    runs = [(name, parse_run(name)) for name in args.precisions.split(",")]
    for level in (int(v) for v in args.levels.split(",")):
        for steps in (int(v) for v in args.sft_steps.split(",")):
            for recipe in recipes:
                cfg = load_rl_config(args.config, sft_steps=steps, sft_recipe=recipe,
                                     task_options={**base.task_options, "level": level},
                                     max_new_tokens=args.max_new_tokens)
                rows += study_start(cfg, runs, args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


def study_start(cfg, runs, args) -> list[dict]:
    """One row per rollout precision of one warm-up (cfg's level, sft_steps, sft_recipe)."""
    t0 = time.perf_counter()
    device = resolve_device(cfg.device)
    task = load_task(cfg.task, **cfg.task_options)
    torch.manual_seed(cfg.seed)
    model, tokenizer = prepare_policy(cfg, task, device, None, log=lambda s: None)
    stream = task.train_examples(cfg.seed + 777)  # prompts no run of this seed trains on
    examples = [next(stream) for _ in range(args.prompts)]
    rows = []
    for name, run in runs:
        engine = build_engine(cfg.engine, model, tokenizer, run["rollout"], temperature=1.0,
                              max_new_tokens=cfg.max_new_tokens,
                              compensation=run.get("compensation", cfg.compensation),
                              compensation_mode=run.get("compensation_mode"),
                              dtype=torch.bfloat16 if device.type == "cuda" else None)
        engine.sync(model)
        row = {"level": cfg.task_options.get("level"), "sft_steps": cfg.sft_steps,
               "sft_recipe": cfg.sft_recipe, "rollout": name,
               "max_new_tokens": cfg.max_new_tokens,
               "greedy_pass1": evaluate(engine, task, task.test_set()[:cfg.eval_size]),
               **completion_mismatch(engine, model, examples, task)}
        if name == "bf16":
            row |= sampled_stats(engine, task, examples, args.group, cfg.seed)
        row["seconds"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
        del engine
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    main()
