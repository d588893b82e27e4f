"""Compile Triton kernels for Hopper (sm_90) without a GPU, and read ptxas's resource report.

CI machines have no GPU: the kernels' tests run under the Triton interpreter, which checks the
maths but not whether the code compiles for the real target (a construct the interpreter accepts
can fail in the compiler, and register spills only show there). `compile_sm90` runs Triton's
compiler for sm_90 from the kernel's source; `ptxas_report` assembles the PTX with a ptxas shipped
in Triton's wheel, when one reads that PTX version, for registers and spill bytes.

Needs a process without TRITON_INTERPRET=1 (under the interpreter `triton.jit` returns
interpreted functions that cannot be compiled): the benchmarks' `--compile-check` and
tests/test_hopper_compile.py start one.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

from .nvfp4 import _launch_options


@dataclass(frozen=True)
class HopperBuild:
    """What compiling one kernel variant for sm_90 gave."""

    ptx: str
    shared_bytes: int
    registers: int | None  # None: no ptxas at hand reads this PTX
    spilled_bytes: int | None
    sass_instructions: int | None = None  # static count in the cubin; None: no cuobjdump
    loop_sass_instructions: int | None = None  # of those, inside loops (a backward branch's)

    @property
    def uses_wgmma(self) -> bool:
        return "wgmma" in self.ptx

    def describe(self) -> str:
        regs = ("" if self.registers is None
                else f", {self.registers} registers, {self.spilled_bytes} bytes spilled")
        sass = "" if self.sass_instructions is None else f", {self.sass_instructions} SASS"
        return f"wgmma={self.uses_wgmma}, shared={self.shared_bytes}{regs}{sass}"


def signature(fn, constexprs: dict, types: dict[str, str], default: str = "i32") -> dict:
    """Triton's signature dict for `fn`: constexpr for the names in `constexprs`, `types[name]`
    for the others (e.g. "*bf16", "fp32"), `default` where not named."""
    return {n: "constexpr" if n in constexprs else types.get(n, default) for n in fn.arg_names}


def compile_sm90(fn, types: dict[str, str], constexprs: dict, *, num_warps: int = 4,
                 num_stages: int | None = None, maxnreg: int | None = None,
                 default: str = "i32", divisible: tuple[str, ...] = ()) -> HopperBuild:
    """Compile the @triton.jit `fn` for sm_90 with fp4stack's exact-float options (no FMA
    contraction, subnormals kept), as its launches do, and report what it needs. num_stages
    None: Triton's default; maxnreg: a cap on registers per thread. Pointer arguments are
    taken as 16-byte aligned and the integers named in `divisible` as multiples of 16, as a
    launch specializes them (torch's allocations are aligned; 2048, say, is a multiple)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("compile_sm90 needs a process without TRITON_INTERPRET=1")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = signature(fn, constexprs, types, default)
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if sig[name].startswith("*") or name in divisible}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    options = dict(num_warps=num_warps, **_launch_options(maxnreg or 0))
    if num_stages is not None:
        options["num_stages"] = num_stages
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    ptx = kernel.asm["ptx"]
    registers, spilled, sass, loops = ptxas_report(ptx)
    return HopperBuild(ptx, kernel.metadata.shared, registers, spilled, sass, loops)


def ptxas_report(ptx: str) -> tuple[int | None, int | None, int | None, int | None]:
    """(registers, spill-store bytes, SASS instructions, those inside loops) of the PTX for
    sm_90a, from the first
    ptxas in Triton's wheel that accepts it (and its cuobjdump for the static instruction count:
    a kernel without loops issues about that many instructions per thread, which bounds an
    instruction-bound kernel's time); None where no tool does."""
    import triton

    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    for exe in ("ptxas-blackwell", "ptxas"):
        path = os.path.join(bindir, exe)
        if not os.path.exists(path):
            continue
        with tempfile.TemporaryDirectory() as tmp:
            src, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
            with open(src, "w") as fh:
                fh.write(ptx)
            r = subprocess.run([path, "-v", "--gpu-name=sm_90a", src, "-o", cubin],
                               capture_output=True, text=True, check=False)
            regs = re.search(r"Used (\d+) registers", r.stderr)
            if not regs:
                continue
            spill = re.search(r"(\d+) bytes spill stores", r.stderr)
            return int(regs.group(1)), int(spill.group(1)) if spill else 0, \
                *_sass_count(os.path.join(bindir, "cuobjdump"), cubin)
    return None, None, None, None


def _sass_count(cuobjdump: str, cubin: str) -> tuple[int | None, int | None]:
    """(instructions, instructions inside loops) of the cubin's SASS; a loop is the span from
    a backward branch's target to the branch."""
    if not os.path.exists(cuobjdump):
        return None, None
    r = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True, check=False)
    # Instruction lines look like "        /*0040*/                   IMAD.MOV.U32 R1, ..."; the
    # NOPs that pad the end of the code are not counted.
    code = [(int(addr, 16), ins) for addr, ins in re.findall(
        r"^\s+/\*([0-9a-f]{4,})\*/\s+([^;]*);", r.stdout, flags=re.M)
        if not re.match(r"(@!?U?P\w+\s+)?NOP\b", ins)]
    spans = [(int(m.group(1), 16), addr) for addr, ins in code
             if (m := re.search(r"\bBRA\b.*0x([0-9a-f]+)", ins)) and int(m.group(1), 16) < addr]
    in_loops = sum(1 for addr, _ in code if any(lo <= addr <= hi for lo, hi in spans))
    return (len(code) or None), in_loops
