"""Where a GPU call spends its time: CUDA time per kernel, from torch.profiler.

For the benchmarks' --profile: one table per call, kernels grouped by name (Triton kernels carry
their function's name; library kernels are shortened), so a pass that dominates shows at once.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable


def kernel_times(fn: Callable[[], object], reps: int = 5) -> list[tuple[str, int, float]]:
    """[(kernel, launches per call, ms per call)] of fn() on the GPU, slowest first, after one
    warm-up call; the times are the kernels' own (device) durations."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    total: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            name = short_name(event.name)
            total[name] += event.device_time / 1e3  # us -> ms
            count[name] += 1
    rows = [(name, count[name] // reps, ms / reps) for name, ms in total.items()]
    return sorted(rows, key=lambda r: -r[2])


def short_name(name: str, width: int = 70) -> str:
    """A kernel's name without its parameter list (the first "(" outside template arguments),
    cut to `width` characters."""
    depth = 0
    for i, ch in enumerate(name):
        depth += (ch == "<") - (ch == ">")
        if ch == "(" and depth == 0:
            name = name[:i]
            break
    return name.strip().removeprefix("void ")[:width]


def format_kernel_times(rows: list[tuple[str, int, float]], limit: int = 15) -> str:
    total = sum(ms for _, _, ms in rows)
    out = ["| kernel | launches | ms | share |", "|---|---:|---:|---:|"]
    for name, n, ms in rows[:limit]:
        out.append(f"| {name} | {n} | {ms:.3f} | {100 * ms / total:.1f}% |")
    rest = rows[limit:]
    if rest:
        out.append(f"| ({len(rest)} others) | {sum(n for _, n, _ in rest)} | "
                   f"{sum(ms for _, _, ms in rest):.3f} | "
                   f"{100 * sum(ms for _, _, ms in rest) / total:.1f}% |")
    out.append(f"| total | {sum(n for _, n, _ in rows)} | {total:.3f} | 100% |")
    return "\n".join(out)
