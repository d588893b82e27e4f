"""Host time of one quantizer op call, on the CPU: the op (`fp4stack::fake_quantize`, what a
compiled graph calls) against the backend function it runs, with the Triton launches replaced
by no-ops, so what is timed is the Python around them. A compiled training step makes thousands
of these calls, and where the GPU waits for them they are step time (docs/PERFORMANCE.md).

    python benchmarks/op_dispatch_overhead.py [--reps 3000] [--out overhead.json]
"""

from __future__ import annotations

import argparse
import json
import os

os.environ["TRITON_INTERPRET"] = "1"  # kernels defined for the CPU; their launches are stubbed

import torch  # noqa: E402
from bench_launch_overhead import host_us  # noqa: E402 (this folder's timing of host calls)


class _NoLaunch:
    """Stands in for a @triton.jit kernel: `kernel[grid](...)` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=5, help="medians over this many rounds")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()

    from fp4stack import ops
    from fp4stack.kernels import nvfp4 as kernels
    from fp4stack.kernels import nvfp4_kernels
    from fp4stack.nn.recipe import recipe

    for name in ("quantize_kernel", "amax_kernel", "amax_small_kernel"):
        setattr(nvfp4_kernels, name, _NoLaunch())
    ops.backend_for = lambda device: "triton"  # the kernels' host code for CPU tensors
    spec = recipe("nvfp4-nvidia").x
    key = ops.spec_key(spec)
    x = torch.randn(4096, 1024, dtype=torch.bfloat16)
    amax = torch.tensor(3.0)
    cases = {
        "op (fp4stack::fake_quantize)":
            lambda: ops.fake_quantize_op(x, key, amax, None, "input", None),
        "backend function (kernels.fake_quantize)":
            lambda: kernels.fake_quantize(x, spec, amax=amax),
    }
    cpu = torch.device("cpu")
    rows = {label: host_us(fn, args.reps, cpu, repeats=args.rounds) for label, fn in cases.items()}
    for label, us in rows.items():
        print(f"{label:45s} {us:7.1f} us a call")
    op, direct = rows.values()
    overhead = op - direct
    print(f"{'op dispatch overhead':45s} {overhead:7.1f} us a call")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"torch": torch.__version__, "us_per_call": rows,
                       "overhead_us": overhead}, f, indent=1)


if __name__ == "__main__":
    main()
