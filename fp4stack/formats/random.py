"""Counter-based random draws for stochastic rounding, identical on every backend.

Element i of a tensor quantized with seed s draws `uniform(s, i)`: a pure function of the seed
and the element's linear index. The torch reference and the Triton kernels compute it the same
way, so stochastic rounding is reproducible bit for bit across CPU and GPU, independent of launch
configuration.

The mixer is Chris Wellons' `lowbias32` integer hash (public domain), applied twice.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
MUL1 = 0x7FEB352D
MUL2 = 0x846CA68B
SEED_SALT = 0x9E3779B9
UNIFORM_BITS = 24


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    # (x * c) mod 2**32 for x < 2**32 held in int64, in 16-bit halves so nothing overflows int64.
    lo = (x & 0xFFFF) * c
    hi = ((x >> 16) * c) & 0xFFFF
    return (lo + (hi << 16)) & MASK32


def lowbias32(x: torch.Tensor) -> torch.Tensor:
    """The lowbias32 bijection on uint32 values held in an int64 tensor."""
    x = x ^ (x >> 16)
    x = _mul32(x, MUL1)
    x = x ^ (x >> 15)
    x = _mul32(x, MUL2)
    return x ^ (x >> 16)


def lowbias32_int(x: int) -> int:
    """lowbias32 on a Python int (used to derive the per-call keys on the host)."""
    x &= MASK32
    x ^= x >> 16
    x = (x * MUL1) & MASK32
    x ^= x >> 15
    x = (x * MUL2) & MASK32
    return x ^ (x >> 16)


def seed_keys(seed: int) -> tuple[int, int]:
    """Two 32-bit keys derived from a seed: any int, of which the low 64 bits count (the low
    32 XOR the next 32), so seeds that agree there draw the same values."""
    k1 = lowbias32_int(seed ^ (seed >> 32))
    k2 = lowbias32_int(k1 ^ SEED_SALT)
    return k1, k2


def seed_keys_tensor(seed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`seed_keys` of an int64 seed tensor (one element), as 0-d int64 tensors on its device:
    the same keys as the int's, computed without reading the seed back to the host."""
    s = seed.reshape(())
    k1 = lowbias32((s ^ (s >> 32)) & MASK32)
    return k1, lowbias32(k1 ^ SEED_SALT)


def random_bits(index: torch.Tensor, seed: int | torch.Tensor) -> torch.Tensor:
    """32 random bits (int64 in [0, 2**32)) for each int64 linear index; `seed` an int or an
    int64 tensor of one element (the same draws as its value)."""
    k1, k2 = seed_keys_tensor(seed) if isinstance(seed, torch.Tensor) else seed_keys(seed)
    h = lowbias32((index & MASK32) ^ k1)
    return lowbias32(h ^ k2 ^ ((index >> 32) & MASK32))


def uniform(index: torch.Tensor, seed: int | torch.Tensor) -> torch.Tensor:
    """float32 draws in [0, 1) on a 2**-24 grid, one per int64 linear index."""
    bits = random_bits(index, seed) >> (32 - UNIFORM_BITS)
    return bits.to(torch.float32) * (2.0**-UNIFORM_BITS)


def stream_seed(*keys: int) -> int:
    """A 63-bit seed for torch's CPU generator named by non-negative integer keys (a run's
    seed, a step, a micro-batch): the same keys give the same stream in any process, so the
    stochastic rounding of a micro-batch does not depend on which rank runs it."""
    import numpy as np

    return int(np.random.SeedSequence(list(keys)).generate_state(1, np.uint64)[0] >> 1)


def draw_seed(generator: torch.Generator | None = None) -> int:
    """A fresh 62-bit seed from torch's CPU generator, so torch.manual_seed makes runs repeat."""
    return int(torch.randint(0, 2**62, (1,), generator=generator).item())


def draw_seed_tensor(generator: torch.Generator | None = None) -> torch.Tensor:
    """`draw_seed`'s draw (same generator use, same value) left as a 0-d int64 CPU tensor: no
    `.item()`, so torch.compile traces it into the graph."""
    return torch.randint(0, 2**62, (1,), generator=generator).reshape(())
