"""Quantization error of NVFP4 variants and FP8 baselines on a few tensor distributions.

Every method runs quantize -> dequantize through the public API (so CUDA tensors take the same
backend a training run would) and is scored against the original tensor:

    rel  = ||x_hat - x||_F / ||x||_F          (lower is better)
    SQNR = -20 log10(rel) dB                  (higher is better)

The test tensors are drawn on the CPU from a seeded generator and then moved to the device, so a
given (rows, cols, seed) gives the same tensors on every device; since the NVFP4 backends are
bit-exact, the quantized values are the same too (the float64 norms may differ in the last bits).
Functions here compute and format; `fp4stack quant-error` only prints.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..api import backend_for, dequantize, quantize
from ..device import resolve_device
from ..formats.fp8 import dequantize_fp8, quantize_fp8
from ..formats.hadamard import rht_inverse

OUTLIER_SCALE = 50.0
STUDENT_DF = 3


# --------------------------------------------------------------------------- distributions


@dataclass(frozen=True)
class Distribution:
    key: str
    label: str  # short column title
    describe: Callable[[int, int], str]  # (rows, cols) -> one-line description for the footnote
    sample: Callable[[int, int, torch.Generator], torch.Tensor]


def _gaussian(rows: int, cols: int, g: torch.Generator) -> torch.Tensor:
    return torch.randn(rows, cols, generator=g)


def _student_t(rows: int, cols: int, g: torch.Generator) -> torch.Tensor:
    # t = z / sqrt(chi2_df / df), with chi2_df a sum of df squared normals (seeded, no scipy).
    z = torch.randn(rows, cols, generator=g)
    chi2 = torch.randn(STUDENT_DF, rows, cols, generator=g).square().sum(0)
    return z / torch.sqrt(chi2.clamp_min(1e-30) / STUDENT_DF)


def _n_outlier_cols(cols: int) -> int:
    return max(1, cols // 256)


def _outlier_channels(rows: int, cols: int, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(rows, cols, generator=g)
    idx = torch.randperm(cols, generator=g)[: _n_outlier_cols(cols)]
    x[:, idx] *= OUTLIER_SCALE
    return x


def _rank(rows: int, cols: int) -> int:
    return max(1, min(rows, cols) // 16)


def _low_rank(rows: int, cols: int, g: torch.Generator) -> torch.Tensor:
    # Weight-like: a low-rank product whose singular values fall as 1/i (so rows and columns
    # get uneven magnitudes, as in trained weights) plus isotropic noise, at std about 0.02.
    r = _rank(rows, cols)
    u = torch.randn(rows, r, generator=g)
    v = torch.randn(r, cols, generator=g)
    s = 1.0 / torch.arange(1, r + 1, dtype=torch.float32)
    low = (u * s) @ v / s.square().sum().sqrt()
    return 0.02 * (low + 0.25 * torch.randn(rows, cols, generator=g))


DISTRIBUTIONS: tuple[Distribution, ...] = (
    Distribution("gaussian", "gaussian", lambda r, c: "N(0, 1)", _gaussian),
    Distribution(
        "student_t3", "student-t df=3",
        lambda r, c: f"Student-t with {STUDENT_DF} degrees of freedom (heavy tails)", _student_t,
    ),
    Distribution(
        "outlier_channels", "outlier cols",
        lambda r, c: f"N(0, 1) with {_n_outlier_cols(c)} of {c} columns scaled x{OUTLIER_SCALE:g}",
        _outlier_channels,
    ),
    Distribution(
        "low_rank", "low-rank+noise",
        lambda r, c: f"weight-like: rank-{_rank(r, c)} product (singular values ~1/i) + 25% "
        "noise, std ~0.02",
        _low_rank,
    ),
)


def make_tensor(distribution: str, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """The float32 [rows, cols] test tensor of one distribution, drawn on the CPU.

    Each distribution has its own generator stream, so adding or dropping one leaves the others
    unchanged.
    """
    for i, d in enumerate(DISTRIBUTIONS):
        if d.key == distribution:
            g = torch.Generator().manual_seed(seed * 1009 + i)
            return d.sample(rows, cols, g).to(torch.float32)
    raise ValueError(
        f"unknown distribution {distribution!r}; choose from {[d.key for d in DISTRIBUTIONS]}"
    )


# --------------------------------------------------------------------------------- methods


@dataclass(frozen=True)
class Method:
    key: str
    label: str  # row title in the table
    # (x, seed) -> (x_hat in float32, bytes stored for x)
    run: Callable[[torch.Tensor, int], tuple[torch.Tensor, int]]
    needs_k16: bool = False  # last dim must be a multiple of 16


def _nvfp4(**options) -> Callable[[torch.Tensor, int], tuple[torch.Tensor, int]]:
    def run(x: torch.Tensor, seed: int) -> tuple[torch.Tensor, int]:
        sr = options.get("rounding") == "stochastic"
        t = quantize(x, seed=seed if sr else None, name="quant-error input", **options)
        x_hat = dequantize(t, torch.float32)
        if options.get("hadamard"):
            x_hat = rht_inverse(x_hat)  # back to x's domain: the error a paired GEMM sees
        return x_hat, t.nbytes

    return run


def _fp8(granularity: str) -> Callable[[torch.Tensor, int], tuple[torch.Tensor, int]]:
    def run(x: torch.Tensor, seed: int) -> tuple[torch.Tensor, int]:
        t = quantize_fp8(x, granularity)
        nbytes = t.data.numel() * t.data.element_size() + t.scale.numel() * 4
        return dequantize_fp8(t, torch.float32), nbytes

    return run


METHODS: tuple[Method, ...] = (
    Method("nvfp4_rne", "NVFP4 RNE 1x16", _nvfp4()),
    Method("nvfp4_sr", "NVFP4 SR 1x16 (a)", _nvfp4(rounding="stochastic")),
    Method("nvfp4_2d", "NVFP4 2D 16x16 (b)", _nvfp4(block=(16, 16))),
    Method("nvfp4_rht", "NVFP4 RHT 1x16 (c)", _nvfp4(hadamard=True), needs_k16=True),
    Method("nvfp4_4over6", "NVFP4 4/6 1x16 (d)", _nvfp4(four_over_six=True)),
    Method("fp8_tensor", "FP8 E4M3 per-tensor", _fp8("tensor")),
    Method("fp8_row", "FP8 E4M3 per-row", _fp8("row")),
    Method("fp8_block128", "FP8 E4M3 1x128", _fp8("block128")),
)


# --------------------------------------------------------------------------------- results


@dataclass(frozen=True)
class ErrorRow:
    """One (distribution, method) measurement; rel_error is None where the method does not apply."""

    distribution: str
    method: str
    rel_error: float | None
    sqnr_db: float | None
    bits_per_value: float | None

    def to_dict(self) -> dict:
        def finite(v: float | None) -> float | None:
            return v if v is not None and math.isfinite(v) else None

        return {
            "distribution": self.distribution,
            "method": self.method,
            "rel_error": finite(self.rel_error),
            "sqnr_db": finite(self.sqnr_db),
            "bits_per_value": finite(self.bits_per_value),
        }


def relative_error(x_hat: torch.Tensor, x: torch.Tensor) -> float:
    """||x_hat - x||_F / ||x||_F, accumulated in float64 (0 when x == x_hat == 0)."""
    x64 = x.to(torch.float64)
    num = torch.linalg.vector_norm(x_hat.to(torch.float64) - x64).item()
    den = torch.linalg.vector_norm(x64).item()
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


def sqnr_db(rel: float) -> float:
    """Signal-to-quantization-noise ratio in dB for a relative error `rel`."""
    return math.inf if rel == 0.0 else -20.0 * math.log10(rel)


def measure(x: torch.Tensor, method: Method, seed: int = 0, distribution: str = "") -> ErrorRow:
    """Score one method on one tensor."""
    if method.needs_k16 and x.shape[-1] % 16:
        return ErrorRow(distribution, method.key, None, None, None)
    x_hat, nbytes = method.run(x, seed)
    rel = relative_error(x_hat, x)
    return ErrorRow(distribution, method.key, rel, sqnr_db(rel), 8.0 * nbytes / x.numel())


def error_table(
    rows: int = 1024,
    cols: int = 1024,
    seed: int = 0,
    device: str | torch.device = "cpu",
    distributions: Sequence[str] | None = None,
    methods: Sequence[str] | None = None,
) -> list[ErrorRow]:
    """Measure every method on every distribution: one ErrorRow per pair, distributions outer."""
    if rows < 1 or cols < 1:
        raise ValueError(f"rows and cols must be >= 1, got {rows} x {cols}")
    dev = resolve_device(device)
    dists = [d.key for d in DISTRIBUTIONS] if distributions is None else list(distributions)
    chosen = _select(METHODS, methods)
    out = []
    for dist in dists:
        x = make_tensor(dist, rows, cols, seed).to(dev)
        out.extend(measure(x, m, seed, dist) for m in chosen)
    return out


def _select(methods: Sequence[Method], keys: Sequence[str] | None) -> list[Method]:
    if keys is None:
        return list(methods)
    by_key = {m.key: m for m in methods}
    unknown = [k for k in keys if k not in by_key]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; choose from {list(by_key)}")
    return [by_key[k] for k in keys]


def metadata(rows: int, cols: int, seed: int, device: str | torch.device) -> dict:
    """What a table was measured on (device, backend, shape, seed)."""
    dev = resolve_device(device)
    return {
        "rows": rows,
        "cols": cols,
        "seed": seed,
        "dtype": "float32",
        "device": str(dev),
        "nvfp4_backend": backend_for(dev),
        "torch": torch.__version__,
    }


# ------------------------------------------------------------------------------ formatting


def _fmt_rel(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.4f}"


def _fmt_db(v: float | None) -> str:
    if v is None:
        return "n/a"
    return "inf" if math.isinf(v) else f"{v:.2f}"


def format_table(results: Sequence[ErrorRow], meta: dict) -> str:
    """An aligned plain-text table: one row per method, (rel, SQNR) per distribution."""
    dist_keys = list(dict.fromkeys(r.distribution for r in results))
    method_keys = list(dict.fromkeys(r.method for r in results))
    cell = {(r.distribution, r.method): r for r in results}
    dist_by_key = {d.key: d for d in DISTRIBUTIONS}
    method_by_key = {m.key: m for m in METHODS}

    sep = "  "
    w_rel, w_db = 6, 6
    name_w = max(len("method"), *(len(method_by_key[k].label) for k in method_keys))
    bits_w = len("bits/v")
    group_w = [max(len(dist_by_key[d].label), w_rel + 1 + w_db) for d in dist_keys]

    def line(name: str, bits: str, groups: Sequence[str]) -> str:
        parts = [name.ljust(name_w), bits.rjust(bits_w)]
        parts += [g.rjust(w) for g, w in zip(groups, group_w, strict=True)]
        return sep.join(parts).rstrip()

    def pair(rel: str, db: str) -> str:
        return f"{rel.rjust(w_rel)} {db.rjust(w_db)}"

    out = [
        f"Quantize -> dequantize error, {meta['rows']}x{meta['cols']} {meta['dtype']}, seed "
        f"{meta['seed']}, {meta['device']} ({meta['nvfp4_backend']}): "
        "rel = ||x_hat - x|| / ||x||, SQNR in dB",
        "",
        line("", "", [dist_by_key[d].label for d in dist_keys]),
        line("method", "bits/v", [pair("rel", "SQNR") for _ in dist_keys]),
        line("-" * name_w, "-" * bits_w, ["-" * w for w in group_w]),
    ]
    for mk in method_keys:
        rows = [cell.get((d, mk)) for d in dist_keys]
        bits = next((r.bits_per_value for r in rows if r and r.bits_per_value is not None), None)
        groups = [
            pair(_fmt_rel(r.rel_error), _fmt_db(r.sqnr_db)) if r else pair("", "") for r in rows
        ]
        out.append(line(method_by_key[mk].label, "n/a" if bits is None else f"{bits:.2f}", groups))

    rows_, cols_ = meta["rows"], meta["cols"]
    notes = [
        "",
        "bits/v: bits stored per value, block scales and global scales included.",
        "(a) One stochastic-rounding draw (seed fixed, the same bits on every backend). SR is "
        "unbiased, not minimal: one draw has a larger error than RNE by design.",
        "(b) One E4M3 scale per 16x16 tile (2D weights: W and W^T quantize identically).",
        "(c) 16-point random Hadamard transform, quantize, dequantize, then rht_inverse back to "
        "x's domain before comparing with x. The transform is orthogonal, so the error measured "
        "in the transformed domain is the same up to float32 rounding.",
        "(d) Four Over Six: per block, map the max to 4 or to 6, whichever has the lower MSE.",
    ]
    wrapped = [textwrap.fill(n, width=100, subsequent_indent="    ") if n else n for n in notes]
    label_w = max(len(dist_by_key[d].label) for d in dist_keys)
    wrapped.append("Tensors:")
    wrapped += [
        f"    {dist_by_key[d].label.ljust(label_w)}  {dist_by_key[d].describe(rows_, cols_)}"
        for d in dist_keys
    ]
    return "\n".join(out + wrapped)
