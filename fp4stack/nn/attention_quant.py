"""AttentionQuant: which tensors fp4_attention quantizes, and whether its backward reuses them.

A frozen dataclass with one QuantSpec (or None) per attention tensor and the reuse flag, checked
on construction so that a bad setting fails where it is written, naming the field. The studies'
switches around tensor reuse are one optional field of their own, an AttentionAblation
(attention_ablation.py). The maths is in fp4stack.nn.attention (the torch reference) and
fp4stack.kernels.attention (the kernels); what each field does, in docs/attention.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from torch import Tensor

from ..formats.random import draw_seed
from ..formats.spec import QuantSpec

_FLAGS = ("q", "k", "v", "p", "ds", "dp")
# The forward tensors the backward can reuse (reuse=True: all, False: none; an
# AttentionAblation can name some of them).
REUSABLE = ("q", "k", "v", "p")
# The hot-path NVFP4 spec: 1x16 blocks, round to nearest even, no host sync for a NaN check.
NVFP4_RNE = QuantSpec(nan_policy="propagate")
# The same with stochastic rounding (a fresh draw per call): for Q, K, V, a forward whose rounding
# error is random from step to step, which the backward still shares when it reuses Q̂, K̂, V̂.
NVFP4_SR = QuantSpec(rounding="stochastic", nan_policy="propagate")
# The same in 16x16 tiles over a tensor's last two dims (tokens x head_dim for Q, K, V): one
# quantization whose blocks run along both, so every GEMM can take it (see docs/attention.md).
NVFP4_TILES = QuantSpec(block=(16, 16), nan_policy="propagate")


@runtime_checkable
class BackwardAblation(Protocol):
    """What the product paths ask of a study's switches around tensor reuse (implemented by
    fp4stack.nn.attention_ablation.AttentionAblation, which builds on this module and on the
    reference, so this module names only the interface)."""

    reuse: tuple[str, ...] | None  # a partial reuse: the names reused, or None
    delta: str  # "output" or "dp"

    def checked(self, quant: AttentionQuant) -> BackwardAblation | None: ...
    def describe(self, reuse: bool) -> str: ...
    def in_kernels(self, tiled: bool, stochastic: bool) -> bool: ...
    def rotated(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]: ...
    def saved_amaxes(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor | None: ...
    def reference_operands(self, quant: AttentionQuant, *args: Any, **kw: Any) -> Any: ...
    def units_operands(self, quant: AttentionQuant, *args: Any, **kw: Any) -> Any: ...


@dataclass(frozen=True)
class AttentionQuant:
    """Which attention tensors fp4_attention quantizes and whether its backward reuses them,
    checked on construction. What each field does, and why, is in docs/attention.md.

    q, k, v, p, ds, dp: a QuantSpec each (None: high precision). The default is the method's:
        q, k, v and ds in NVFP4 1x16 RNE, p and dp high precision. NVFP4_TILES (16x16 tiles)
        for q, k and v makes one quantization serve every GEMM of both passes.
    reuse: True (tensor reuse: the backward multiplies by the forward's Q̂, K̂, V̂ and P̂) or
        False (it re-quantizes each of them along its backward GEMM's reduction dim; S is
        still recomputed from the forward's Q̂, K̂ bits).
    ablation: None, or an AttentionAblation (fp4stack.nn.attention_ablation): the studies'
        switches around reuse (partial reuse, re-blocking, how the backward re-quantizes,
        rotate_qk, delta). One that changes nothing is stored as None.
    """

    q: QuantSpec | None = NVFP4_RNE
    k: QuantSpec | None = NVFP4_RNE
    v: QuantSpec | None = NVFP4_RNE
    p: QuantSpec | None = None
    ds: QuantSpec | None = NVFP4_RNE
    dp: QuantSpec | None = None
    reuse: bool = True
    ablation: BackwardAblation | None = None

    def __post_init__(self) -> None:
        for name in _FLAGS:
            spec = getattr(self, name)
            if spec is not None and not isinstance(spec, QuantSpec):
                raise TypeError(f"AttentionQuant.{name} must be a QuantSpec or None, "
                                f"got {type(spec).__name__}")
            if spec is not None and spec.format == "none":
                object.__setattr__(self, name, None)  # one spelling of "not quantized"
            elif spec is not None and spec.format == "nvfp4":
                _check_nvfp4(name, spec)
        if not isinstance(self.reuse, bool):
            raise TypeError(f"AttentionQuant.reuse must be a bool (True: tensor reuse, False: "
                            f"re-quantize), got {self.reuse!r}; a partial reuse is "
                            "AttentionAblation(reuse=(...)) with reuse=False")
        if self.ablation is not None:
            if not isinstance(self.ablation, BackwardAblation):
                raise TypeError(f"AttentionQuant.ablation must be an AttentionAblation "
                                f"(fp4stack.nn.attention_ablation) or None, got "
                                f"{type(self.ablation).__name__}")
            object.__setattr__(self, "ablation", self.ablation.checked(self))

    def reuses(self, name: str) -> bool:
        """Whether the backward reuses the forward's quantized `name` (one of q, k, v, p)."""
        if name not in REUSABLE:
            raise ValueError(f"AttentionQuant.reuses: {name!r} is not one of {REUSABLE}")
        partial = self.ablation.reuse if self.ablation is not None else None
        return self.reuse if partial is None else name in partial

    @classmethod
    def off(cls) -> AttentionQuant:
        """Nothing quantized: exact attention (fp32 maths)."""
        return cls(**{name: None for name in _FLAGS})

    @classmethod
    def paper(cls) -> AttentionQuant:
        """Full-Stack FP4's attention: Q, K, V, dS in NVFP4 with tensor reuse (the default)."""
        return cls()

    @classmethod
    def qk_ds(cls, reuse: bool = True) -> AttentionQuant:
        """Full-Stack FP4's attention in the paper's form: the QKᵀ and dS GEMMs in NVFP4 (Q, K
        and dS quantized), PV, Pᵀ dO and dO Vᵀ in high precision (V, P and dO not quantized).
        reuse: the backward multiplies by the forward's Q̂, K̂ (so dS's rows come from the
        forward's scores), or re-quantizes Q and K along each backward GEMM's reduction dim."""
        return cls(v=None, reuse=reuse)

    @classmethod
    def tiled(cls, **fields) -> AttentionQuant:
        """Q, K, V in NVFP4 16x16 tiles (NVFP4_TILES), the other fields as given."""
        return cls(**dict.fromkeys(("q", "k", "v"), NVFP4_TILES), **fields)

    @classmethod
    def only(cls, *names: str, spec: QuantSpec = NVFP4_RNE, reuse: bool = True) -> AttentionQuant:
        """Just the named tensors quantized with `spec`, e.g. only("q", "ds"), for ablations."""
        unknown = sorted(set(names) - set(_FLAGS))
        if unknown:
            raise ValueError(f"AttentionQuant.only: unknown tensor(s) {unknown}; "
                             f"choose from {_FLAGS}")
        return cls(**{name: spec if name in names else None for name in _FLAGS}, reuse=reuse)

    @property
    def quantizes(self) -> bool:
        return any(getattr(self, name) is not None for name in _FLAGS)

    def describe(self) -> str:
        on = [name + _spec_note(getattr(self, name))
              for name in _FLAGS if getattr(self, name) is not None]
        reuse = f"reuse={self.reuse}" if self.ablation is None else \
            self.ablation.describe(self.reuse)
        return f"quantized: {', '.join(on) or 'nothing'}; {reuse}"


def _spec_note(spec: QuantSpec) -> str:
    notes = (["16x16 tiles"] if spec.is_2d else []) + \
        (["stochastic"] if spec.rounding == "stochastic" else [])
    return f" ({', '.join(notes)})" if notes else ""


def stochastic_seed(spec: QuantSpec | None) -> int | None:
    """A fresh seed (torch's generator) for a stochastic spec, None for any other: drawn once
    per quantization and kept where the backward must redraw the same values."""
    return draw_seed() if spec is not None and spec.rounding == "stochastic" else None


def _check_nvfp4(name: str, spec: QuantSpec) -> None:
    if spec.hadamard:
        raise ValueError(f"AttentionQuant.{name}: hadamard=True is not supported: the values "
                         "would stay in the transformed domain, which only cancels when both "
                         "operands of one GEMM carry the same transform")
