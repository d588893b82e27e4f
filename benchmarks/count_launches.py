"""Kernel launches of one optimizer step, counted on the CPU: the work a launch-bound step does.

A GPU step of Muon4 is bound by its launches (docs/PERFORMANCE.md): thousands of small kernels.
This counts them without a GPU. The step runs on CPU tensors with the Triton kernels under the
interpreter (TRITON_INTERPRET=1, set here) standing in for the GPU's, and counts each Triton
launch and each torch op that computes (views and other metadata-only ops excluded), which on a
GPU is one kernel each. A count, not a time: the GPU's fusions (cuBLAS epilogues, Inductor)
are not modelled.

    python benchmarks/count_launches.py [--dim 64] [--blocks 7] [--out counts.json]

The default: the matrices of 7 GPT blocks (49, as bench_optim.py's 100M-parameter set at dim
1024), at dim 64 so the interpreter takes seconds; the count does not depend on the dim.
"""

from __future__ import annotations

import argparse
import json
import os
from collections import Counter

os.environ["TRITON_INTERPRET"] = "1"  # before fp4stack.kernels defines its kernels

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

# Ops that only make a view or read metadata: no kernel on a GPU.
_VIEWS = {"view", "_unsafe_view", "t", "transpose", "expand", "as_strided", "select", "slice",
          "unsqueeze", "squeeze", "permute", "alias", "detach", "split", "split_with_sizes",
          "unbind", "diagonal", "lift_fresh", "empty", "empty_strided", "empty_like", "size",
          "stride", "numel", "is_same_size", "_reshape_alias", "view_as_real", "view_as_complex",
          "unflatten", "chunk", "narrow", "movedim", "reshape", "_local_scalar_dense",
          "resolve_conj", "resolve_neg", "set_", "new_empty", "new_empty_strided"}


class OpCounter(TorchDispatchMode):
    """Counts the torch ops that compute, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if name not in _VIEWS:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def count_step(make_optimizer, params: list[torch.nn.Parameter]) -> dict:
    """Ops and Triton launches of the second step (the first also builds states)."""
    from triton.runtime.interpreter import InterpretedFunction

    from fp4stack import ops

    launches: Counter[str] = Counter()
    run = InterpretedFunction.run

    def counted(self, *args, **kwargs):
        launches[self.fn.__name__] += 1
        return run(self, *args, **kwargs)

    backend = ops.backend_for
    ops.backend_for = lambda device: "triton"  # the kernels for CPU tensors too
    InterpretedFunction.run = counted
    try:
        opt = make_optimizer(params)
        opt.step()
        launches.clear()
        with OpCounter() as counter:
            opt.step()
    finally:
        InterpretedFunction.run = run
        ops.backend_for = backend
    return {"torch_ops": sum(counter.ops.values()), "triton_launches": sum(launches.values()),
            "top_torch_ops": counter.ops.most_common(12), "triton": dict(launches)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=7)
    ap.add_argument("--out", help="write the counts as JSON here")
    args = ap.parse_args()

    from fp4stack.optim.muon4 import Muon4

    d = args.dim
    shapes = ([(d, d)] * 4 + [(3 * d, d)] * 2 + [(d, 3 * d)]) * args.blocks
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(r, c) * 0.02) for r, c in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    arms = {"Muon (bf16 Newton-Schulz)": lambda ps: Muon4(ps, quantize=False, cuda_graphs=False),
            "Muon4": lambda ps: Muon4(ps, cuda_graphs=False)}
    results = {name: count_step(make, params) for name, make in arms.items()}
    print(f"{len(shapes)} matrices ({args.blocks} GPT blocks at dim {d}); one optimizer step")
    print("| optimizer | torch ops (GPU kernels) | Triton launches | total |\n|---|---:|---:|---:|")
    for name, r in results.items():
        total = r["torch_ops"] + r["triton_launches"]
        print(f"| {name} | {r['torch_ops']:,} | {r['triton_launches']:,} | {total:,} |")
    for name, r in results.items():
        print(f"{name}: most frequent torch ops {r['top_torch_ops']}; Triton {r['triton']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"dim": d, "matrices": len(shapes), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
