"""Speed of NVFP4 attention (fp4_attention's Triton path: the kernels of fp4stack.kernels.attention
and attention_bwd) against torch SDPA (BF16 flash / cuDNN), forward and forward + backward.

Causal by default. FLOPs count 4·B·H·S·L·d for the forward (halved when causal) and 2.5x that for
the backward, the usual flash-attention convention, whatever work each kernel really does (the
NVFP4 backward recomputes dS once more, for the global dS amax). The target of the issue: at most
1.5x SDPA's fwd+bwd time at seq 2048, head dim 128.

    python benchmarks/bench_attention.py [--seq 2048] [--head-dim 128] [--batch 4] [--heads 16]
        [--no-causal] [--reference] [--sweep] [--out results.json]
    python benchmarks/bench_attention.py --device cpu --seq 64 --head-dim 16   # interpreter smoke
    python benchmarks/bench_attention.py --compile-check   # sm_90 compile + ptxas registers, no GPU

--sweep times several tile shapes per pass (and atomic vs deterministic dQ) and prints the
fastest; --reference also times the torch reference at a quarter of the batch.
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
ARGS.add_argument("--batch", type=int, default=4)
ARGS.add_argument("--heads", type=int, default=16)
ARGS.add_argument("--seq", type=int, nargs="+", default=[2048])
ARGS.add_argument("--head-dim", type=int, nargs="+", default=[128])
ARGS.add_argument("--no-causal", action="store_true")
ARGS.add_argument("--reference", action="store_true")
ARGS.add_argument("--sweep", action="store_true")
ARGS.add_argument("--compile-check", action="store_true")
ARGS.add_argument("--profile", action="store_true",
                  help="also print the CUDA time of each kernel of one fp4 forward + backward")
ARGS.add_argument("--out")


def timer(fn, device: str) -> float:
    """Median milliseconds of fn()."""
    if device == "cpu":
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton.testing

    ms = [triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") for _ in range(3)]
    return statistics.median(ms)


def fwd_bwd(f, q, k, v, do):
    def run():
        for t in (q, k, v):
            t.grad = None
        f(q, k, v).backward(do)
    return run


def sdpa_variants(causal: bool):
    """[(label, f)]: SDPA as torch picks it, then each backend forced, where it runs."""
    import torch.nn.functional as F

    def make(backend):
        def f(q, k, v):
            if backend is None:
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            from torch.nn.attention import sdpa_kernel

            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return f

    out = [("sdpa (torch's pick)", make(None))]
    try:
        from torch.nn.attention import SDPBackend

        out += [(f"sdpa {b.name.lower()}", make(b))
                for b in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION)]
    except ImportError:
        pass
    return out


def fp4_variants() -> dict:
    """The kernel configs timed, by the label suffix of their rows."""
    from fp4stack.nn.attention import NVFP4_SR, AttentionQuant
    from fp4stack.nn.attention_ablation import AttentionAblation

    return {"": AttentionQuant.paper(),
            ", Q/K/V in 16x16 tiles": AttentionQuant.tiled(),
            ", Q/K rotated": AttentionAblation.quant(rotate_qk=True),
            ", no reuse": AttentionQuant(reuse=False),
            ", no reuse, delta from dP": AttentionAblation.quant(reuse=False, delta="dp"),
            ", Q/K/V stochastic": AttentionQuant(q=NVFP4_SR, k=NVFP4_SR, v=NVFP4_SR),
            ", V unquantized (qk_ds)": AttentionQuant.qk_ds(),
            ", V unquantized, no reuse": AttentionQuant.qk_ds(reuse=False)}


def measure(B, H, S, d, causal, device, with_reference, tiles_label=""):
    from fp4stack.nn.attention import fp4_attention

    g = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16
    q, k, v, do = (torch.randn(B, H, S, d, generator=g).to(device, dtype) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_()
    flops = 4 * B * H * S * S * d / (2 if causal else 1)
    rows = []
    cands = sdpa_variants(causal)[:1 if device == "cpu" else None]
    for name, cfg in fp4_variants().items():
        cands.append((f"fp4 triton{name}{tiles_label}",
                      lambda q, k, v, cfg=cfg: fp4_attention(q, k, v, causal, cfg,
                                                             backend="triton")))
    if with_reference:
        cands.append(("fp4 torch reference",
                      lambda q, k, v: fp4_attention(q, k, v, causal, backend="torch")))
    with torch.no_grad():
        base = cands[0][1](q, k, v).float()
    for label, f in cands:
        try:
            with torch.no_grad():
                o = f(q, k, v)
                ms_f = timer(lambda f=f: f(q, k, v), device)
            ms_fb = timer(fwd_bwd(f, q, k, v, do), device)
        except RuntimeError as e:  # a forced SDPA backend that does not apply here
            print(f"# {label}: {str(e).splitlines()[0][:100]}", file=sys.stderr)
            continue
        diff = (o.float() - base).abs().max().item()
        rows.append(dict(impl=label, B=B, H=H, S=S, d=d, causal=causal, fwd_ms=ms_f,
                         fwdbwd_ms=ms_fb, fwd_tflops=flops / ms_f / 1e9,
                         fwdbwd_tflops=3.5 * flops / ms_fb / 1e9, max_abs_diff_vs_sdpa=diff))
    ref = rows[0]
    for r in rows:
        r["fwd_ratio"] = r["fwd_ms"] / ref["fwd_ms"]
        r["fwdbwd_ratio"] = r["fwdbwd_ms"] / ref["fwdbwd_ms"]
    return rows


SWEEP = {
    "fwd": [(128, 64, 8, 2), (128, 64, 8, 3), (64, 64, 4, 2), (128, 128, 8, 2), (64, 32, 4, 3)],
    "amax": [(128, 64, 8, 2), (64, 64, 4, 2), (128, 32, 8, 2), (64, 32, 4, 2)],
    "dkdv": [(64, 64, 8, 2), (32, 64, 4, 2), (32, 32, 4, 2), (16, 64, 4, 2), (16, 64, 8, 2),
             (32, 128, 8, 2), (64, 128, 8, 2)],
    "dq": [(64, 32, 4, 2), (128, 64, 8, 2), (64, 64, 4, 2), (128, 32, 8, 2)],
}


def fp4_fwd_bwd_on_cuda(B, H, S, d, causal):
    """A call running one fp4 forward + backward (Triton path) on seeded bf16 CUDA inputs."""
    from fp4stack.nn.attention import fp4_attention

    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(B, H, S, d, generator=g).to("cuda", torch.bfloat16)
                   for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_()
    return fwd_bwd(lambda q, k, v: fp4_attention(q, k, v, causal, backend="triton"), q, k, v, do)


def sweep(B, H, S, d, causal):
    """Each pass's tiles in turn (the others at their defaults), fwd+bwd ms of the fp4 path."""
    from fp4stack.kernels import attention as fa
    from fp4stack.kernels import attention_bwd as ba

    f = fp4_fwd_bwd_on_cuda(B, H, S, d, causal)
    rows, default_det = [], ba.DETERMINISTIC
    for det in (False, True):
        ba.DETERMINISTIC = det
        for name, shapes in SWEEP.items():
            if name == "dq" and not det:
                continue
            for bm, bn, w, st in shapes:
                fa.TILE_OVERRIDES = {name: fa.Tile(bm, bn, w, st)}
                try:
                    ms = timer(f, "cuda")
                except Exception as e:  # e.g. out of shared memory
                    print(f"# {name} {bm}x{bn} w{w} s{st}: {e!s:.80}", file=sys.stderr)
                    continue
                rows.append(dict(deterministic=det, pass_=name, block_m=bm, block_n=bn,
                                 num_warps=w, num_stages=st, fwdbwd_ms=ms, S=S, d=d))
                print(f"det={det} {name:5s} {bm:3d}x{bn:<3d} w{w} s{st}: {ms:.3f} ms")
    fa.TILE_OVERRIDES, ba.DETERMINISTIC = {}, default_det
    return rows


FP32_PTRS = ("lse_ptr", "amax_ptr", "delta_ptr", "partial_ptr", "dbg_ptr")


def compile_check() -> list[str]:
    """Compile every kernel for sm_90 (bf16, d 64 and 128, default tiles; the prologue in its
    three block shapes, the first two also with stochastic rounding; the backward also in the
    variants of the ablations reuse=False and ds=None, and delta="dp"'s first pass) without a
    GPU; report ptxas's registers and spills when a ptxas that reads Triton's PTX is at hand."""
    import triton.language as tl

    from fp4stack.kernels import attention as fa
    from fp4stack.kernels import attention_bwd as ba
    from fp4stack.kernels import attention_units as fu
    from fp4stack.kernels.hopper import compile_sm90

    lines = []
    for d in (64, 128):
        tiles = fa.default_tiles(d)
        mma = dict(MMA_TY=tl.bfloat16, PRECISION=None)
        bwd = dict(D=d, CAUSAL=True, SCALE_MAX=448.0, DEBUG=False, REUSE=True, QUANT_DS=True,
                   **mma)
        jobs = [
            *((f"quant {shape}{' SR' if sr else ''}", fu.quantize_units_kernel, tiles["quant"],
               dict(D=d, BLOCK=tiles["quant"].block_m, AXIS=axis, SCALE_MAX=448.0,
                    STOCHASTIC=sr))
              for shape, axis in (("d-blocks", 1), ("key-blocks", 0), ("16x16 tiles", 2))
              for sr in ((False, True) if axis < 2 else (False,))),
            ("fwd", fa.attention_fwd_kernel, tiles["fwd"], dict(D=d, CAUSAL=True, **mma)),
            ("delta", ba.delta_kernel, fa.Tile(64, 64, 4, 1), dict(D=d, BLOCK=64)),
            ("amax", ba.query_kernel, tiles["amax"], dict(DQ=False, **bwd)),
            ("dq", ba.query_kernel, tiles["dq"], dict(DQ=True, **bwd)),
            ("dkdv atomic dQ", ba.dkdv_kernel, tiles["dkdv"], dict(ATOMIC_DQ=True, **bwd)),
            ("dkdv", ba.dkdv_kernel, tiles["dkdv"], dict(ATOMIC_DQ=False, **bwd)),
        ]
        # The ablations' variants (AttentionQuant(reuse=False), AttentionQuant(ds=None)); the
        # amax pass is the default one for reuse=False and does not run for ds=None.
        for tag, flags in (("noreuse", dict(REUSE=False)), ("ds-hp", dict(QUANT_DS=False))):
            jobs += [(f"dq {tag}", ba.query_kernel, tiles["dq"], dict(bwd, DQ=True, **flags)),
                     (f"dkdv atomic dQ {tag}", ba.dkdv_kernel, tiles["dkdv"],
                      dict(bwd, ATOMIC_DQ=True, **flags)),
                     (f"dkdv {tag}", ba.dkdv_kernel, tiles["dkdv"],
                      dict(bwd, ATOMIC_DQ=False, **flags))]
        # delta="dp": the first pass's own sweep for rowsum(P ∘ dP), before its amax sweep, or
        # alone with ds=None.
        jobs += [("amax delta-dp", ba.query_kernel, tiles["amax"],
                  dict(bwd, DQ=False, REUSE=False, DELTA_DP=True)),
                 ("delta-dp ds-hp", ba.query_kernel, tiles["amax"],
                  dict(bwd, DQ=False, REUSE=False, QUANT_DS=False, DELTA_DP=True))]
        for label, fn, t, consts in jobs:
            if "DELTA_DP" in fn.arg_names:
                consts = {"DELTA_DP": False, **consts}
            if "BLOCK_M" in fn.arg_names:
                consts = dict(consts, BLOCK_M=t.block_m, BLOCK_N=t.block_n)
            types = {n: "*fp32" if n in FP32_PTRS or (n == "dq_ptr" and fn is ba.dkdv_kernel)
                     else "*bf16" for n in fn.arg_names if n.endswith("_ptr")}
            types["scale"] = "fp32"
            build = compile_sm90(fn, types, consts, num_warps=t.num_warps,
                                 num_stages=t.num_stages)
            lines.append(f"d={d} {label:23s} {t}: {build.describe()}")
            print(lines[-1])
    return lines


def profile(B, H, S, d, causal):
    """Per-kernel CUDA time of one fp4 forward + backward (default tiles), printed as a table."""
    from fp4stack.kernels.profiling import format_kernel_times, kernel_times

    rows = kernel_times(fp4_fwd_bwd_on_cuda(B, H, S, d, causal))
    print(f"\nfp4 forward + backward, B={B} H={H} S={S} d={d}, CUDA time per kernel:")
    print(format_kernel_times(rows))
    return rows


def table(rows) -> str:
    out = ["| impl | S | d | fwd ms | fwd TFLOPS | fwd x SDPA | fwd+bwd ms | fwd+bwd TFLOPS "
           "| fwd+bwd x SDPA | max abs diff vs SDPA |", "|" + "---|" * 10]
    for r in rows:
        out.append(f"| {r['impl']} | {r['S']} | {r['d']} | {r['fwd_ms']:.3f} | "
                   f"{r['fwd_tflops']:.1f} | {r['fwd_ratio']:.2f} | {r['fwdbwd_ms']:.3f} | "
                   f"{r['fwdbwd_tflops']:.1f} | {r['fwdbwd_ratio']:.2f} | "
                   f"{r['max_abs_diff_vs_sdpa']:.2e} |")
    return "\n".join(out)


def main() -> None:
    args = ARGS.parse_args()
    result = dict(date=datetime.datetime.now(datetime.UTC).isoformat(), args=vars(args))
    if args.compile_check:
        os.environ.pop("TRITON_INTERPRET", None)
        result["compile_check"] = compile_check()
    else:
        if args.device == "cpu":
            os.environ["TRITON_INTERPRET"] = "1"  # before fp4stack.kernels defines its kernels
        elif not torch.cuda.is_available():
            sys.exit("no CUDA device: use --device cpu (interpreter) or --compile-check")
        else:
            result["gpu"] = torch.cuda.get_device_name()
            result["versions"] = dict(torch=torch.__version__,
                                      triton=__import__("triton").__version__)
        rows = []
        for S in args.seq:
            for d in args.head_dim:
                rows += measure(args.batch, args.heads, S, d, not args.no_causal, args.device,
                                False)
                if args.reference:  # the torch reference's S x L tensors: a quarter batch
                    b = max(1, args.batch // 4)
                    rows += [dict(r, impl=r["impl"] + f" (B={b})") for r in
                             measure(b, args.heads, S, d, not args.no_causal, args.device, True)]
        print(table(rows))
        result["rows"] = rows
        if args.profile and args.device == "cuda":
            result["profile"] = {f"S={S} d={d}": profile(args.batch, args.heads, S, d,
                                                        not args.no_causal)
                                 for S in args.seq for d in args.head_dim}
        if args.sweep and args.device == "cuda":
            result["sweep"] = [r for S in args.seq for d in args.head_dim
                               for r in sweep(args.batch, args.heads, S, d, not args.no_causal)]
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
