"""AttentionQuant: which tensors fp4_attention quantizes, and what its backward reuses.

A frozen dataclass with one QuantSpec (or None) per attention tensor and the reuse flags, checked
on construction so that a bad setting fails where it is written, naming the field. The maths is
in fp4stack.nn.attention (the torch reference) and fp4stack.kernels.attention (the kernels); what
each field does, in docs/attention.md.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..formats.random import draw_seed
from ..formats.spec import QuantSpec

_FLAGS = ("q", "k", "v", "p", "ds", "dp")
# The forward tensors the backward can reuse (reuse=True: all, False: none, or a tuple of these).
_REUSABLE = ("q", "k", "v", "p")
_REQUANTIZE_ALONG = ("reduction", "forward")
_ROUNDINGS = ("rne", "stochastic")
_DELTAS = ("output", "dp")
# The hot-path NVFP4 spec: 1x16 blocks, round to nearest even, no host sync for a NaN check.
NVFP4_RNE = QuantSpec(nan_policy="propagate")
# The same with stochastic rounding (a fresh draw per call): for Q, K, V, a forward whose rounding
# error is random from step to step, which the backward still shares when it reuses Q̂, K̂, V̂.
NVFP4_SR = QuantSpec(rounding="stochastic", nan_policy="propagate")
# The same in 16x16 tiles over a tensor's last two dims (tokens x head_dim for Q, K, V): one
# quantization whose blocks run along both, so every GEMM can take it (see docs/attention.md).
NVFP4_TILES = QuantSpec(block=(16, 16), nan_policy="propagate")


@dataclass(frozen=True)
class AttentionQuant:
    """Which attention tensors fp4_attention quantizes and what its backward reuses, checked on
    construction. What each field does, and why, is in docs/attention.md.

    q, k, v, p, ds, dp: a QuantSpec each (None: high precision). The default is the method's:
        q, k, v and ds in NVFP4 1x16 RNE, p and dp high precision. NVFP4_TILES (16x16 tiles)
        for q, k and v makes one quantization serve every GEMM of both passes.
    reuse: True (the backward reuses the forward's Q̂, K̂, V̂ and P̂), False (none), or a tuple of
        some of "q", "k", "v", "p". S is recomputed from the forward's Q̂, K̂ bits (unless
        requantize=False and Q or K is not reused).
    requantize: for the tensors not reused, True re-quantizes them for each backward GEMM,
        False takes them unquantized.
    requantize_along: "reduction" (default: blocks along each GEMM's reduction dim) or
        "forward" (along the forward's block dims) for that re-quantization.
    requantize_rounding: None (the forward spec's rounding), "rne" or "stochastic" for it.
    reblock: re-quantize the reused values along each backward GEMM's reduction dim, at the
        forward's global amaxes (the form a native NVFP4 GEMM takes).
    rotate_qk: multiply Q and K along head_dim by the 16-point random Hadamard transform first.
    delta: the softmax backward's row term in dS = P ∘ (dP - delta): "output" (rowsum(dO ∘ O),
        flash attention's) or "dp" (rowsum(P ∘ dP)).
    """

    q: QuantSpec | None = NVFP4_RNE
    k: QuantSpec | None = NVFP4_RNE
    v: QuantSpec | None = NVFP4_RNE
    p: QuantSpec | None = None
    ds: QuantSpec | None = NVFP4_RNE
    dp: QuantSpec | None = None
    reuse: bool | tuple[str, ...] = True
    requantize: bool = True
    reblock: bool = False
    rotate_qk: bool = False
    requantize_along: str = "reduction"
    requantize_rounding: str | None = None
    delta: str = "output"

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
        object.__setattr__(self, "reuse", _normalized_reuse(self.reuse))
        if not isinstance(self.requantize, bool):
            raise TypeError(f"AttentionQuant.requantize must be a bool, got {self.requantize!r}")
        if not isinstance(self.reblock, bool):
            raise TypeError(f"AttentionQuant.reblock must be a bool, got {self.reblock!r}")
        if self.requantize_along not in _REQUANTIZE_ALONG:
            raise ValueError(f"AttentionQuant.requantize_along must be one of "
                             f"{_REQUANTIZE_ALONG}, got {self.requantize_along!r}")
        if self.requantize_rounding not in (None, *_ROUNDINGS):
            raise ValueError(f"AttentionQuant.requantize_rounding must be None (the forward "
                             f"spec's) or one of {_ROUNDINGS}, got {self.requantize_rounding!r}")
        if self.delta not in _DELTAS:
            raise ValueError(f"AttentionQuant.delta must be one of {_DELTAS} (rowsum(dO ∘ O) "
                             f"or rowsum(P ∘ dP)), got {self.delta!r}")
        how = self.requantize_along != "reduction" or self.requantize_rounding is not None
        if how and (self.reuse is True or not self.requantize):
            raise ValueError("AttentionQuant.requantize_along/requantize_rounding say how the "
                             "backward re-quantizes the tensors it does not reuse, and this "
                             "config re-quantizes none: set reuse=False (or a tuple) and "
                             "requantize=True")
        if not isinstance(self.rotate_qk, bool):
            raise TypeError(f"AttentionQuant.rotate_qk must be a bool, got {self.rotate_qk!r}")
        if self.rotate_qk and self.q is None and self.k is None:
            raise ValueError("AttentionQuant.rotate_qk=True rotates Q and K to quantize them "
                             "better, and neither q nor k is quantized: set q and/or k, or "
                             "rotate_qk=False")
        if self.reblock and self.reuse is False:
            raise ValueError("AttentionQuant.reblock=True re-quantizes the tensors the backward "
                             "reuses, and reuse=False reuses none: set reuse=True (or a tuple "
                             "of the tensors to reuse)")
        if not self.requantize and self.reuse is True:
            raise ValueError("AttentionQuant.requantize=False changes the tensors the backward "
                             "does not reuse, and reuse=True reuses them all: set reuse=False "
                             "(or a tuple of the tensors to reuse)")

    def reuses(self, name: str) -> bool:
        """Whether the backward reuses the forward's quantized `name` (one of q, k, v, p)."""
        if name not in _REUSABLE:
            raise ValueError(f"AttentionQuant.reuses: {name!r} is not one of {_REUSABLE}")
        return self.reuse is True or (self.reuse is not False and name in self.reuse)

    @classmethod
    def off(cls) -> AttentionQuant:
        """Nothing quantized: exact attention (fp32 maths)."""
        return cls(**{name: None for name in _FLAGS})

    @classmethod
    def paper(cls) -> AttentionQuant:
        """Full-Stack FP4's attention: Q, K, V, dS in NVFP4 with tensor reuse (the default)."""
        return cls()

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

    def fresh_spec(self, spec: QuantSpec | None) -> QuantSpec | None:
        """The spec the backward re-quantizes a tensor it does not reuse with: `spec` (the
        forward's), with requantize_rounding's rounding where that is set."""
        if spec is not None and self.requantize_rounding is not None:
            spec = replace(spec, rounding=self.requantize_rounding)
        return spec

    @property
    def quantizes(self) -> bool:
        return any(getattr(self, name) is not None for name in _FLAGS)

    def describe(self) -> str:
        on = [name + _spec_note(getattr(self, name))
              for name in _FLAGS if getattr(self, name) is not None]
        reuse = self.reuse if isinstance(self.reuse, bool) else ",".join(self.reuse)
        fresh = "" if self.requantize else "; the others unquantized in the backward"
        reblock = "; reused values re-blocked" if self.reblock else ""
        rotate = "; Q, K Hadamard-rotated along head_dim" if self.rotate_qk else ""
        how = []
        if self.requantize_along != "reduction":
            how.append(f"along the {self.requantize_along} dims")
        if self.requantize_rounding is not None:
            how.append(f"with {self.requantize_rounding} rounding")
        how = f"; the others re-quantized {' '.join(how)}" if how else ""
        delta = "; delta = rowsum(P ∘ dP)" if self.delta == "dp" else ""
        return (f"quantized: {', '.join(on) or 'nothing'}; reuse={reuse}{reblock}{fresh}{how}"
                f"{rotate}{delta}")


def _spec_note(spec: QuantSpec) -> str:
    notes = (["16x16 tiles"] if spec.is_2d else []) + \
        (["stochastic"] if spec.rounding == "stochastic" else [])
    return f" ({', '.join(notes)})" if notes else ""


def stochastic_seed(spec: QuantSpec | None) -> int | None:
    """A fresh seed (torch's generator) for a stochastic spec, None for any other: drawn once
    per quantization and kept where the backward must redraw the same values."""
    return draw_seed() if spec is not None and spec.rounding == "stochastic" else None


def _normalized_reuse(reuse) -> bool | tuple[str, ...]:
    """True, False, or the reused names in _REUSABLE's order (all: True, none: False)."""
    if isinstance(reuse, bool):
        return reuse
    if not isinstance(reuse, (tuple, list, set, frozenset)) or \
            not all(isinstance(n, str) for n in reuse):
        raise TypeError(f"AttentionQuant.reuse must be a bool or a tuple of names from "
                        f"{_REUSABLE}, got {reuse!r}")
    unknown = sorted(set(reuse) - set(_REUSABLE))
    if unknown:
        raise ValueError(f"AttentionQuant.reuse: unknown name(s) {unknown}; choose from "
                         f"{_REUSABLE}")
    names = tuple(n for n in _REUSABLE if n in reuse)
    if names == _REUSABLE:
        return True
    return names or False


def _check_nvfp4(name: str, spec: QuantSpec) -> None:
    if spec.hadamard:
        raise ValueError(f"AttentionQuant.{name}: hadamard=True is not supported: the values "
                         "would stay in the transformed domain, which only cancels when both "
                         "operands of one GEMM carry the same transform")
