"""Host time per call of the quantize path: what a training step pays on the CPU per operand.

A small pretraining step on the H200 keeps the GPU busy only about half the time with NVFP4
recipes (docs/PERFORMANCE.md, "Where a training step's time goes"): the host, not the GPU, sets
the pace. This times each layer of the fake-quantize path on a tensor so small that its kernels
take a few microseconds, so that N calls issued back to back, then one synchronize, measure the
host's cost per call: a plain torch op for scale, the global amax, one quantize launch with the
amax given, the whole `kernels.fake_quantize`, the public autograd `fp4stack.fake_quantize`,
a linear's weight operand as `_QuantLinearFn` makes it (fp32 quantized into bf16), and an
activation with its column-wise copy as two operands or as one pair.

    python benchmarks/bench_launch_overhead.py [--calls 2000] [--rows 64] [--out overhead.json]

On a CPU the reference runs instead of the kernels, so the numbers there are the reference's
own cost; only the GPU's say what the launch path costs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from collections.abc import Callable

import torch

import fp4stack
from fp4stack.api import _impl, backend_for
from fp4stack.formats.spec import QuantSpec
from fp4stack.nn.operands import quantize_operand, quantize_operand_pair

SPECS = {
    "rne 1x16": QuantSpec(nan_policy="propagate"),
    "rne 16x16": QuantSpec(block=(16, 16), nan_policy="propagate"),
    "sr+rht 1x16": QuantSpec(rounding="stochastic", hadamard=True, nan_policy="propagate"),
}


def host_us(fn: Callable[[], object], calls: int, device: torch.device, repeats: int = 3) -> float:
    """Median over `repeats` of the wall microseconds per call of `calls` back-to-back calls."""
    for _ in range(max(10, calls // 10)):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


def cases(spec: QuantSpec, rows: int, device: torch.device) -> dict[str, Callable[[], object]]:
    """The layers of the fake-quantize path, each a call with no arguments."""
    impl = _impl(device)
    x = torch.randn(rows, 512, device=device, dtype=torch.bfloat16)
    w = torch.randn(rows, 512, device=device)  # an fp32 master weight
    amax = x.abs().amax().float()
    out = {
        "torch op (x + 1)": lambda: x + 1,
        "fake_quantize, amax given": lambda: impl.fake_quantize(x, spec, amax=amax),
        "fake_quantize": lambda: impl.fake_quantize(x, spec),
        "fp4stack.fake_quantize (autograd)": lambda: fp4stack.fake_quantize(x, spec=spec),
        "weight operand: fp32 -> bf16": lambda: quantize_operand(w, spec, dtype=torch.bfloat16),
        # A linear's activation and its column-wise copy: two calls, or the pair (one kernel
        # where the kernels read transposes in place, two calls otherwise)
        "x and x.t(): two operands": lambda: (quantize_operand(x, spec),
                                              quantize_operand(x, spec, columnwise=True)),
        "x and x.t(): quantize_operand_pair": lambda: quantize_operand_pair(x, spec, spec),
    }
    if backend_for(device) == "triton":
        from fp4stack.kernels import nvfp4 as kern

        x3 = kern._as_3d(x, spec)
        out["global amax (kernel + torch max)"] = lambda: kern._amax(x3, spec)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000, help="calls per timing")
    ap.add_argument("--rows", type=int, default=64, help="rows of the [rows, 512] test tensor")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    if args.calls < 1 or args.rows < 16:
        raise SystemExit("--calls must be >= 1 and --rows >= 16 (16x16 tiles need 16 rows)")
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    results = {label: {case: host_us(fn, args.calls, device)
                       for case, fn in cases(spec, args.rows, device).items()}
               for label, spec in SPECS.items()}
    print(f"{name}, torch {torch.__version__}, {args.calls} calls of [{args.rows}, 512], "
          f"{datetime.date.today()}; microseconds per call")
    labels = list(SPECS)
    rows = list(dict.fromkeys(c for r in results.values() for c in r))
    print("| call | " + " | ".join(labels) + " |")
    print("|---|" + "---:|" * len(labels))
    for case in rows:
        cells = [f"{results[s][case]:.1f}" if case in results[s] else "-" for s in labels]
        print(f"| {case} | " + " | ".join(cells) + " |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": name, "torch": torch.__version__, "calls": args.calls,
                       "rows": args.rows, "date": str(datetime.date.today()),
                       "us_per_call": results}, f, indent=1)


if __name__ == "__main__":
    main()
