"""The tables the fused AdamW4 step's kernels (kernels/adamw4.py) read: what the host
(kernels/adamw4_step.py) writes and the device reads, column by column.

One launch covers all tensors of a step: `meta` holds a row of NMETA int64 per tensor (the
pointers of the parameter and its state fields, its rows and columns, its offsets in the scratch
buffers and work lists, its index in the optimizer), a work list maps each program to its
tensor, and a small device buffer holds the per-step scalars (learning rate, bias corrections,
the step for the rounding seeds), so the launches of a step are the same every step and can be
captured once as a CUDA graph. Every pointer in the table is 16-byte aligned (the host checks).
"""

from __future__ import annotations

import triton.language as tl

# The state fields the fused step reads and rewrites (all of a quantized "rank1" parameter's
# tensors with delayed scaling), in the order of the table columns MD..COL.
FIELDS = ("exp_avg_data", "exp_avg_scales", "exp_avg_amax", "exp_avg_next_amax",
          "exp_avg_sq_data", "exp_avg_sq_scales", "exp_avg_sq_amax", "exp_avg_sq_next_amax",
          "exp_avg_sq_row", "exp_avg_sq_col")

# Columns of the per-tensor table: the parameter, the state fields, then sizes and offsets
# (tl.constexpr: the kernel reads them as compile-time constants).
PARAM = tl.constexpr(0)
MD, MS, MA, MN, VD, VS, VA, VN, ROW, COL = (
    tl.constexpr(PARAM + 1 + i) for i in range(len(FIELDS)))
ROWS = tl.constexpr(PARAM + 1 + len(FIELDS))
COLS = tl.constexpr(ROWS + 1)
SCRATCH = tl.constexpr(ROWS + 2)  # offset of its sums, roots, reciprocal roots in the scratch
INDEX = tl.constexpr(ROWS + 3)  # the parameter's index in the optimizer (rounding seeds)
LINE0 = tl.constexpr(ROWS + 4)  # first program of this tensor in the line work list
# First program of this tensor in a tile work list and its tiles per row of tiles: for the
# step tiles, then for the sums tiles.
TILE0 = tl.constexpr(ROWS + 5)
COL_TILES = tl.constexpr(ROWS + 6)
PENDING = tl.constexpr(ROWS + 9)  # offset of its new amaxes (m, v) in the pending buffer
NMETA = tl.constexpr(ROWS + 10)

# Passes of adamw4_kernel (the host passes their .value), and modes of adamw4_factors_kernel.
CALIBRATE, STEP = (tl.constexpr(i) for i in range(2))
FACTORS, FACTORS_FIRST, ROLL = (tl.constexpr(i) for i in range(3))
# The per-step scalars buffer: float32 values, then int32 ones (`step_scalars`).
S_DECAY, S_W1, S_BETA2, S_W2, S_INV_BC2, S_EPS, S_NEG_STEP, S_HEADROOM, S_SEED, S_STEP = (
    tl.constexpr(i) for i in range(10))
NSCALARS = 10
