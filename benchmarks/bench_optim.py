"""Optimizer step time and state memory over a GPT-shaped set of parameters, against torch's
fused AdamW timed in the same run.

The parameters are the matrices of a GPT with --params parameters in total (square attention
projections and 3x-wide MLPs), fp32 masters with random gradients. Each optimizer's step is
timed after warm-up steps (its states exist), and its state bytes per parameter and the CUDA
peak memory of its step are reported.

    python benchmarks/bench_optim.py [--params 100e6] [--device cuda] [--out results.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time

import torch

from fp4stack.optim import AdamW4, Muon4


def gpt_shapes(total: float, dim: int) -> list[tuple[int, int]]:
    """Matrix shapes of enough GPT blocks (4 dim² attention, 3 x 3 dim² MLP) to reach `total`."""
    block = [(dim, dim)] * 4 + [(3 * dim, dim)] * 2 + [(dim, 3 * dim)]
    per_block = sum(r * c for r, c in block)
    return block * max(1, round(total / per_block))


def state_bytes(opt: torch.optim.Optimizer) -> int:
    if hasattr(opt, "state_bytes"):
        return opt.state_bytes()
    return sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
               if isinstance(v, torch.Tensor))


def time_step(opt: torch.optim.Optimizer, device: torch.device, reps: int) -> float:
    """Median milliseconds of opt.step()."""
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", type=float, default=100e6, help="total parameters (default 100M)")
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", help="write the rows as JSON here")
    args = p.parse_args()
    device = torch.device(args.device)
    shapes = gpt_shapes(args.params, args.dim)
    params = [torch.nn.Parameter(torch.randn(r, c, device=device) * 0.02) for r, c in shapes]
    for q in params:
        q.grad = torch.randn_like(q) * 1e-3
    n = sum(q.numel() for q in params)
    cuda = device.type == "cuda"
    makers = {
        "torch AdamW (fused)" if cuda else "torch AdamW": lambda: torch.optim.AdamW(
            params, lr=1e-3, fused=cuda or None),
        "AdamW4": lambda: AdamW4(params, lr=1e-3),
        "Muon (fp32 momentum, bf16 NS)": lambda: Muon4(params, lr=0.02, quantize=False),
        "Muon4": lambda: Muon4(params, lr=0.02),
    }
    rows = []
    print(f"{n / 1e6:.1f}M parameters in {len(params)} matrices, device {device}")
    for name, make in makers.items():
        opt = make()
        opt.step()  # creates the states
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        ms = time_step(opt, device, args.reps)
        row = {"optimizer": name, "step_ms": ms, "state_bytes_per_param": state_bytes(opt) / n}
        if cuda:
            row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        rows.append(row)
        del opt
    base = rows[0]["step_ms"]
    print("| optimizer | step ms | vs torch AdamW | state bytes/param |" +
          (" peak GiB |" if cuda else ""))
    print("|---|---:|---:|---:|" + ("---:|" if cuda else ""))
    for r in rows:
        print(f"| {r['optimizer']} | {r['step_ms']:.2f} | {r['step_ms'] / base:.2f}x | "
              f"{r['state_bytes_per_param']:.3f} |" + (f" {r['peak_gib']:.2f} |" if cuda else ""))
    if args.out:
        meta = {"date": datetime.date.today().isoformat(), "device": str(device),
                "name": torch.cuda.get_device_name() if cuda else "cpu",
                "torch": torch.__version__, "params": n}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
