"""The trainer's plain (bf16) MoE experts, forward and backward: one torch._grouped_mm per GEMM
against the per-expert loop (`nn/grouped_experts.py`), at a policy's expert shape.

Each variant runs the sorted path of an `Experts` module under bf16 autocast (as the RL trainer
does) on T tokens routed top-k by a random router, then its backward; the table gives the wall
time per forward+backward (the host issuing launches is part of it: no graph, no compile), the
GPU kernel time under the profiler, the kernel launches, and how far the grouped outputs and
gradients are from the loop's (close, not equal: the grouped kernel is not cuBLAS's).

    python benchmarks/bench_moe_train.py [--tokens 30720] [--dim 576] [--hidden 1536]
        [--experts 8] [--top-k 2] [--repeats 10] [--out moe_train.json]

The defaults are the upcycled SmolLM2's experts at a GRPO step of 256 rows of ~120 tokens.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time

import torch

from fp4stack.kernels.profiling import kernel_times
from fp4stack.nn import grouped_experts as ge
from fp4stack.nn.moe import Experts


def step(experts: Experts, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor):
    """Forward and backward of the sorted path: (output, grads of x and the two stacks)."""
    experts.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        y = experts(x, weights, indices)
    y.float().square().mean().backward()
    return y.detach(), x.grad, experts.gate_up_proj.grad, experts.down_proj.grad


def timed(fn, repeats: int, device: torch.device) -> dict[str, float]:
    fn()  # warm-up
    walls = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        walls.append(1e3 * (time.perf_counter() - t0))
    kernels = kernel_times(fn, reps=1) if device.type == "cuda" else []
    return {"wall_ms": statistics.median(walls),
            "gpu_kernel_ms": sum(ms for _, _, ms in kernels),
            "launches": sum(n for _, n, _ in kernels)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=30720)
    p.add_argument("--dim", type=int, default=576)
    p.add_argument("--hidden", type=int, default=1536)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", help="also write the results as JSON here")
    args = p.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    experts = Experts(args.dim, args.hidden, args.experts).to(device)
    x = torch.randn(args.tokens, args.dim, device=device)
    router = torch.randn(args.tokens, args.experts, device=device).softmax(-1)
    weights, indices = router.topk(args.top_k, dim=-1)
    runs = ge.grouped_mm_runs(experts.gate_up_proj, torch.bfloat16)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{args.tokens} tokens, {args.experts} experts top-{args.top_k}, {args.dim} -> "
          f"{args.hidden} on {device_name}; torch._grouped_mm {'runs' if runs else 'does not run'}")
    real = ge.grouped_mm_runs
    rows, outputs = {}, {}
    for name, use in (("loop", False), ("grouped_mm", True)):
        if use and not runs:
            continue
        ge.grouped_mm_runs = real if use else (lambda *a: False)
        try:
            outputs[name] = step(experts, x, weights, indices)
            rows[name] = timed(lambda: step(experts, x, weights, indices), args.repeats, device)
        finally:
            ge.grouped_mm_runs = real
    if len(outputs) == 2:
        rel = [((a.float() - b.float()).norm() / b.float().norm()).item()
               for a, b in zip(outputs["grouped_mm"], outputs["loop"], strict=True)]
        names = ("y", "dx", "dgate_up", "ddown")
        rows["grouped_mm"]["rel_err_vs_loop"] = dict(zip(names, rel, strict=True))
        rows["grouped_mm"]["speedup_vs_loop"] = (rows["loop"]["wall_ms"]
                                                 / rows["grouped_mm"]["wall_ms"])
    print("| variant | fwd+bwd ms | GPU kernel ms | launches | vs loop |")
    print("|---|---:|---:|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {r['wall_ms']:.2f} | {r['gpu_kernel_ms']:.2f} | {r['launches']} | "
              f"{r.get('speedup_vs_loop', 1.0):.2f}x |")
    if "rel_err_vs_loop" in rows.get("grouped_mm", {}):
        print("relative error against the loop:", {k: f"{v:.1e}" for k, v in
                                                   rows["grouped_mm"]["rel_err_vs_loop"].items()})
    if args.out:
        meta = {"device": device_name,
                "torch": torch.__version__, "date": datetime.datetime.now(datetime.UTC).isoformat(
                    timespec="minutes"), "args": vars(args)}
        with open(args.out, "w") as f:
            json.dump({**meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
