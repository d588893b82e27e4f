"""Speed of NVFP4 quantize / fake-quantize / dequantize on a CUDA GPU, against baselines timed in
the same run: a device copy of the same bytes, and the torch reference (eager and torch.compile).

Bandwidth counts the bytes that must move: each input read once per pass the algorithm needs
(two passes over x when the global amax is computed in the call), each output written once.

    python benchmarks/bench_quantize.py [--size 8192] [--sweep] [--out results.json]
    python benchmarks/bench_quantize.py --only pair   # only the cases whose name has "pair"
    python benchmarks/bench_quantize.py --compile-check   # no GPU: build the kernels for sm_90
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time

import torch
import triton
import triton.testing

from fp4stack.formats import nvfp4 as reference
from fp4stack.formats.spec import QuantSpec
from fp4stack.kernels import nvfp4 as kernels


def bench(fn, reps: int = 3, graph: bool = True) -> tuple[float, bool]:
    """(median milliseconds over `reps` runs, whether it was timed as a CUDA graph replay).

    A graph replay times the device work alone; a call that syncs with the host (the NaN check)
    cannot be captured and is timed eagerly, Python launch overhead included.
    """
    if graph:
        try:
            ms = [triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median")
                  for _ in range(reps)]
            return statistics.median(ms), True
        except Exception:  # not capturable: fall back to eager timing
            torch.cuda.synchronize()
    ms = [triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")
          for _ in range(reps)]
    return statistics.median(ms), False


# Tile shapes (rows, 16-element blocks, warps) a sweep tries: row-major inputs, and column-major
# ones (transposed views), whose tiles take many rows and few blocks.
ROW_TILES = [(bm, kb, w) for bm in (2, 4, 8, 16) for kb in (16, 32, 64) for w in (1, 2, 4)
             if 1024 <= bm * kb * 16 <= 32768 and bm * kb >= 32 * w]
COLUMN_TILES = [(bm, kb, w) for bm in (32, 64, 128, 256) for kb in (1, 2, 4, 8)
                for w in (1, 2, 4, 8) if 1024 <= bm * kb * 16 <= 16384 and bm >= 32 * w]


def transposing(in_place: bool, fn):
    """fn, called with transposed operands read in place or copied to rows first."""

    def call():
        saved = kernels.TRANSPOSE_IN_KERNEL
        kernels.TRANSPOSE_IN_KERNEL = in_place
        try:
            return fn()
        finally:
            kernels.TRANSPOSE_IN_KERNEL = saved

    return call


def sweep_tiles(attr: str, shapes: list[tuple[int, int, int]], fn, label: str) -> list[dict]:
    """Time `fn` with each tile shape as kernels.<attr>, leave the fastest set there, print the
    six fastest and return every row, fastest first."""
    rows = []
    for bm, kb, warps in shapes:
        setattr(kernels, attr, kernels.TileConfig(bm, kb, warps))
        ms, _ = bench(fn, reps=1)
        rows.append({"block_m": bm, "blocks_k": kb, "num_warps": warps, "ms": ms})
    rows.sort(key=lambda r: r["ms"])
    best = rows[0]
    setattr(kernels, attr, kernels.TileConfig(best["block_m"], best["blocks_k"],
                                              best["num_warps"]))
    print(f"{label} tile sweep, fastest first:")
    for r in rows[:6]:
        print(f"  rows={r['block_m']:3d} blocks={r['blocks_k']:3d} warps={r['num_warps']}  "
              f"{r['ms'] * 1e3:7.1f} us")
    return rows


_P = dict(nan_policy="propagate")
# The recipes' (row, column-wise) operand pairs: nvfp4's x and dy; NVIDIA's x, then dy.
PAIRS = {"rne/rne": (QuantSpec(**_P), QuantSpec(**_P)),
         "rne/rht": (QuantSpec(**_P), QuantSpec(hadamard=True, **_P)),
         "sr/rht+sr": (QuantSpec(rounding="stochastic", **_P),
                       QuantSpec(hadamard=True, rounding="stochastic", **_P)),
         "4/6/4/6": (QuantSpec(four_over_six=True, **_P), QuantSpec(four_over_six=True, **_P))}


def compile_check() -> list[str]:
    """Compile the training step's quantize and amax kernels for sm_90 without a GPU: each
    operand kind of the recipes (RNE, 16x16, SR, RHT, RHT+SR, 4/6; fake and packed) on the
    row-major tile and, for the column-wise operands, the column-major one; Muon4's stacks of
    units; the recipes' operand pairs (an operand and its column-wise copy from one read)."""
    from fp4stack.kernels import nvfp4_kernels as kj
    from fp4stack.kernels.hopper import compile_sm90

    ptrs = {"x_ptr": "*bf16", "amax_ptr": "*fp32", "amax_t_ptr": "*fp32", "data_ptr": "*u8",
            "scale_ptr": "*u8", "out_ptr": "*bf16", "out_t_ptr": "*bf16",
            "nonfinite_ptr": "*i32", "partial_ptr": "*fp32", "partial_t_ptr": "*fp32"}
    base = dict(SIGN_MASK=kernels.SIGN_MASK, SCALE_MAX=448.0, CHECK_FINITE=False,
                ROW_AMAX=False, AMAX_HERE=False, FOUR_OVER_SIX=False, HADAMARD=False,
                STOCHASTIC=False, IS_2D=False, FAKE=True)
    kinds = {"rne": {}, "16x16": dict(IS_2D=True), "sr": dict(STOCHASTIC=True),
             "rht": dict(HADAMARD=True), "rht+sr": dict(HADAMARD=True, STOCHASTIC=True),
             "4/6": dict(FOUR_OVER_SIX=True)}
    jobs = []
    for kind, opts in kinds.items():
        tiles = [("row-major", kernels.QUANTIZE_TILE_2D if opts.get("IS_2D")
                  else kernels.QUANTIZE_TILE), ("column-major", kernels.QUANTIZE_TILE_T)]
        for layout, tile in tiles:
            for fake in (True, False) if kind == "rne" else (True,):
                jobs.append((f"quantize {kind} {layout} fake={fake}", kj.quantize_kernel, tile,
                             dict(base, **opts, FAKE=fake)))
    for layout, tile in (("row-major", kernels.QUANTIZE_TILE),
                         ("column-major", kernels.QUANTIZE_TILE_T)):
        # Muon4's Newton-Schulz operands: a stack, one amax a matrix, written as units
        jobs.append((f"quantize units of a stack {layout}", kj.quantize_kernel, tile,
                     dict(base, MATRIX_AMAX=True, UNITS=True)))
    pair_base = dict(SIGN_MASK=kernels.SIGN_MASK, SCALE_MAX=448.0, SCALE_MAX_T=448.0)
    for label, (row, col) in PAIRS.items():
        opts = dict(HADAMARD=row.hadamard, STOCHASTIC=row.rounding == "stochastic",
                    FOUR_OVER_SIX=row.four_over_six, HADAMARD_T=col.hadamard,
                    STOCHASTIC_T=col.rounding == "stochastic", FOUR_OVER_SIX_T=col.four_over_six)
        jobs.append((f"pair {label}", kj.quantize_pair_kernel, kernels.PAIR_TILE,
                     dict(pair_base, **opts)))
    for rows, cols in ((False, True), (True, True)):  # the amaxes of a pair, one read
        jobs.append((f"amax pair rht={rows}/{cols}", kj.amax_pair_kernel, kernels.PAIR_TILE,
                     dict(HADAMARD=rows, HADAMARD_T=cols, SIGN_MASK=kernels.SIGN_MASK)))
    for layout, tile in (("row-major", kernels.AMAX_TILE), ("column-major", kernels.AMAX_TILE_T)):
        for rht in (False, True):
            jobs.append((f"amax rht={rht} {layout}", kj.amax_kernel, tile,
                         dict(SIGN_MASK=kernels.SIGN_MASK, HADAMARD=rht, ROWS=False)))
    lines = []
    for label, fn, tile, consts in jobs:
        consts = {k: v for k, v in dict(consts, BM=tile.block_m, KB=tile.blocks_k).items()
                  if k in fn.arg_names}
        types = {n: ptrs[n] for n in fn.arg_names if n.endswith("_ptr")}
        build = compile_sm90(fn, types, consts, num_warps=tile.num_warps)
        lines.append(f"{label}: {build.describe()}")
        print(lines[-1], flush=True)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=8192)
    ap.add_argument("--sweep", action="store_true", help="also sweep tile shapes first")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--warmup-s", type=float, default=5.0,
                    help="seconds of quantize calls before timing, so SM clocks have ramped up")
    ap.add_argument("--only", default=None,
                    help="time only the cases whose name contains this text (e.g. 'pair')")
    ap.add_argument("--compile-check", action="store_true",
                    help="no GPU needed: compile the training step's quantize kernels for sm_90")
    args = ap.parse_args()
    if args.compile_check:
        os.environ.pop("TRITON_INTERPRET", None)
        compile_check()
        return
    if not torch.cuda.is_available():
        raise SystemExit("bench_quantize.py needs a CUDA GPU")

    n = args.size
    torch.manual_seed(0)
    x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    amax = x.abs().amax().float()
    x_bytes = x.numel() * x.element_size()
    q_bytes = x.numel() // 2 + x.numel() // 16  # packed codes + E4M3 scales
    results: dict = {"device": torch.cuda.get_device_name(), "date": str(datetime.date.today()),
                     "torch": torch.__version__, "triton": triton.__version__, "size": n}

    # The kernels are bound by SM instruction throughput, not memory: time them at full clock.
    prop = QuantSpec(nan_policy="propagate")
    t_end = time.perf_counter() + args.warmup_s
    while time.perf_counter() < t_end:
        for _ in range(100):
            kernels.quantize(x, prop, amax=amax)
        torch.cuda.synchronize()

    xt = x.t()  # a column-major view, as the backward's column-wise operands are read
    if args.sweep:
        results["sweep"] = sweep_tiles(
            "QUANTIZE_TILE", ROW_TILES, lambda: kernels.quantize(x, prop, amax=amax),
            "quantize (given amax)")
        results["sweep_column_major"] = sweep_tiles(
            "QUANTIZE_TILE_T", COLUMN_TILES, transposing(True, lambda: kernels.fake_quantize(
                xt, prop, amax=amax)), "column-major fake-quantize of x.t()")

    y = torch.empty_like(x)
    copy_ms, _ = bench(lambda: y.copy_(x))
    copy_bw = 2 * x_bytes / copy_ms / 1e9  # TB/s
    read_ms = x_bytes / copy_bw / 1e9
    results["copy_ms"], results["copy_tbps"] = copy_ms, copy_bw

    cases = [
        # name, fn, bytes moved
        ("quantize, amax given", lambda: kernels.quantize(x, prop, amax=amax), x_bytes + q_bytes),
        ("quantize, amax given (eager call)", lambda: kernels.quantize(x, prop, amax=amax),
         x_bytes + q_bytes),
        ("quantize, amax computed", lambda: kernels.quantize(x, prop), 2 * x_bytes + q_bytes),
        ("quantize, amax computed, NaN check", lambda: kernels.quantize(x, QuantSpec()),
         2 * x_bytes + q_bytes),
        ("fake-quantize, amax given", lambda: kernels.fake_quantize(x, prop, amax=amax),
         2 * x_bytes),
        ("fake-quantize, amax computed", lambda: kernels.fake_quantize(x, prop), 3 * x_bytes),
    ]
    t = kernels.quantize(x, prop, amax=amax)
    cases.append(("dequantize to bf16", lambda: kernels.dequantize(t, torch.bfloat16),
                  q_bytes + x_bytes))
    for label, spec in [("16x16", QuantSpec(block=(16, 16), nan_policy="propagate")),
                        ("SR", QuantSpec(rounding="stochastic", nan_policy="propagate")),
                        ("RHT", QuantSpec(hadamard=True, nan_policy="propagate")),
                        ("4/6", QuantSpec(four_over_six=True, nan_policy="propagate"))]:
        cases.append((f"fake-quantize {label}, amax given",
                      lambda spec=spec: kernels.fake_quantize(x, spec, amax=amax, seed=1),
                      2 * x_bytes))

    # The backward's column-wise operand: x.t() read in place by the column-major tile, against
    # the copy to contiguous rows first (kernels.TRANSPOSE_IN_KERNEL, off by default); the
    # amax computed, so the column-major amax kernel is timed too.
    for label, spec in [("RNE", prop),
                        ("SR", QuantSpec(rounding="stochastic", nan_policy="propagate")),
                        ("RHT+SR", QuantSpec(hadamard=True, rounding="stochastic",
                                             nan_policy="propagate"))]:
        for how, flag in (("read in place", True), ("copied first", False)):
            cases.append((f"column-wise fake-quantize {label}, x.t() {how}",
                          transposing(flag, lambda spec=spec: kernels.fake_quantize(
                              xt, spec, amax=amax, seed=1)), (2 if flag else 4) * x_bytes))
            cases.append((f"column-wise fake-quantize {label}, amax computed, x.t() {how}",
                          transposing(flag, lambda spec=spec: kernels.fake_quantize(
                              xt, spec, seed=1)), (3 if flag else 5) * x_bytes))

    # A linear's operand and its column-wise copy, amaxes computed as the linears do: one pair
    # kernel (in place) against the two calls (the column-wise one copied to rows first).
    for label, (row, col) in PAIRS.items():
        for how, flag in (("one kernel", True), ("two calls", False)):
            cases.append((f"pair {label}, {how}", transposing(
                flag, lambda row=row, col=col: kernels.fake_quantize_pair(
                    x, row, col, seed=1, seed_t=2)), (4 if flag else 8) * x_bytes))

    ref_fake = lambda: reference.fake_quantize(x, prop, amax=amax)  # noqa: E731
    compiled = torch.compile(ref_fake)
    compiled_q = torch.compile(lambda: reference.quantize(x, prop, amax=amax))
    cases += [
        ("torch reference fake-quantize (eager)", ref_fake, 2 * x_bytes),
        ("torch reference fake-quantize (torch.compile)", compiled, 2 * x_bytes),
        ("torch reference quantize (torch.compile)", compiled_q, x_bytes + q_bytes),
    ]

    if args.only:
        cases = [c for c in cases if args.only in c[0]]
    rows = []
    for label, fn, nbytes in cases:
        try:
            ms, graphed = bench(fn, graph="eager" not in label)
        except Exception as e:  # a baseline that fails to compile is reported, not fatal
            print(f"{label}: failed ({type(e).__name__}: {e})")
            continue
        bw = nbytes / ms / 1e9
        rows.append({"case": label, "us": ms * 1e3, "tbps": bw, "of_copy": bw / copy_bw,
                     "cuda_graph": graphed})
    results["rows"] = rows

    times = {r["case"]: r["us"] for r in rows}
    if "quantize, amax given" in times and "quantize, amax computed" in times:
        results["amax_target_ratio"] = times["quantize, amax computed"] / (
            read_ms * 1e3 + times["quantize, amax given"])

    print(f"\n{results['device']}, torch {torch.__version__}, triton {triton.__version__}, "
          f"{n}x{n} bf16, {results['date']}")
    print(f"device copy: {copy_ms * 1e3:.1f} us = {copy_bw:.2f} TB/s (read + write)")
    print("| case | timed as | time (us) | TB/s | of copy bandwidth |\n|---|---|---:|---:|---:|")
    for r in rows:
        how = "graph replay" if r["cuda_graph"] else "eager calls"
        print(f"| {r['case']} | {how} | {r['us']:.1f} | {r['tbps']:.2f} | "
              f"{100 * r['of_copy']:.0f}% |")
    if "amax_target_ratio" in results:
        print(f"\namax computed / (one read of x + amax given) = "
              f"{results['amax_target_ratio']:.2f} (one read of x at copy bandwidth = "
              f"{read_ms * 1e3:.1f} us)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
