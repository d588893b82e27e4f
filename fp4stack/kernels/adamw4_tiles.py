"""Device functions of the fused AdamW4 step (kernels/adamw4.py), per tile of BM rows x KB
16-element blocks: decoding and encoding NVFP4 codes and scales, reading v back through its
rank-1 factors, the rounding keys, loads, masks and offsets.

Each repeats an operation of the reference step (optim/adamw4_state.py, state_transforms.py,
formats/nvfp4.py) in the same order of float32 operations, so the fused step is bit-exact.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import nvfp4_jit as jit
from .adamw4_layout import COL_TILES, COLS, NMETA, ROWS, TILE0

_SALT = tl.constexpr(0x9E3779B9)  # formats/random.SEED_SALT
_ZERO_SCALE_BOUND = tl.constexpr(12 * 2.0**-10)  # state_transforms._ZERO_SCALE_BOUND


@triton.jit
def field(meta, col, ty: tl.constexpr):
    # Every pointer in the table is 16-byte aligned (the host checks): vector loads.
    return tl.multiple_of(tl.load(meta + col).to(tl.pointer_type(ty)), 16)


@triton.jit
def keep(x, mask, EVEN: tl.constexpr):
    """x where mask, else 0 (no mask when every tile is full)."""
    if EVEN:
        return x
    else:
        return tl.where(mask, x, 0.0)


@triton.jit
def load(ptr, mask):
    """tl.load, masked with 0 for masked-off elements unless mask is None (full tiles)."""
    if mask is None:
        return tl.load(ptr)
    else:
        return tl.load(ptr, mask=mask, other=0)


@triton.jit
def uniform(index, k1, k2):
    """nvfp4_jit.uniform for int32 indices (a tensor of < 2**31 elements: no high word)."""
    h = jit.lowbias32(index.to(tl.uint32) ^ k1)
    h = jit.lowbias32(h ^ k2)
    return (h >> 8).to(tl.float32) * 5.9604644775390625e-08


@triton.jit
def codes(b):
    """E2M1 codes [BM, KB, 8] of half-blocks from their 4 packed bytes b [BM, KB, 4]."""
    b = b.to(tl.int32)
    return tl.reshape(tl.join(b & 0xF, b >> 4), (b.shape[0], b.shape[1], 8))


@triton.jit
def values(b_lo, b_hi, sbits, dec):
    """Values of a tile of an NVFP4 tensor as lo, hi half-blocks and its block scales, from its
    packed bytes, block scale bits and decode scale, in formats/nvfp4.dequantize's order:
    (e2m1 * scale) * D, D = jit.global_decode(amax, 448)."""
    s = jit.e4m3_value(sbits.to(tl.int32))[:, :, None]
    lo = (jit.e2m1_value(codes(b_lo)) * s) * dec
    hi = (jit.e2m1_value(codes(b_hi)) * s) * dec
    return lo, hi, s


@triton.jit
def root_read(x, s, dec, est_root):
    """The root of v from its dequantized stored form: zeros lifted to the block floor
    (state_transforms.block_floor), times the root of the rank-1 estimate (read_state)."""
    floor = (0.5 * tl.where(s == 0, _ZERO_SCALE_BOUND, s)) * dec
    return tl.where(x == 0, floor, x) * est_root


@triton.jit
def safe_div(x, d):
    pos = d > 0
    return tl.where(pos, tl.math.div_rn(x, tl.where(pos, d, 1.0)), 0.0)


@triton.jit
def keys(seed_hash, index, step, moment: tl.constexpr):
    """seed_keys(state_seed(seed, index, step, moment)) of optim/adamw4_state.py, on uint32."""
    h = seed_hash.to(tl.uint32)
    h = jit.lowbias32(h ^ jit.lowbias32(index))
    h = jit.lowbias32(h ^ jit.lowbias32(step))
    h = jit.lowbias32(h ^ jit.lowbias32(tl.full((), moment, tl.uint32)))
    k1 = jit.lowbias32(h)
    return k1, jit.lowbias32(k1 ^ tl.full((), _SALT, tl.uint32))


@triton.jit
def quantize(lo, hi, amax, eoff, k1, k2):
    """Codes (lo, hi), E4M3 scale bits and block amaxes of one tile, as formats/nvfp4.quantize
    with stochastic rounding and a given amax (no padding: K is a multiple of 16)."""
    s_enc, s_dec = jit.global_scales(amax, 448.0)
    bmax = jit.block_amax(lo, hi)
    sbits = jit.block_scale_bits(bmax, s_enc, 1.0 / 6.0)
    enc = jit.encode_factor(sbits, s_dec)[:, :, None]
    code_lo = jit.round_half(lo * enc, uniform(eoff, k1, k2), True)
    code_hi = jit.round_half(hi * enc, uniform(eoff + 8, k1, k2), True)
    return code_lo, code_hi, sbits, bmax


@triton.jit
def store_codes(data, scales, boff, soff, m4, bmask, code_lo, code_hi, sbits):
    nan_block = (sbits == 0x7F)[:, :, None]  # the reference's codes there are all 0
    tl.store(data + boff, tl.where(nan_block, 0, jit.pack_pairs(code_lo)), mask=m4)
    tl.store(data + boff + 4, tl.where(nan_block, 0, jit.pack_pairs(code_hi)), mask=m4)
    tl.store(scales + soff, sbits.to(tl.uint8), mask=bmask)


@triton.jit
def max_into(ptr, bmax):
    """Raise *ptr to the largest of this tile's block amaxes [BM, KB]."""
    tl.atomic_max(ptr, jit.abs_max(jit.abs_max(bmax, 1), 0),
                  sem="relaxed")


@triton.jit
def pair(ptr, col, mask):
    """A [1, KB, 8] row vector at columns col and col + 8 (lo and hi half-blocks)."""
    return load(ptr + col, mask), load(ptr + col + 8, mask)


@triton.jit
def offsets(rows, kbs, K):
    """Offsets in the tile rows x blocks kbs: lo columns [1, KB, 8], elements, bytes of the
    codes, block scales."""
    col = kbs[None, :, None] * 16 + tl.arange(0, 8)[None, None, :]
    eoff = rows[:, None, None] * K + col  # element offsets (lo; hi is +8)
    boff = rows[:, None, None] * (K // 2) + kbs[None, :, None] * 8 + tl.arange(0, 4)[None, None, :]
    soff = rows[:, None] * (K // 16) + kbs[None, :]
    return col, eoff, boff, soff


@triton.jit
def masks(rows, kbs, col, R, K):
    """Masks of a partial tile: rows, columns, blocks, elements (lo), code bytes."""
    row_ok = rows < R
    bmask = row_ok[:, None] & (kbs < K // 16)[None, :]
    m8 = bmask[:, :, None] & (tl.arange(0, 8) < 8)[None, None, :]
    m4 = bmask[:, :, None] & (tl.arange(0, 4) < 4)[None, None, :]
    return row_ok, col < K, bmask, m8, m4


@triton.jit
def v_loads(gp, vd, vs, row_root, rows, eoff, boff, soff, row_ok, bmask, m8, m4):
    """What the new v of a tile reads, row by row: the gradient (lo, hi), the old v's code bytes
    (lo, hi) and block scale bits (from its fields vd, vs), its old row roots."""
    g_lo = load(gp + eoff, m8)
    g_hi = load(gp + eoff + 8, m8)
    b_lo = load(vd + boff, m4)
    b_hi = load(vd + boff + 4, m4)
    sbits = load(vs + soff, bmask)
    row_old = load(row_root + rows, row_ok)
    return g_lo, g_hi, b_lo, b_hi, sbits, row_old


@triton.jit
def v_from(g_lo, g_hi, b_lo, b_hi, sbits, row_old, col_lo, col_hi, dec, beta2, w2, m8,
            EVEN: tl.constexpr):
    """The new v of a tile (lo, hi; 0 where masked) from v_loads's values, the old column
    roots and the old v's decode scale; and the roots of the old v as read back."""
    x_lo, x_hi, s = values(b_lo, b_hi, sbits, dec)
    root_lo = root_read(x_lo, s, dec, row_old[:, None, None] * col_lo)
    root_hi = root_read(x_hi, s, dec, row_old[:, None, None] * col_hi)
    v_lo = keep((root_lo * root_lo) * beta2 + (g_lo * w2) * g_lo, m8, EVEN)
    v_hi = keep((root_hi * root_hi) * beta2 + (g_hi * w2) * g_hi, m8, EVEN)
    return v_lo, v_hi, root_lo, root_hi


@triton.jit
def program(work_ptr, meta_ptr, TILING: tl.constexpr):
    """This program's tensor (its index and table row), the tensor's rows and columns, and the
    row and column of the program's tile in it (TILING 0: the step tiles, 2: the sums pass's).
    int32 offsets: the host fuses tensors of < 2**31 elements only; K is a multiple of 16."""
    pid = tl.program_id(0)
    t = tl.load(work_ptr + pid)
    meta = meta_ptr + t * NMETA
    R = tl.load(meta + ROWS).to(tl.int32)
    K = tl.multiple_of(tl.load(meta + COLS).to(tl.int32), 16)
    tile = (pid - tl.load(meta + TILE0 + TILING)).to(tl.int32)
    col_tiles = tl.load(meta + COL_TILES + TILING).to(tl.int32)
    return t, meta, R, K, tile // col_tiles, tile % col_tiles
