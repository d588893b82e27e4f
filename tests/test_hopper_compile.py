"""Every Triton kernel of the FP4 attention and the fused AdamW4 step compiles for Hopper (sm_90).

The kernels' numerics are tested under the Triton interpreter, which does not compile anything;
these tests run the real compiler for the H200's target in a process without TRITON_INTERPRET,
through the benchmarks' --compile-check (fp4stack.kernels.hopper), so a construct only the
interpreter accepts fails in CI, not on the GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[1]


def compile_check(script: str) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--compile-check"],
                       capture_output=True, text=True, env=env, timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.splitlines()


def test_attention_kernels_compile_for_sm90_with_tensor_core_dots():
    lines = compile_check("bench_attention.py")
    # Two head dims x (3 quantize + 2 stochastic quantize + forward + delta + 4 backward + 6
    # ablation variants + 2 of delta="dp"'s first pass).
    assert len(lines) == 38, lines
    dots = [line for line in lines if " fwd " in line or " dq" in line or "dkdv" in line
            or " amax " in line]
    assert dots and all("wgmma=True" in line for line in dots), dots


def test_fused_adamw4_step_compiles_for_sm90_with_at_most_a_few_spills():
    lines = compile_check("bench_optim.py")
    assert len(lines) == 9, lines
    # The register caps (STEP_MAXNREG, SUMS_MAXNREG) trade a few spilled words, read back from
    # L1, for more warps per SM (faster on the H200); more than that would be a cliff.
    spilled = [int(line.split(" bytes spilled")[0].rsplit(" ", 1)[1]) for line in lines
               if "bytes spilled" in line]
    assert len(spilled) == 9 and max(spilled) <= 64, lines
    # ...and the caps reach the compiler (ptxas's count, where a ptxas reads the PTX).
    from fp4stack.kernels import adamw4

    regs = {line.split(":")[0]: int(line.split(" registers")[0].rsplit(" ", 1)[1])
            for line in lines if " registers" in line}
    if regs:
        assert regs["adamw4 pass step decay=True full tiles=True"] <= adamw4.STEP_MAXNREG, regs
        assert regs["adamw4 pass sums full tiles=True"] <= adamw4.SUMS_MAXNREG, regs
    # The static SASS count per element (where the wheel has cuobjdump; the passes' tiles
    # differ in size): the sums pass only decodes v and updates it, the calibration pass adds
    # m but neither the update nor the quantizers, so each is shorter than the step pass; full
    # tiles drop the masks.
    sass = {line.split(":")[0]: int(line.split("(~")[1].split(" per element")[0])
            for line in lines if "per element" in line}
    if sass:
        assert len(sass) == 7 and all(20 < n < 1000 for n in sass.values()), sass
        step = sass["adamw4 pass step decay=False full tiles=True"]
        sums = sass["adamw4 pass sums full tiles=True"]
        assert sums < sass["adamw4 pass calibrate decay=False full tiles=True"] < step
        assert sums < sass["adamw4 pass sums full tiles=False"]
        assert step <= sass["adamw4 pass step decay=True full tiles=True"]
        assert step < sass["adamw4 pass step decay=False full tiles=False"]


def test_training_quantize_kernels_compile_for_sm90_on_both_tiles_and_in_pairs():
    lines = compile_check("bench_quantize.py")
    # 6 operand kinds x 2 tiles (+1 packed variant of RNE on each), units of a stack on both
    # tiles, 4 pairs and 2 of their amax passes, 2 amax x 2 tiles.
    assert len(lines) == 26, lines
    assert sum("column-major" in line for line in lines) == 10, lines
    spilled = [int(line.split(" bytes spilled")[0].rsplit(" ", 1)[1]) for line in lines
               if "bytes spilled" in line]
    assert all(s == 0 for s in spilled), lines
