"""Optimizer step time and state memory over a GPT-shaped set of parameters, against torch's
fused AdamW timed in the same run.

The parameters are the matrices of a GPT with --params parameters in total (square attention
projections and 3x-wide MLPs), fp32 masters with random gradients; or, with --model, all the
parameters of a GPT preset. Each optimizer's step is timed after three warm-up steps (its states
exist, the fused AdamW4 step has captured its CUDA graph), each step synchronized (the host's
time counts, as in a training loop that reads the loss each step), and its state bytes per
parameter and the CUDA peak memory of its step are reported. AdamW4 runs twice: its fused
Triton step and its reference step (fused=False); on CUDA, one fused step is also checked against
one reference step on copies of a few matrices ("fused == reference"). On the CPU the fused step
runs only under the Triton interpreter (TRITON_INTERPRET=1, very slow: use a small --params);
otherwise its row is skipped.

    python benchmarks/bench_optim.py [--params 100e6] [--device cuda] [--out results.json]
    python benchmarks/bench_optim.py --model small     # a real model's parameters, norms too
    python benchmarks/bench_optim.py --breakdown       # synchronized / pipelined / host / GPU time
    python benchmarks/bench_optim.py --sweep           # the fused step's time per kernel tiling
    python benchmarks/bench_optim.py --compile-check   # sm_90 compile + ptxas registers, no GPU
    python benchmarks/bench_optim.py --ns-per-matrix   # also Muon / Muon4 with per-matrix NS

Muon and Muon4 run their Newton-Schulz batched over the matrices of one shape (batched_ns, the
default); --ns-per-matrix adds rows with one call per matrix (batched_ns=False) to compare.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time

import torch

from fp4stack.kernels import adamw4 as kernels
from fp4stack.kernels import adamw4_layout as layout
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


def fused_matches_reference(params: list[torch.nn.Parameter], steps: int = 2) -> bool:
    """Whether AdamW4's fused and reference steps give the same bits on copies of `params`."""
    results = []
    for fused in (True, False):
        copies = [torch.nn.Parameter(q.detach().clone()) for q in params]
        opt = AdamW4(copies, lr=1e-3, fused=fused)
        for step in range(steps):
            for i, (c, q) in enumerate(zip(copies, params, strict=True)):
                gen = torch.Generator(device=q.device).manual_seed(step * 1000 + i)
                c.grad = torch.randn(q.shape, device=q.device, generator=gen) * 1e-3
            opt.step()
        results.append((copies, opt))
    (pf, of), (pr, orf) = results
    same = all(torch.equal(a, b) for a, b in zip(pf, pr, strict=True))
    for a, b in zip(pf, pr, strict=True):
        for key, value in orf.state[b].items():
            mine = of.state[a][key]
            if value.dtype == torch.float8_e4m3fn:
                mine, value = mine.view(torch.uint8), value.view(torch.uint8)
            same &= torch.equal(mine, value)
    return same


def compile_check() -> list[str]:
    """Compile the fused AdamW4 step's passes for sm_90 without a GPU (the step pass with and
    without weight decay, with and without masks); report ptxas's registers and spills and the
    SASS instructions per element as they run, where it can: the passes' loop bodies once per
    tile, the rest once per program."""
    from fp4stack.kernels.hopper import compile_sm90

    lines = []
    types = dict(work_ptr="*i32", meta_ptr="*i64", grad_ptrs="*i64", scal_ptr="*fp32",
                 iscal_ptr="*i32", roots_ptr="*fp32", inv_ptr="*fp32", pending_ptr="*fp32")

    def report(name: str, build, elements_per_thread: int, iters: int) -> None:
        # A loop's body runs `iters` times, the rest once: instructions per element as run.
        per = ""
        if build.sass_instructions is not None:
            body = build.loop_sass_instructions or 0
            once = build.sass_instructions - body
            per = (f" (~{(body + once / iters) / elements_per_thread:.0f} per element: "
                   f"{body / elements_per_thread:.0f} in the loop, {once} once)")
        lines.append(f"adamw4 {name}: {build.describe()}{per}")
        print(lines[-1])

    for even in (True, False):
        consts = dict(EVEN=even, BM=kernels.SUMS_BM, KB=kernels.SUMS_KB,
                      ITERS=kernels.SUMS_ITERS)
        build = compile_sm90(kernels.adamw4_sums_kernel,
                             dict(work_ptr="*i32", meta_ptr="*i64", grad_ptrs="*i64",
                                  scal_ptr="*fp32", sums_ptr="*fp64"),
                             consts, num_warps=kernels.SUMS_WARPS,
                             maxnreg=kernels.SUMS_MAXNREG, default="fp32")
        report(f"pass sums full tiles={even}", build,
               kernels.SUMS_BM * kernels.SUMS_KB * 16 // (32 * kernels.SUMS_WARPS),
               kernels.SUMS_ITERS)
    variants = [(layout.CALIBRATE.value, "calibrate", False, True),
                *((layout.STEP.value, "step", decay, even)
                  for decay in (True, False) for even in (True, False))]
    for pass_, name, decay, even in variants:
        consts = dict(PASS=pass_, DECAY=decay, EVEN=even, BM=kernels.BM, KB=kernels.KB,
                      ITERS=kernels.STEP_ITERS)
        build = compile_sm90(kernels.adamw4_kernel, types, consts, num_warps=kernels.NUM_WARPS,
                             maxnreg=kernels.STEP_MAXNREG, default="fp32")
        report(f"pass {name} decay={decay} full tiles={even}", build,
               kernels.BM * kernels.KB * 16 // (32 * kernels.NUM_WARPS), kernels.STEP_ITERS)
    for mode, name in ((layout.FACTORS.value, "factors"), (layout.ROLL.value, "roll")):
        build = compile_sm90(kernels.adamw4_factors_kernel,
                             dict(work_ptr="*i32", meta_ptr="*i64", scal_ptr="*fp32",
                                  sums_ptr="*fp64", roots_ptr="*fp32", inv_ptr="*fp32",
                                  pending_ptr="*fp32"),
                             dict(MODE=mode, LINE=kernels.LINE), num_warps=4, default="fp32")
        lines.append(f"adamw4 {name} launch (per row and column): {build.describe()}")
        print(lines[-1])
    return lines


def pipelined_ms(opt: torch.optim.Optimizer, steps: int = 30) -> float:
    """Milliseconds per step of `steps` steps queued back to back (the host never waits)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.step()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t0) / steps


def host_ms(opt: torch.optim.Optimizer, steps: int = 20) -> float:
    """Median milliseconds step() takes to return while the GPU is kept busy (a long sleep
    kernel queued first), so nothing waits for it: the host's own time."""
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.step()
        times.append(1e3 * (time.perf_counter() - t0))
    torch.cuda.synchronize()
    return statistics.median(times)


def breakdown(params: list[torch.nn.Parameter], device: torch.device, reps: int) -> None:
    """Where the step's time goes: synchronized, pipelined, host and GPU (kernel) time."""
    from fp4stack.kernels.profiling import kernel_times

    makers = {
        "torch AdamW (fused)": lambda: torch.optim.AdamW(params, lr=1e-3, fused=True),
        "AdamW4, CUDA graph off": lambda: AdamW4(params, lr=1e-3, fused=True,
                                                 cuda_graphs=False),
        "AdamW4 (default)": lambda: AdamW4(params, lr=1e-3, fused=True),
    }
    print("| step | synchronized ms | pipelined ms | host ms | GPU ms |\n|---|---:|---:|---:|---:|")
    for name, make in makers.items():
        opt = make()
        for _ in range(3):
            opt.step()
        sync, pipe, host = time_step(opt, device, reps), pipelined_ms(opt), host_ms(opt)
        kernels_ms = kernel_times(opt.step)
        gpu = sum(ms for _, _, ms in kernels_ms)
        print(f"| {name} | {sync:.2f} | {pipe:.2f} | {host:.2f} | {gpu:.2f} |")
        del opt
    print("\nAdamW4 (default), GPU time per kernel:\n\n| kernel | launches | ms |\n|---|---:|---:|")
    for name, launches, ms in kernels_ms:
        print(f"| {name} | {launches} | {ms:.3f} |")


# (BM, KB, iterations, warps, register cap) of the step pass, then of the sums pass, timed by
# --sweep (the first row: the defaults).
SWEEP = (((8, 2, 8, 1, 96), (2, 8, 32, 1, 64)), ((8, 4, 8, 2, 96), (2, 8, 32, 1, 64)),
         ((8, 8, 8, 4, 96), (2, 8, 32, 1, 64)), ((8, 8, 4, 4, 0), (2, 8, 32, 1, 64)),
         ((8, 8, 1, 4, 0), (2, 8, 32, 1, 0)), ((8, 2, 8, 1, 88), (2, 8, 32, 1, 64)),
         ((8, 2, 8, 1, 96), (4, 8, 16, 1, 128)), ((8, 2, 8, 1, 96), (2, 8, 32, 1, 0)))
_TILE_NAMES = ("BM", "KB", "STEP_ITERS", "NUM_WARPS", "STEP_MAXNREG",
               "SUMS_BM", "SUMS_KB", "SUMS_ITERS", "SUMS_WARPS", "SUMS_MAXNREG")


def sweep(params: list[torch.nn.Parameter], device: torch.device, reps: int) -> None:
    """Time the fused AdamW4 step for each tiling of SWEEP (module constants of the kernel)."""
    from fp4stack.kernels.profiling import kernel_times

    defaults = [getattr(kernels, n) for n in _TILE_NAMES]
    print("| step pass (BM, KB, iterations, warps, registers) | sums pass (the same) | step ms | "
          "GPU ms |\n|---|---|---:|---:|")
    for step_tile, sums_tile in SWEEP:
        for n, v in zip(_TILE_NAMES, (*step_tile, *sums_tile), strict=True):
            setattr(kernels, n, v)
        opt = AdamW4(params, lr=1e-3, fused=True)
        for _ in range(3):  # the states and the CUDA graph exist
            opt.step()
        gpu = sum(ms for _, _, ms in kernel_times(opt.step))
        print(f"| {step_tile} | {sums_tile} | {time_step(opt, device, reps):.3f} | {gpu:.3f} |")
        del opt
    for n, v in zip(_TILE_NAMES, defaults, strict=True):
        setattr(kernels, n, v)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", type=float, default=100e6, help="total parameters (default 100M)")
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--model", choices=["small", "tiny"],
                   help="instead of GPT-shaped matrices, every parameter of fp4stack's GPT preset "
                        "(norms included: 1-D tensors keep fp32 states), vocabulary 8192")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", help="write the rows as JSON here")
    p.add_argument("--profile", action="store_true",
                   help="also print the CUDA time of each kernel of one AdamW4 and Muon4 step")
    p.add_argument("--breakdown", action="store_true",
                   help="only the synchronized, pipelined, host and GPU time of torch's fused "
                        "AdamW and AdamW4's fused step (CUDA)")
    p.add_argument("--sweep", action="store_true",
                   help="only time the fused AdamW4 step for several kernel tilings (CUDA)")
    p.add_argument("--compile-check", action="store_true",
                   help="only compile the fused AdamW4 kernel for sm_90 (no GPU needed)")
    p.add_argument("--ns-per-matrix", action="store_true",
                   help="also time Muon and Muon4 with one Newton-Schulz call per matrix "
                        "(batched_ns=False) beside the batched default")
    args = p.parse_args()
    if args.compile_check:
        compile_check()
        return
    device = torch.device(args.device)
    if args.model:
        from fp4stack.models.gpt import GPT, GPTConfig

        model = GPT(getattr(GPTConfig, args.model)(vocab_size=8192)).to(device)
        params = list(model.parameters())
    else:
        shapes = gpt_shapes(args.params, args.dim)
        params = [torch.nn.Parameter(torch.randn(r, c, device=device) * 0.02) for r, c in shapes]
    for q in params:
        q.grad = torch.randn_like(q) * 1e-3
    n = sum(q.numel() for q in params)
    cuda = device.type == "cuda"
    if args.sweep or args.breakdown:
        print(f"{n / 1e6:.1f}M parameters in {len(params)} tensors, device {device}")
        (sweep if args.sweep else breakdown)(params, device, args.reps)
        return
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    makers = {
        "torch AdamW (fused)" if cuda else "torch AdamW": lambda: torch.optim.AdamW(
            params, lr=1e-3, fused=cuda or None),
        "AdamW4 (fused)": lambda: AdamW4(params, lr=1e-3, fused=True),
        "AdamW4 (reference)": lambda: AdamW4(params, lr=1e-3, fused=False),
        "Muon (fp32 momentum, bf16 NS)": lambda: Muon4(params, lr=0.02, quantize=False),
        "Muon4": lambda: Muon4(params, lr=0.02),
    }
    if args.ns_per_matrix:
        makers["Muon (per-matrix NS)"] = lambda: Muon4(params, lr=0.02, quantize=False,
                                                       batched_ns=False)
        makers["Muon4 (per-matrix NS)"] = lambda: Muon4(params, lr=0.02, batched_ns=False)
    if not cuda and not interpreted:
        print("AdamW4 (fused): skipped (on the CPU it runs only with TRITON_INTERPRET=1)")
        del makers["AdamW4 (fused)"]
    rows = []
    print(f"{n / 1e6:.1f}M parameters in {len(params)} tensors, device {device}")
    if cuda:
        matrices = [q for q in params if q.dim() == 2]
        print(f"fused == reference: {fused_matches_reference(matrices[:3])}")
    for name, make in makers.items():
        opt = make()
        for _ in range(3 if cuda else 1):  # creates the states (and captures the graphs)
            opt.step()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        # The interpreter takes ~70 ms per program and pass: one timed step is plenty.
        reps = 1 if "fused" in name and not cuda else args.reps
        ms = time_step(opt, device, reps)
        row = {"optimizer": name, "step_ms": ms, "state_bytes_per_param": state_bytes(opt) / n}
        if cuda:
            row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        rows.append(row)
        del opt
    if args.profile and cuda:
        from fp4stack.kernels.profiling import format_kernel_times, kernel_times

        for name in ("AdamW4 (fused)", "Muon4"):
            opt = makers[name]()
            for _ in range(3):  # the states and graphs exist: steps like the timed ones
                opt.step()
            print(f"\n{name} step, CUDA time per kernel:")
            print(format_kernel_times(kernel_times(opt.step)))
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
