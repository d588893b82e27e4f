"""How far Newton-Schulz with NVFP4 GEMM operands lands from fp32 Newton-Schulz and from the exact
polar factor U Vᵀ, per matrix shape (relative Frobenius errors, a few random Gaussian matrices).

    python experiments/study_muon4_newton_schulz.py [--seeds 3]
"""

from __future__ import annotations

import argparse

import torch

from fp4stack.formats.spec import QuantSpec
from fp4stack.optim.muon4 import newton_schulz

SHAPES = [(128, 32), (32, 128), (512, 128), (256, 1024), (64, 64), (256, 256), (1024, 1024)]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=3)
    args = p.parse_args()
    spec = QuantSpec(nan_policy="propagate")
    print("| shape | NVFP4 vs fp32 NS | bf16 vs fp32 NS | fp32 NS vs exact UVᵀ | "
          "NVFP4 NS vs exact UVᵀ |")
    print("|---|---:|---:|---:|---:|")
    for rows, cols in SHAPES:
        errs = []
        for seed in range(args.seeds):
            g = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
            u, _, vh = torch.linalg.svd(g.double(), full_matrices=False)
            polar = u @ vh
            fp32 = newton_schulz(g, dtype=torch.float32)
            bf16 = newton_schulz(g, dtype=torch.bfloat16)
            fp4 = newton_schulz(g, spec=spec, dtype=torch.float32)
            errs.append((rel(fp4, fp32), rel(bf16, fp32), rel(fp32, polar), rel(fp4, polar)))
        cells = " | ".join(f"{min(c):.3f}-{max(c):.3f}" for c in zip(*errs, strict=True))
        print(f"| {rows}x{cols} | {cells} |")


if __name__ == "__main__":
    main()
