"""Speed of the packed NVFP4 GEMMs (fp4stack.kernels.packed_gemm) on a CUDA GPU: one linear layer
against BF16 `x @ w.T`, FP8 rowwise `torch._scaled_mm` and QuantLinear's old path (dequantize the
whole weight, then matmul), and the grouped MoE against the per-expert loop.

Linear rows: BF16; FP8 rowwise (the GEMM alone, operands already FP8); W4A16 (packed_linear);
W4A4 (fake_quantize of x + packed_linear); W4A4-RC (QuantLinear's fused w4a4-rc path, dynamic
channels: inside a graph its column norms of Q(W) are recomputed on every replay, one more read
of the packed weight); old W4A4 (QuantLinear's reference path). Times are CUDA-graph replays
where the call can be captured (device time alone), else eager (marked *).

    python benchmarks/bench_packed_gemm.py [--m 1 16 64 256 1024] [--sweep] [--no-moe]
        [--out results.json]
    python benchmarks/bench_packed_gemm.py --compile-check [--quick]   # sm_90 compile, no GPU
    python benchmarks/bench_packed_gemm.py --device cpu --m 1 --shapes 64x64 --tokens 2 \
        --moe-shape 8,2,64,32   # interpreter smoke run of this script, times meaningless

--sweep times every config of GEMM_CONFIGS (each with split-K auto, 1, 2, 4 and 8) and of
GROUPED_CONFIGS per shape and prints the fastest, to retune the tables and buckets.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch

ARGS = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ARGS.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
ARGS.add_argument("--m", type=int, nargs="+", default=[1, 16, 64, 256, 1024])
ARGS.add_argument("--shapes", default="4096x4096,8192x2048", help="NxK,NxK,...")
ARGS.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256],
                  help="MoE tokens (E=64, top-8, D=2048, I=768)")
ARGS.add_argument("--moe-shape", default="64,8,2048,768", help="E,top_k,D,I")
ARGS.add_argument("--sweep", action="store_true", help="time every tile config per shape")
ARGS.add_argument("--splits", default="0,1,2,4,8",
                  help="with --sweep: split-K values to time (0: the automatic choice)")
ARGS.add_argument("--no-moe", action="store_true")
ARGS.add_argument("--compile-check", action="store_true",
                  help="compile the kernels for sm_90 (no GPU needed) and print ptxas's report")
ARGS.add_argument("--quick", action="store_true", help="with --compile-check: a few variants")
ARGS.add_argument("--out", help="write the results as JSON here")


DEVICE = "cuda"


def bench(fn, quick: bool = False) -> tuple[float, bool]:
    """(median microseconds, timed as a CUDA-graph replay); eager when fn cannot be captured.
    quick: one short timing (the sweep's many candidates) instead of the median of three."""
    import triton.testing

    if DEVICE == "cpu":  # the interpreter smoke run: one call, timed once
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6, False

    try:
        ms = [triton.testing.do_bench_cudagraph(fn, rep=25 if quick else 100,
                                                return_mode="median")
              for _ in range(1 if quick else 3)]
        return statistics.median(ms) * 1e3, True
    except Exception:  # a host sync (the old MoE loop): eager timing, launch overhead included
        torch.cuda.synchronize()
    ms = [triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") for _ in range(3)]
    return statistics.median(ms) * 1e3, False


def fp8_rowwise(x: torch.Tensor, w: torch.Tensor):
    """A closure timing torch._scaled_mm with per-row scales (x [M, K], w [N, K], e4m3)."""
    def quant(t):
        s = t.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448.0
        return (t.float() / s).to(torch.float8_e4m3fn), s

    xq, sx = quant(x)
    wq, sw = quant(w)
    sw = sw.reshape(1, -1).contiguous()
    return lambda: torch._scaled_mm(xq, wq.t(), scale_a=sx, scale_b=sw,
                                    out_dtype=torch.bfloat16)


def linear_rows(m: int, n: int, k: int) -> list[dict]:
    from fp4stack import QuantLinear, fake_quantize, recipe
    from fp4stack.kernels.packed_gemm import packed_linear

    torch.manual_seed(0)
    lin = torch.nn.Linear(k, n, bias=False, device=DEVICE, dtype=torch.bfloat16)
    x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
    w = lin.weight.detach()
    w4a4 = QuantLinear.from_linear(lin, recipe("w4a4"))
    rc = QuantLinear.from_linear(lin, recipe("w4a4-rc"))
    t = w4a4.packed_weight
    spec = w4a4.recipe.x
    cases = [
        ("BF16 x @ w.T", lambda: x @ w.t()),
        ("FP8 rowwise _scaled_mm", fp8_rowwise(x, w)),
        ("W4A16 packed_linear", lambda: packed_linear(x, t)),
        ("W4A4 fake_quantize + packed_linear",
         lambda: packed_linear(fake_quantize(x, spec=spec), t)),
        ("W4A4-RC fused (QuantLinear)", lambda: rc(x)),
        ("W4A4 old path (dequantize + matmul)", lambda: w4a4._reference_forward(x)),
    ]
    rows = []
    with torch.no_grad():
        for label, fn in cases:
            try:
                us, graphed = bench(fn)
            except Exception as e:  # e.g. _scaled_mm refusing a shape: reported, not fatal
                print(f"  {label} M={m}: failed ({type(e).__name__}: {e})", file=sys.stderr)
                continue
            rows.append(dict(case=label, m=m, n=n, k=k, us=us, graphed=graphed))
    base = next((r["us"] for r in rows if r["case"].startswith("BF16")), None)
    for r in rows:
        r["vs_bf16"] = r["us"] / base if base else float("nan")
    return rows


def moe_rows(tokens: int, e: int, top_k: int, d: int, i: int) -> list[dict]:
    from fp4stack import recipe
    from fp4stack.nn.moe import Experts
    from fp4stack.nn.quant_experts import QuantExperts

    torch.manual_seed(0)
    plain = Experts(d, i, e).to(DEVICE, torch.bfloat16)
    packed = QuantExperts.from_experts(Experts(d, i, e).to(DEVICE, torch.bfloat16),
                                       recipe("w4a4"))
    w16 = QuantExperts.from_experts(Experts(d, i, e).to(DEVICE, torch.bfloat16),
                                    recipe("w4a4@weights"))
    x = torch.randn(tokens, d, device=DEVICE, dtype=torch.bfloat16)
    probs = torch.randn(tokens, e, device=DEVICE).softmax(-1)
    weights, indices = probs.topk(top_k, dim=-1)
    cases = [
        ("MoE BF16 grouped", lambda: plain(x, weights, indices)),
        ("MoE W4A16 grouped", lambda: w16(x, weights, indices)),
        ("MoE W4A4 grouped", lambda: packed(x, weights, indices)),
        ("MoE BF16 loop (old)", lambda: plain.loop_forward(x, weights, indices)),
        ("MoE W4A4 loop (old)", lambda: packed.loop_forward(x, weights, indices)),
    ]
    rows = []
    with torch.no_grad():
        for label, fn in cases:
            us, graphed = bench(fn)
            rows.append(dict(case=label, m=tokens, n=2 * i, k=d, us=us, graphed=graphed))
    base = rows[0]["us"]
    for r in rows:
        r["vs_bf16"] = r["us"] / base
    return rows


def sweep(m: int, n: int, k: int, splits: list[int]) -> list[dict]:
    """Every GEMM_CONFIGS entry with each split-K of `splits` (0: auto) on one shape, fastest
    first; configs that launch the same kernel at this M (block_m cut to M) are timed once."""
    from dataclasses import replace

    from fp4stack import fake_quantize, quantize
    from fp4stack.formats.spec import QuantSpec
    from fp4stack.kernels import packed_gemm as pg

    torch.manual_seed(0)
    t = quantize(torch.randn(n, k, device=DEVICE), spec=QuantSpec(nan_policy="propagate"))
    x = fake_quantize(torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16))
    out, seen = [], set()
    for name, cfg in pg.GEMM_CONFIGS.items():
        if not cfg.dot and m > 16:
            continue  # broadcast products are for decode's few rows
        for split in splits:
            c = replace(cfg, split_k=split)
            eff = pg.split_for(c, m, n, k, x.device)
            launch = replace(c, block_m=pg.effective_block_m(c, m), split_k=eff)
            if launch in seen or -(-k // cfg.block_k) < eff:
                continue
            seen.add(launch)
            us, _ = bench(lambda c=c: pg.packed_linear(x, t, config=c), quick=True)
            out.append(dict(config=name, split_k=eff, m=m, n=n, k=k, us=us))
    return sorted(out, key=lambda r: r["us"])


def sweep_grouped(tokens: int, e: int, top_k: int, d: int, i: int) -> list[dict]:
    """Every GROUPED_CONFIGS entry on the W4A4 MoE (both launches), fastest first."""
    from fp4stack import recipe
    from fp4stack.kernels import moe_align
    from fp4stack.kernels import packed_gemm as pg
    from fp4stack.nn.moe import Experts
    from fp4stack.nn.quant_experts import QuantExperts

    torch.manual_seed(0)
    q = QuantExperts.from_experts(Experts(d, i, e).to(DEVICE, torch.bfloat16), recipe("w4a4"))
    x = torch.randn(tokens, d, device=DEVICE, dtype=torch.bfloat16)
    weights, indices = torch.randn(tokens, e, device=DEVICE).softmax(-1).topk(top_k, dim=-1)
    out = []
    chosen = moe_align.choose_grouped_config
    try:
        for name, cfg in pg.GROUPED_CONFIGS.items():
            moe_align.choose_grouped_config = lambda *_a, cfg=cfg: cfg
            with torch.no_grad():
                us, _ = bench(lambda: q(x, weights, indices))
            out.append(dict(config=name, tokens=tokens, us=us))
    finally:
        moe_align.choose_grouped_config = chosen
    return sorted(out, key=lambda r: r["us"])


def table(rows: list[dict]) -> str:
    out = ["| case | M (tokens) | N | K | us | x BF16 |", "|---|---|---|---|---|---|"]
    for r in rows:
        star = "" if r["graphed"] else " *"
        out.append(f"| {r['case']} | {r['m']} | {r['n']} | {r['k']} | {r['us']:.1f}{star} | "
                   f"{r['vs_bf16']:.2f} |")
    return "\n".join(out)


def compile_check(quick: bool) -> list[str]:
    """Compile the kernels for sm_90 without a GPU (bf16 activations, packed weights): every
    GEMM_CONFIGS and GROUPED_CONFIGS entry, the split-K reduce, the column norms, the
    per-row activation quantizer (RNE, 4/6), QUADS's operand, the MoE alignment, combine and
    group amax, RoPE;
    `quick`: one of each kind."""
    import triton.language as tl

    from fp4stack.kernels import packed_gemm as pg
    from fp4stack.kernels import packed_gemm_jit as jit
    from fp4stack.kernels.hopper import compile_sm90

    ptrs = {"a_ptr": "*bf16", "w_ptr": "*i32", "ws_ptr": "*u8", "amax_ptr": "*fp32",
            "bias_ptr": "*bf16", "out_ptr": "*bf16", "part_ptr": "*fp32", "rows_ptr": "*i32",
            "tile_expert_ptr": "*i32", "like_ptr": "*bf16", "x_ptr": "*bf16",
            "group_ptr": "*i64", "wd_ptr": "*i32", "data_ptr": "*u8", "scale_ptr": "*u8",
            "nonfinite_ptr": "*i32", "lock_ptr": "*i32"}
    common = dict(SCALE_MAX=448.0, MMA_TY=tl.bfloat16, PRECISION="tf32", PAD_K=False,
                  NATIVE_CAST=True, HAS_BIAS=True)
    jobs = []
    gemms = list(pg.GEMM_CONFIGS.items())
    grouped = list(pg.GROUPED_CONFIGS.items())
    if quick:
        gemms = [(n, c) for n, c in gemms if n in ("gemv16x256", "dot16x64x64", "swap16x64x64")]
        grouped = grouped[:1]
    for name, cfg in gemms:
        for split in ((2,) if not cfg.dot else (1, 2) if not quick else (1,)):
            bm = cfg.block_m if cfg.dot else 1  # a broadcast product: M = 1, decode's
            jobs.append((f"gemm {name} split={split}", jit.gemm_kernel, cfg.num_warps,
                         cfg.num_stages, dict(common, BM=bm, BN=cfg.block_n,
                                              BK=cfg.block_k, SPLIT_K=split, W_PACKED=True,
                                              USE_DOT=cfg.dot, SWAP_AB=cfg.swap_ab,
                                              GROUPED=False, EVEN_K=True,
                                              SERIAL_REDUCE=split > 1)))
    for name, cfg in grouped:
        for packed in (True, False):
            jobs.append((f"grouped {name} packed={packed}", jit.gemm_kernel, cfg.num_warps,
                         cfg.num_stages, dict(common, BM=cfg.block_m, BN=cfg.block_n,
                                              BK=cfg.block_k, SPLIT_K=1, W_PACKED=packed,
                                              USE_DOT=True, SWAP_AB=cfg.swap_ab,
                                              GROUPED=True, HAS_BIAS=False)))
    jobs.append(("splitk reduce", jit.splitk_reduce_kernel, 4, None,
                 dict(SPLIT_K=4, BM=16, BN=128, HAS_BIAS=True, NATIVE_CAST=True)))
    jobs.append(("column norms", jit.column_sq_norms_kernel, 4, None,
                 dict(BN=32, BK=32, SCALE_MAX=448.0, PAD_K=False, NATIVE_CAST=True)))
    tile = pg.QUANTIZE_TILE
    for fos in ((False,) if quick else (False, True)):
        jobs.append((f"rows fake-quantize 4/6={fos}", jit.rows_fake_quantize_kernel,
                     tile.num_warps, None, dict(BM=tile.block_m, KB=tile.blocks_k,
                                                FOUR_OVER_SIX=fos, SCALE_MAX=448.0)))
    from fp4stack.kernels import nvfp4 as nv
    from fp4stack.kernels import nvfp4_kernels as kj

    for here, rows in ((True, False), (True, True)) if quick else (
            (False, False), (True, False), (True, True)):
        # the decode operand: Q(x) with its amax computed in the same launch (AMAX_HERE)
        jobs.append((f"activation fake-quantize amax_here={here} row_amax={rows}",
                     kj.quantize_kernel, nv.QUANTIZE_TILE.num_warps, None,
                     dict(BM=nv.QUANTIZE_TILE.block_m, KB=nv.QUANTIZE_TILE.blocks_k, IS_2D=False,
                          HADAMARD=False, SIGN_MASK=nv.SIGN_MASK, STOCHASTIC=False,
                          FOUR_OVER_SIX=False, SCALE_MAX=448.0, FAKE=True, CHECK_FINITE=False,
                          ROW_AMAX=rows, AMAX_HERE=here)))
    from fp4stack.kernels import compensation as comp

    # QUADS's operand x~: Q(x) with the residual energies (amax before or inside), then the select
    for here, rows, sort in ((True, False, False), (True, True, True)) if quick else (
            (False, False, False), (True, False, False), (True, True, False), (False, True, True),
            (True, True, True)):
        jobs.append((f"quads quantize+energy amax_here={here} row_amax={rows} sorted={sort}",
                     comp.quantize_energy_kernel, 4, None,
                     dict(TILE=16, KB=comp.ENERGY_BLOCKS, SORTED=sort, ROW_AMAX=rows,
                          FOUR_OVER_SIX=False, SCALE_MAX=448.0, AMAX_HERE=here, KEEP=False)))
    for sort in (False, True):  # static channels: x~ in this one launch, from keep masks
        jobs.append((f"quads quantize with static channels sorted={sort}",
                     comp.quantize_energy_kernel, 4, None,
                     dict(TILE=16, KB=comp.ENERGY_BLOCKS, SORTED=sort, ROW_AMAX=False,
                          FOUR_OVER_SIX=False, SCALE_MAX=448.0, AMAX_HERE=not sort, KEEP=True)))
    for sort in (False, True):
        jobs.append((f"quads select sorted={sort}", comp.select_kernel, 4, None,
                     dict(TILE=16, BLOCK=2048, SORTED=sort)))
    from fp4stack.kernels import moe_align

    # The alignment of the grouped MoE path: one program, decode's 8 experts and 64
    for block_e in (8,) if quick else (8, 64):
        jobs.append((f"moe align pairs experts<={block_e}", moe_align.align_pairs_kernel, 4,
                     None, dict(BLOCK_P=4096 // block_e, BLOCK_E=block_e,
                                BLOCK_T=4096 // block_e, BLOCK_R=1024)))
    from fp4stack.kernels import rope

    jobs.append(("rope head_dim=64", rope.rope_kernel, 4, None,
                 dict(HALF=32, BLOCK_R=64, BLOCK_D=32)))
    for k in (2,) if quick else (2, 8):  # the combine of each token's k outputs
        jobs.append((f"moe combine k={k}", moe_align.combine_kernel, 4, None,
                     dict(K=k, KP=k, BLOCK_D=1024)))
    for row_div in (1, 2):  # the per-expert amax of the tokens (k = 2) or of the pairs
        jobs.append((f"moe group amax row_div={row_div}", moe_align.group_amax_kernel, 4, None,
                     dict(ROW_DIV=row_div, BLOCK_D=1024)))
    ptrs.update(tiles_ptr="*i32", q_ptr="*bf16", sums_ptr="*fp32", norms_ptr="*fp32",
                tile_group_ptr="*i32", keep_ptr="*u8", ids_ptr="*i64", expert_tiles_ptr="*i32",
                y_ptr="*bf16", gates_ptr="*fp32", experts_ptr="*i64", sum_ptr="*fp32",
                cos_ptr="*fp32", sin_ptr="*fp32", bits_ptr="*i32")
    ptrs["out_ptr"] = "*bf16"
    lines = []
    for label, fn, warps, stages, consts in jobs:
        consts = {k: v for k, v in consts.items() if k in fn.arg_names}
        types = {n: ptrs[n] for n in fn.arg_names if n.endswith("_ptr")}
        build = compile_sm90(fn, types, consts, num_warps=warps, num_stages=stages)
        lines.append(f"{label}: {build.describe()}")
        print(lines[-1], flush=True)
    return lines


def main() -> None:
    args = ARGS.parse_args()
    result: dict = dict(date=datetime.datetime.now(datetime.UTC).isoformat(), args=vars(args))
    if args.compile_check:
        os.environ.pop("TRITON_INTERPRET", None)
        result["compile_check"] = compile_check(args.quick)
    else:
        global DEVICE
        DEVICE = args.device
        if DEVICE == "cpu":
            os.environ["TRITON_INTERPRET"] = "1"  # before fp4stack.kernels defines its kernels
            from fp4stack.nn import linear

            linear._FUSED_ON_CPU = True  # CPU tensors take the fused paths too
        elif not torch.cuda.is_available():
            sys.exit("bench_packed_gemm.py needs a CUDA GPU (or --compile-check, --device cpu)")
        import triton

        name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (interpreter)"
        result.update(gpu=name, versions=dict(torch=torch.__version__, triton=triton.__version__))
        print(f"{name}, {result['date'][:10]}, torch {torch.__version__}, "
              f"triton {triton.__version__}")
        moe = [int(v) for v in args.moe_shape.split(",")]
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
        rows = []
        for n, k in shapes:
            for m in args.m:
                rows += linear_rows(m, n, k)
                if args.sweep:
                    best = sweep(m, n, k, [int(v) for v in args.splits.split(",")])
                    result.setdefault("sweep", []).extend(best)
                    print(f"sweep M={m} N={n} K={k}: " + ", ".join(
                        f"{r['config']}/split{r['split_k']} {r['us']:.1f} us" for r in best[:4]))
        if not args.no_moe:
            for tokens in args.tokens:
                rows += moe_rows(tokens, *moe)
                if args.sweep:
                    best = sweep_grouped(tokens, *moe)
                    result.setdefault("sweep_grouped", []).extend(best)
                    print(f"grouped sweep T={tokens}: " + ", ".join(
                        f"{r['config']} {r['us']:.1f} us" for r in best))
        print(table(rows))
        print("* eager timing (the call syncs with the host, so it cannot be graph-captured)")
        result["rows"] = rows
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
