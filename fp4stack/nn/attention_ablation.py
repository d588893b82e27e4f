"""AttentionAblation: the studies' switches around tensor reuse, in one place of their own.

AttentionQuant carries what the method needs (a spec per tensor and `reuse`, True or False);
its optional `ablation` field holds one of these, checked there with the errors below. This
module also owns what only the ablations do, for both backends: rotating Q and K before either
sees them, the reference backward's operands and the kernels' units when the backward reuses some
of the forward's tensors, re-blocks them, re-quantizes the others otherwise or takes them
unquantized. The product paths branch here once ("if cfg.ablation is not None"). delta="dp"
changes the kernels' maths, so it stays a kernel argument whose value comes from here. What each
switch does, and why, is in docs/attention.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor

from ..formats.hadamard import rht
from ..formats.spec import QuantSpec
from .attention import quantize_along
from .attention_quant import REUSABLE, AttentionQuant, stochastic_seed

_REQUANTIZE_ALONG = ("reduction", "forward")
_ROUNDINGS = ("rne", "stochastic")
_DELTAS = ("output", "dp")
_BLOCK = 16


@dataclass(frozen=True)
class AttentionAblation:
    """The studies' switches of fp4_attention, held by AttentionQuant.ablation; each changes
    which operands the backward's GEMMs take, except rotate_qk and delta (docs/attention.md).

    reuse: None (AttentionQuant.reuse decides) or a partial reuse, a tuple of some of "q", "k",
        "v", "p" (with AttentionQuant.reuse=False): the backward reuses those only.
    requantize: for the tensors not reused, True re-quantizes them for each backward GEMM,
        False takes them unquantized (S then recomputed from the unquantized Q, K if not reused).
    requantize_along: "reduction" (default: blocks along each GEMM's reduction dim) or
        "forward" (along the forward's block dims) for that re-quantization.
    requantize_rounding: None (the forward spec's rounding), "rne" or "stochastic" for it.
    reblock: re-quantize the reused values along each backward GEMM's reduction dim, at the
        forward's global amaxes (the form a native NVFP4 GEMM takes).
    rotate_qk: multiply Q and K along head_dim by the 16-point random Hadamard transform first.
    delta: the softmax backward's row term in dS = P ∘ (dP - delta): "output" (rowsum(dO ∘ O),
        flash attention's) or "dp" (rowsum(P ∘ dP)).
    """

    reuse: tuple[str, ...] | None = None
    requantize: bool = True
    reblock: bool = False
    rotate_qk: bool = False
    requantize_along: str = "reduction"
    requantize_rounding: str | None = None
    delta: str = "output"

    def __post_init__(self) -> None:
        if self.reuse is not None:
            names = _reuse_names(self.reuse)
            if names in ((), REUSABLE):
                raise ValueError(f"AttentionAblation.reuse={self.reuse!r} is not a partial "
                                 "reuse: write AttentionQuant(reuse=True) for all, "
                                 "reuse=False for none, and leave this field None")
            object.__setattr__(self, "reuse", names)
        for name in ("requantize", "reblock", "rotate_qk"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"AttentionAblation.{name} must be a bool, "
                                f"got {getattr(self, name)!r}")
        if self.requantize_along not in _REQUANTIZE_ALONG:
            raise ValueError(f"AttentionAblation.requantize_along must be one of "
                             f"{_REQUANTIZE_ALONG}, got {self.requantize_along!r}")
        if self.requantize_rounding not in (None, *_ROUNDINGS):
            raise ValueError(f"AttentionAblation.requantize_rounding must be None (the forward "
                             f"spec's) or one of {_ROUNDINGS}, got {self.requantize_rounding!r}")
        if self.delta not in _DELTAS:
            raise ValueError(f"AttentionAblation.delta must be one of {_DELTAS} (rowsum(dO ∘ O) "
                             f"or rowsum(P ∘ dP)), got {self.delta!r}")

    @classmethod
    def quant(cls, **fields_: object) -> AttentionQuant:
        """The AttentionQuant written flat, as the studies list their configs: AttentionQuant's
        fields and this class's in one call, `reuse` a bool or a tuple of names (all of them is
        True, none False), e.g. AttentionAblation.quant(reuse=("v",), reblock=True)."""
        own = {f.name for f in fields(cls)} - {"reuse"}
        ablation = {name: fields_.pop(name) for name in list(fields_) if name in own}
        reuse = fields_.pop("reuse", True)
        if not isinstance(reuse, bool):
            names = _reuse_names(reuse)
            reuse = names == REUSABLE
            ablation["reuse"] = None if reuse or not names else names
        return AttentionQuant(**fields_, reuse=reuse, ablation=cls(**ablation))

    def checked(self, quant: AttentionQuant) -> AttentionAblation | None:
        """This ablation checked against the AttentionQuant holding it (AttentionQuant calls
        it); None when it changes nothing, so that such a config equals the plain one."""
        if self.reuse is not None and quant.reuse:
            raise ValueError("AttentionAblation.reuse names the tensors of a partial reuse, and "
                             "AttentionQuant.reuse=True reuses them all: set reuse=False with it")
        reuse = quant.reuse if self.reuse is None else self.reuse
        how = self.requantize_along != "reduction" or self.requantize_rounding is not None
        if how and (reuse is True or not self.requantize):
            raise ValueError("AttentionAblation.requantize_along/requantize_rounding say how "
                             "the backward re-quantizes the tensors it does not reuse, and this "
                             "config re-quantizes none: set reuse=False (or "
                             "AttentionAblation.reuse to a tuple) and requantize=True")
        if self.rotate_qk and quant.q is None and quant.k is None:
            raise ValueError("AttentionAblation.rotate_qk=True rotates Q and K to quantize them "
                             "better, and neither q nor k is quantized: set q and/or k, or "
                             "rotate_qk=False")
        if self.reblock and reuse is False:
            raise ValueError("AttentionAblation.reblock=True re-quantizes the tensors the "
                             "backward reuses, and reuse=False reuses none: set reuse=True (or "
                             "AttentionAblation.reuse to a tuple of the tensors to reuse)")
        if not self.requantize and reuse is True:
            raise ValueError("AttentionAblation.requantize=False changes the tensors the "
                             "backward does not reuse, and reuse=True reuses them all: set "
                             "reuse=False (or AttentionAblation.reuse to a tuple)")
        return None if self == AttentionAblation() else self

    def describe(self, reuse: bool) -> str:
        """AttentionQuant.describe's part from "reuse=" on, for AttentionQuant.reuse `reuse`."""
        shown = reuse if self.reuse is None else ",".join(self.reuse)
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
        return f"reuse={shown}{reblock}{fresh}{how}{rotate}{delta}"

    def fresh_spec(self, spec: QuantSpec | None) -> QuantSpec | None:
        """The spec the backward re-quantizes a tensor it does not reuse with: `spec` (the
        forward's), with requantize_rounding's rounding where that is set."""
        if spec is not None and self.requantize_rounding is not None:
            spec = replace(spec, rounding=self.requantize_rounding)
        return spec

    def in_kernels(self, tiled: bool, stochastic: bool) -> bool:
        """Whether the kernels compute this ablation (kernel_config asks): any, except reblock
        with a stochastic rounding; with Q, K, V in 16x16 tiles (`tiled`) only with requantize
        and without reblock, requantize_along and requantize_rounding."""
        if tiled:
            how = self.requantize_along != "reduction" or self.requantize_rounding is not None
            return self.requantize and not self.reblock and not how
        return not (self.reblock and (stochastic or self.requantize_rounding == "stochastic"))

    def rotated(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """q and k as either backend takes them: with rotate_qk, times the 16-point random
        Hadamard transform along head_dim (autograd backs through it)."""
        if not self.rotate_qk:
            return q, k
        if q.shape[-1] % _BLOCK:
            raise ValueError(f"AttentionAblation.rotate_qk=True needs head_dim to be a multiple "
                             f"of {_BLOCK}, got {q.shape[-1]}: set rotate_qk=False")
        # the fixed butterfly order of rht keeps CPU and GPU bit-identical
        return rht(q).to(q.dtype), rht(k).to(k.dtype)

    def saved_amaxes(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor | None:
        """What the reference forward saves besides its tensors: with reblock, the global amaxes
        of Q, K, V (the forward's scales) for the second quantization of the reused values."""
        return torch.stack([t.float().abs().amax() for t in (q, k, v)]) if self.reblock else None

    def reference_operands(self, quant: AttentionQuant, saved: tuple[Tensor, Tensor, Tensor],
                           amax: Tensor | None, seeds: tuple, probs: Callable, dt: torch.dtype):
        """The reference backward's operands, (P, P for dV, Q for dK, K for dQ, V for dP), K and
        V with their own heads. saved: the forward's Q̂, K̂ (along d), V̂ (along keys) for the
        tensors quant.reuses, else the unquantized tensors; amax: saved_amaxes'; seeds: of Q,
        K, P in the forward; probs(Q, K): P recomputed from those S operands.

        Reused: the forward's values (P̂ with its seed), with reblock re-quantized along the
        GEMM's reduction dim at the forward's amax; else re-quantized from the unquantized
        tensor along each GEMM's reduction dim (or as requantize_along/requantize_rounding
        say), or (not requantize) the unquantized tensor itself. S is recomputed from the
        forward's Q̂, K̂ bits unless requantize=False."""
        a, b, c = saved
        q_seed, k_seed, p_seed = seeds

        def scores_operand(t: Tensor, spec: QuantSpec | None, seed: int | None) -> Tensor:
            return quantize_along(t, spec if self.requantize else None, -1, dt, seed)

        def fresh(t: Tensor, spec: QuantSpec | None, dim: int, forward_dim: int) -> Tensor:
            dim = forward_dim if self.requantize_along == "forward" else dim
            return quantize_along(t, self.fresh_spec(spec) if self.requantize else None, dim, dt)

        def reused(hat: Tensor, spec: QuantSpec | None, dim: int, amax: Tensor | None) -> Tensor:
            return quantize_along(hat, spec, dim, dt, amax=amax) if self.reblock else hat

        amax = (None, None, None) if amax is None else amax
        if quant.reuses("q"):
            qh, q_dk = a, reused(a, quant.q, -2, amax[0])
        else:
            qh, q_dk = scores_operand(a, quant.q, q_seed), fresh(a, quant.q, -2, -1)
        if quant.reuses("k"):
            kh, k_dq = b, reused(b, quant.k, -2, amax[1])
        else:
            kh, k_dq = scores_operand(b, quant.k, k_seed), fresh(b, quant.k, -2, -1)
        v_dp = reused(c, quant.v, -1, amax[2]) if quant.reuses("v") else \
            fresh(c, quant.v, -1, -2)
        p = probs(qh, kh)
        if quant.reuses("p"):  # P is recomputed bit for bit, so its amax is the forward's
            p_amax = p.float().abs().amax() if self.reblock and quant.p is not None else None
            p_dv = reused(quantize_along(p, quant.p, -1, dt, p_seed), quant.p, -2, p_amax)
        else:
            p_dv = fresh(p, quant.p, -2, -1)
        return p, p_dv, q_dk, k_dq, v_dp

    def units_operands(self, quant: AttentionQuant, saved: tuple[Tensor, Tensor, Tensor],
                       amax: Tensor, tile, reused: tuple[str, ...],
                       score_seeds: tuple[int | None, int | None]):
        """The kernels' backward operands: (Q̂, K̂ along d, V̂ for dP, {"q_dk", "k_dq"} or {}
        for attention_bwd.backward_units, the amaxes that decode them). saved: the forward's
        units of the tensors in `reused`, else the raw tensors; score_seeds: the forward's seeds
        of Q, K. The fresh roundings draw their seeds in the reference's order (Q̂ for dK, K̂
        for dQ, V̂ for dP), so both backends round alike after one torch.manual_seed."""
        a, b, c = saved
        if reused == ("q", "k", "v") and not self.reblock:
            return a, b, c, {}, amax
        alt = {}
        if self.requantize:
            fresh = tuple(stochastic_seed(self.fresh_spec(spec)) if n not in reused else None
                          for n, spec in zip("qkv", (quant.q, quant.k, quant.v), strict=True))
            qu, ku, vu, alt["q_dk"], alt["k_dq"] = requantized_operands(
                a, b, c, amax, tile, reused, score_seeds, fresh,
                self.requantize_along == "forward")
        else:
            qu, ku, vu, alt["q_dk"], alt["k_dq"], amax = unquantized_operands(a, b, c, amax,
                                                                              reused)
        if self.reblock:  # unquantized_operands' amaxes change for the tensors not reused only
            vu, alt["q_dk"], alt["k_dq"] = reblocked_operands(vu, alt["q_dk"], alt["k_dq"],
                                                              amax, tile, reused)
        return qu, ku, vu, alt, amax


def requantized_operands(q, k, v, amax: Tensor, tile, reused: tuple[str, ...] = (),
                         score_seeds: tuple[int | None, int | None] = (None, None),
                         fresh_seeds: tuple[int | None, ...] = (None, None, None),
                         along_forward: bool = False):
    """The units of the backward GEMMs under a partial reuse: (Q̂, K̂ along d, V̂ for
    dP = dO V̂ᵀ, Q̂ for dK = dŜᵀ Q̂, K̂ for dQ = dŜ K̂). q, k, v are the forward's units for the
    names in `reused`, used as they are (Q̂, K̂ along d, V̂ along keys), and the raw tensors
    otherwise, quantized afresh with the forward's amaxes (a tensor's global amax does not
    depend on the axis of its blocks): Q̂, K̂ along d with the forward's seeds score_seeds (S
    recomputed bit for bit as in the forward); the other three along each GEMM's own reduction
    dim (V̂ along d, Q̂ along queries, K̂ along keys), or with along_forward along the forward's
    dims (V̂ along keys, Q̂ and K̂ along d), with fresh_seeds (of Q̂ for dK, K̂ for dQ, V̂ for
    dP; None: round to nearest even). None reused: attention_units.backward_operands."""
    from ..kernels.attention_units import quantize_units

    def units(t, i, axis, seed=None):
        return quantize_units(t, amax[i:], axis, tile, seed)

    qk_axis, v_axis = (1, 0) if along_forward else (0, 1)
    q_seed, k_seed, v_seed = fresh_seeds
    qu, q_dk = (q, q) if "q" in reused else \
        (units(q, 0, 1, score_seeds[0]), units(q, 0, qk_axis, q_seed))
    ku, k_dq = (k, k) if "k" in reused else \
        (units(k, 1, 1, score_seeds[1]), units(k, 1, qk_axis, k_seed))
    vu = v if "v" in reused else units(v, 2, v_axis, v_seed)
    return qu, ku, vu, q_dk, k_dq


def reblocked_operands(vu, q_dk, k_dq, amax: Tensor, tile, reused: tuple[str, ...]):
    """reblock=True: the reused units of the backward's dP, dK and dQ operands (V̂ along keys,
    Q̂ and K̂ along d) re-quantized along those GEMMs' reduction dims (V̂ along d, Q̂ along the
    queries, K̂ along the keys) with the forward's amaxes: a second NVFP4 rounding of the
    forward's values. The others pass through. Returns (vu, q_dk, k_dq)."""
    from ..kernels.attention_units import quantize_units, unit_values

    def again(u, i, axis):
        return quantize_units(unit_values(u, amax, i), amax[i:], axis, tile).to(u.dtype)

    vu = again(vu, 2, 1) if "v" in reused else vu
    q_dk = again(q_dk, 0, 0) if "q" in reused else q_dk
    k_dq = again(k_dq, 1, 0) if "k" in reused else k_dq
    return vu, q_dk, k_dq


def unquantized_operands(q, k, v, amax: Tensor, reused: tuple[str, ...] = ()):
    """requantize=False: the backward takes each of q, k, v it does not reuse unquantized, as
    its own units with a decode factor of exactly 1 (its amax set to RAW_AMAX); the ones in
    `reused` are the forward's units. Returns requantized_operands' five operands and the
    amaxes to decode them with."""
    from ..kernels.attention_common import RAW_AMAX

    amax = amax.clone()
    ops = []
    for i, (name, t) in enumerate(zip("qkv", (q, k, v), strict=True)):
        if name not in reused:
            t = t.contiguous()
            amax[i] = RAW_AMAX
        ops.append(t)
    qu, ku, vu = ops
    return qu, ku, vu, qu, ku, amax


def _reuse_names(reuse: object) -> tuple[str, ...]:
    """The names of a reuse tuple, checked, in REUSABLE's order."""
    if not isinstance(reuse, (tuple, list, set, frozenset)) or \
            not all(isinstance(n, str) for n in reuse):
        raise TypeError(f"AttentionAblation.reuse must be a tuple of names from {REUSABLE} "
                        f"(AttentionQuant.reuse a bool), got {reuse!r}")
    unknown = sorted(set(reuse) - set(REUSABLE))
    if unknown:
        raise ValueError(f"AttentionAblation.reuse: unknown name(s) {unknown}; choose from "
                         f"{REUSABLE}")
    return tuple(n for n in REUSABLE if n in reuse)
