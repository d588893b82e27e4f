"""Rollout decoding speed: tokens/s of the fast engine (static KV cache, CUDA-graph steps,
device sampling) and of the reference engine, per precision and batch, against a roofline.

Random weights, BF16 engines on CUDA; prompts of --prompt random tokens, then --new-tokens
sampled at temperature 1 with EOS outside the vocabulary, so every row decodes every token. A
generate() call is timed whole (prefill, decoding, and the scoring forward of logprobs="score")
after one untimed call (compilation, graph capture). The reference engine decodes
--reference-new-tokens only: it is slow. The roofline of a row: the bytes of the weights a
decoding step reads as the engine stores them (experts: the expected share an MoE batch routes
to), over the bandwidth of a large device-to-device copy (bytes read + written per second),
gives at most that many steps per second; "+KV" adds the static cache's reads.

    python benchmarks/bench_rollout.py --shape all --out benchmarks/results/bench_rollout.json
    python benchmarks/bench_rollout.py --shape small-moe --precisions bf16,quads --batches 256
    python benchmarks/bench_rollout.py --grpo-step   # configs/rl/small-moe.yaml: fast vs reference
    python benchmarks/bench_rollout.py --grpo-step --grpo-arms fast,fast@cuda:1,fast@cuda:1+ahead
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from fp4stack.models.gpt import GPT, GPTConfig
from fp4stack.nn.moe import Experts
from fp4stack.rl.fast_rollout import LENGTH_BUCKET, FastRolloutEngine, batch_bucket
from fp4stack.rl.rollout import PRECISIONS as ENGINE_PRECISIONS
from fp4stack.rl.rollout import RolloutEngine

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {
    # Llama-3.2-1B-like (a 32k vocabulary).
    "dense": dict(vocab_size=32768, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                  ffn_hidden=8192),
    # Qwen3-30B-A3B-like blocks, 8 of them, 64 experts.
    "moe": dict(vocab_size=32768, dim=2048, n_layers=8, n_heads=32, n_kv_heads=4, head_dim=128,
                moe=True, n_experts=64, top_k=8, moe_hidden=768),
    # The ~240M-parameter MoE of the issue that asked for the fast engine (8 experts top-2).
    "moe-240m": dict(vocab_size=32768, dim=1024, n_layers=8, n_heads=16, n_kv_heads=4,
                     moe=True, n_experts=8, top_k=2, moe_hidden=768),
    # SmolLM2-135M upcycled to 8 experts top-2 (configs/rl/smollm2-worked.yaml's policy).
    "smollm2-moe": dict(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3,
                        head_dim=64, moe=True, n_experts=8, top_k=2, moe_hidden=1536),
    # configs/rl/small-moe.yaml's policy (a character vocabulary).
    "small-moe": dict(vocab_size=20, dim=256, n_layers=4, n_heads=4, n_kv_heads=2,
                      ffn_hidden=128, moe=True, n_experts=8, top_k=2, moe_hidden=256),
}
PRECISIONS = ("bf16", "fp8", "nvfp4", "quads")  # the default rows; the engine takes more


class NoEosTokenizer:
    """Pad 0; EOS one past the vocabulary, so sampling never ends a row."""

    def __init__(self, vocab_size: int) -> None:
        self.pad_id, self.eos_id = 0, vocab_size


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """Bytes per second (read + written) of a device-to-device copy of `nbytes`."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    _sync(device)
    return 2 * nbytes * repeats / (time.perf_counter() - t0)


def weight_bytes(model: nn.Module, batch: int) -> int:
    """Bytes of weights one decoding step of `batch` rows reads, as `model` stores them: each
    embedding only its batch rows, each expert stack its expected routed share; not the
    tables a step reads a row of (non-persistent buffers: RoPE's)."""
    total = 0
    for module in model.modules():
        tensors = [*module.parameters(recurse=False),
                   *(b for name, b in module.named_buffers(recurse=False)
                     if name not in module._non_persistent_buffers_set)]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        if isinstance(module, nn.Embedding):
            nbytes = min(batch, module.num_embeddings) * module.embedding_dim * \
                module.weight.element_size()
        elif isinstance(module, Experts):
            k, e = model.config.top_k, model.config.n_experts
            nbytes = int(nbytes * (1 - (1 - k / e) ** batch))  # uniform routing
        total += nbytes
    return total


def kv_bytes(model: GPT, batch: int, length: int) -> int:
    """Bytes of static KV cache a step attends over (keys and values, every layer)."""
    cfg = model.config
    elem = model.model.embed_tokens.weight.element_size()
    return 2 * cfg.n_layers * batch * cfg.n_kv_heads * length * cfg.head_size * elem


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_generate(engine: RolloutEngine, generate, prompts: list[list[int]], new_tokens: int,
                  device: torch.device, generator: torch.Generator, repeats: int) -> dict:
    """Median seconds of `generate(prompts)` with max_new_tokens = new_tokens, after a warm-up."""
    engine.max_new_tokens = new_tokens
    out = generate(prompts, generator)  # compile, capture
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        out = generate(prompts, generator)
        _sync(device)
        times.append(time.perf_counter() - t0)
    decoded = int(out.response_lengths.min())
    if decoded != new_tokens:
        raise RuntimeError(f"a row stopped after {decoded} of {new_tokens} tokens: EOS sampled?")
    seconds = statistics.median(times)
    return {"new_tokens": new_tokens, "seconds": seconds,
            "tokens_per_s": len(prompts) * new_tokens / seconds,
            "ms_per_step": 1e3 * seconds / new_tokens}


def step_profile(call, new_tokens: int, top: int = 15) -> list[dict]:
    """The kernels of one generate() call by device time, per decoding step (the call's time
    over new_tokens: the prefill and the scoring forward are in it too), slowest first."""
    from fp4stack.kernels.profiling import kernel_times

    rows = kernel_times(call, reps=1)[:top]
    for name, launches, ms in rows:
        print(f"    {ms / new_tokens * 1e3:8.1f} us/step  {launches:6d} launches  {name}")
    return [{"kernel": name, "launches": launches, "us_per_step": ms / new_tokens * 1e3}
            for name, launches, ms in rows]


def bench_shape(shape: str, precisions: list[str], batches: list[int], args,
                device: torch.device, bandwidth: float, emit) -> None:
    """Every (precision, batch, engine) row of `shape`, each passed to `emit` when measured."""
    cfg = GPTConfig(**SHAPES[shape], max_seq_len=args.prompt + args.new_tokens)
    with torch.device(device):
        base = GPT(cfg).eval().requires_grad_(False)
    tok = NoEosTokenizer(cfg.vocab_size)
    dtype = torch.bfloat16 if device.type == "cuda" else None
    g = torch.Generator(device=device).manual_seed(0)
    for precision in precisions:
        kw = dict(dtype=dtype, temperature=1.0, logprobs=args.logprobs,
                  compensation=args.compensation, compensation_mode=args.compensation_mode,
                  four_over_six=args.four_over_six)
        engine = FastRolloutEngine(base, tok, precision, **kw)
        variants = [("fast", engine)] + [
            (name, FastRolloutEngine(base, tok, precision, **options, **kw))
            for name, options in engine_variants(args)]
        compensated = engine.recipe is not None and engine.recipe.compensation is not None
        static = args.compensation_mode == "static" and compensated
        if static:  # channels fixed once, from random sequences of the prompt's length
            calibration = torch.randint(1, cfg.vocab_size, (8, args.prompt), generator=g,
                                        device=device).tolist()
            for _, eng in variants:
                eng.calibrate(calibration)
        label = f"{precision}:static" if static else precision
        for batch in batches:
            prompts = torch.randint(1, cfg.vocab_size, (batch, args.prompt), generator=g,
                                    device=device).tolist()
            weights = weight_bytes(engine.model, batch_bucket(batch))
            length = -(-(args.prompt + args.new_tokens) // LENGTH_BUCKET) * LENGTH_BUCKET
            kv = kv_bytes(engine.model, batch_bucket(batch), length)
            runs = [(name, eng, eng.generate, args.new_tokens) for name, eng in variants]
            if not args.no_reference:
                # The reference loop on the same converted model.
                runs.append(("reference", engine,
                             functools.partial(RolloutEngine.generate, engine),
                             args.reference_new_tokens))
            for name, eng, generate, n in runs:
                r = time_generate(eng, generate, prompts, n, device, g, args.repeats)
                if args.profile and name != "reference" and device.type == "cuda":
                    r["profile"] = step_profile(functools.partial(generate, prompts, g), n)
                steps_s = bandwidth / weights
                emit({"shape": shape, "precision": label, "engine": name, "batch": batch,
                      "compensation": args.compensation if compensated else None,
                      "four_over_six": args.four_over_six,
                      "prompt": args.prompt, **r, "weight_mb": weights / 1e6,
                      "kv_mb": kv / 1e6, "roofline_tokens_per_s": batch * steps_s,
                      "roofline_kv_tokens_per_s": batch * bandwidth / (weights + kv),
                      "graphs": name != "reference" and eng.captured_graphs > 0})
        del engine, variants
        if device.type == "cuda":
            torch.cuda.empty_cache()


def engine_variants(args) -> list[tuple[str, dict]]:
    """The fast engine's optional variants timed beside it: (row name, engine options)."""
    out = []
    if args.compile:
        out.append(("fast-compiled", {"compile_step": True}))
    if args.unfused:
        out.append(("fast-unfused", {"fuse_projections": False}))
    return out


def parse_arm(text: str) -> dict:
    """A GRPO timing arm ENGINE[@ENGINE_DEVICE][+ahead]: fast@cuda:1+ahead is the fast engine
    on the second GPU, sampling one step ahead (off_policy 1) while the trainer trains;
    fast@process the engine as the second process of a two-process torchrun, on its own GPU."""
    engine, ahead = (text[:-len("+ahead")], 1) if text.endswith("+ahead") else (text, 0)
    engine, _, where = engine.partition("@")
    if engine not in ("fast", "reference"):
        raise argparse.ArgumentTypeError(f"arm {text!r}: ENGINE[@DEVICE][+ahead] with ENGINE "
                                         "fast or reference")
    return {"arm": text, "engine": engine, "engine_device": where or "same", "off_policy": ahead}


def default_arms() -> str:
    """fast and reference on the trainer's GPU; with a second GPU also the engine there, and
    one step ahead on either."""
    arms = "fast,reference,fast+ahead"
    if torch.cuda.device_count() > 1:
        arms += ",fast@cuda:1,fast@cuda:1+ahead,fast@process,fast@process+ahead"
    return arms


def _run_arm(cfg) -> None:
    # One process, or (engine_device: process) the two of a torchrun, each on its own GPU.
    import yaml

    from fp4stack.rl.trainer import run_rl

    if cfg.engine_device != "process":
        run_rl(cfg, log=lambda *a: None)
        return
    config = cfg.out_dir.with_suffix(".yaml")
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(yaml.safe_dump(cfg.to_dict()))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "fp4stack.cli", "rl", "--config", str(config)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")


def grpo_step_times(steps: int, config: Path, arms: list[dict], device: str) -> list[dict]:
    """Median seconds of a GRPO step of `config` (random policy: no SFT, no evaluation) per
    arm, with the median seconds of its generation and of the trainer's wait for it; the first
    two steps (compilation, graph capture, the first step ahead) are left out."""
    from fp4stack.rl.config import load_rl_config
    from fp4stack.train.metrics import read_metrics

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, arm in enumerate(arms):
            out = Path(tmp) / str(i)
            cfg = load_rl_config(config, engine=arm["engine"],
                                 engine_device=arm["engine_device"],
                                 off_policy=arm["off_policy"], steps=steps + 2, sft_steps=0,
                                 eval_every=0, device=device, out=str(out))
            _run_arm(cfg)
            records = [r for r in read_metrics(out) if "step_s" in r][2:]
            rows.append({**arm, "steps": len(records),
                         **{k: statistics.median(r[k] for r in records)
                            for k in ("step_s", "generate_s", "rollout_wait_s")},
                         "step_s_all": [r["step_s"] for r in records]})
    base = rows[0]["step_s"]
    for r in rows:
        r["vs_first"] = r["step_s"] / base
    return rows


def format_table(rows: list[dict]) -> str:
    lines = ["| shape | precision | engine | batch | new tokens | tokens/s | ms/step | "
             "weights MB/step | roofline tok/s | % | +KV roofline tok/s |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        share = 100 * r["tokens_per_s"] / r["roofline_tokens_per_s"]
        lines.append(f"| {r['shape']} | {r['precision']} | {r['engine']} | {r['batch']} | "
                     f"{r['new_tokens']} | {r['tokens_per_s']:,.0f} | {r['ms_per_step']:.2f} | "
                     f"{r['weight_mb']:,.0f} | {r['roofline_tokens_per_s']:,.0f} | "
                     f"{share:.1f} | {r['roofline_kv_tokens_per_s']:,.0f} |")
    return "\n".join(lines)


def _list(text: str, allowed=None, cast=str) -> list:
    items = [cast(x) for x in text.split(",") if x]
    bad = [x for x in items if allowed is not None and x not in allowed]
    if bad or not items:
        raise argparse.ArgumentTypeError(f"{text!r}: choose from {list(allowed or [])}")
    return items


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="all", choices=(*SHAPES, "all"))
    p.add_argument("--precisions", default=",".join(PRECISIONS),
                   type=lambda s: _list(s, ENGINE_PRECISIONS),
                   help=f"comma-separated, of {list(ENGINE_PRECISIONS)} (default {PRECISIONS})")
    p.add_argument("--batches", default="1,16,64,256", type=lambda s: _list(s, cast=int))
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens (default 64)")
    p.add_argument("--new-tokens", type=int, default=256, help="decoded tokens, fast engine")
    p.add_argument("--reference-new-tokens", type=int, default=16,
                   help="decoded tokens, reference engine (default 16)")
    p.add_argument("--no-reference", action="store_true", help="time the fast engine only")
    p.add_argument("--compile", action="store_true",
                   help="also time the fast engine with its step through torch.compile")
    p.add_argument("--unfused", action="store_true",
                   help="also time the fast engine with q/k/v and gate/up as separate GEMMs "
                        "(the engine fuses them by default)")
    p.add_argument("--logprobs", default="score", choices=("score", "sample"))
    p.add_argument("--compensation", type=float, default=0.05, help="quads: channel fraction")
    p.add_argument("--compensation-mode", default="dynamic", choices=("dynamic", "static"),
                   help="quads: channels per batch, or fixed by a calibration forward")
    p.add_argument("--four-over-six", action="store_true",
                   help="Four Over Six block scales on the NVFP4 operands (RLConfig.four_over_six)")
    p.add_argument("--repeats", type=int, default=1, help="timed calls per row (median)")
    p.add_argument("--grpo-step", action="store_true",
                   help="instead: time GRPO steps of configs/rl/small-moe.yaml per engine")
    p.add_argument("--grpo-steps", type=int, default=5, help="steps timed with --grpo-step")
    p.add_argument("--grpo-config", default=str(ROOT / "configs/rl/small-moe.yaml"),
                   help="the RL config --grpo-step times (default configs/rl/small-moe.yaml)")
    p.add_argument("--grpo-arms", type=lambda s: [parse_arm(a) for a in s.split(",") if a],
                   help="comma-separated ENGINE[@ENGINE_DEVICE][+ahead] arms of --grpo-step "
                        f"(default {default_arms()!r}; the first is the ratios' base)")
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    p.add_argument("--profile", action="store_true",
                   help="also list each fast row's slowest kernels (torch.profiler, one call)")
    p.add_argument("--out", help="also write the results as JSON here (after every row)")
    args = p.parse_args()
    device = torch.device(args.device)
    meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes")}
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        meta["triton"] = None
    print(f"{meta['device']}, torch {meta['torch']}, triton {meta['triton']}, {meta['date']}")
    if args.grpo_step:
        arms = args.grpo_arms or [parse_arm(a) for a in default_arms().split(",")]
        rows = grpo_step_times(args.grpo_steps, Path(args.grpo_config), arms, args.device)
        print("| arm | step s | vs first | generate s | trainer waited s | steps |")
        print("|---|---:|---:|---:|---:|---:|")
        for r in rows:
            print(f"| {r['arm']} | {r['step_s']:.3f} | {r['vs_first']:.2f}x | "
                  f"{r['generate_s']:.3f} | {r['rollout_wait_s']:.3f} | {r['steps']} |")
        if args.out:
            Path(args.out).write_text(json.dumps({**meta, "grpo": rows}, indent=1))
        return
    meta["copy_gb_s"] = copy_bandwidth(device, 1 << (30 if device.type == "cuda" else 26)) / 1e9
    print(f"device copy bandwidth: {meta['copy_gb_s']:,.0f} GB/s (read + write)")
    rows: list[dict] = []

    def emit(row: dict) -> None:
        rows.append(row)
        print(f"{row['shape']} {row['precision']} {row['engine']} batch {row['batch']}: "
              f"{row['tokens_per_s']:,.0f} tokens/s", flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps({**meta, "rows": rows}, indent=1))

    for shape in (SHAPES if args.shape == "all" else [args.shape]):
        bench_shape(shape, args.precisions, args.batches, args, device,
                    meta["copy_gb_s"] * 1e9, emit)
    print(format_table(rows))


if __name__ == "__main__":
    main()
