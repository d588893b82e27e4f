"""Every global a Triton kernel reads is one the compiler accepts.

The interpreter runs a @triton.jit function as Python, so a plain module-level number used inside
a kernel works there and fails only when the kernel is compiled ("Cannot access global variable
... Triton kernels can only access global variables that are instantiated as constexpr"). This
test applies the compiler's rule (triton/compiler/code_generator.py, `global_lookup`) to the
source of every jitted function in fp4stack.kernels, in milliseconds and on any machine.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import pkgutil
import textwrap
from types import ModuleType

import pytest

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

import fp4stack.kernels  # noqa: E402


def jitted_functions() -> list[tuple[str, object]]:
    """(qualified name, jitted object) of every kernel and @triton.jit helper in fp4stack."""
    found = {}
    for info in pkgutil.iter_modules(fp4stack.kernels.__path__):
        module = importlib.import_module(f"fp4stack.kernels.{info.name}")
        for name, obj in vars(module).items():
            fn = getattr(obj, "fn", None)
            if callable(fn) and getattr(fn, "__module__", None) == module.__name__ \
                    and hasattr(obj, "arg_names"):
                found[f"{module.__name__}.{name}"] = obj
    return sorted(found.items())


def global_names(fn) -> set[str]:
    """Names the function's body reads that it neither takes nor assigns."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    func = tree.body[0]
    local = {a.arg for a in func.args.args + func.args.kwonlyargs}
    reads = set()
    for node in ast.walk(ast.Module(body=func.body, type_ignores=[])):
        if isinstance(node, ast.Name):
            (reads if isinstance(node.ctx, ast.Load) else local).add(node.id)
    return reads - local


def compiler_accepts(value) -> bool:
    """Triton's rule for a global read inside a kernel (builtins aside)."""
    if isinstance(value, (ModuleType, tl.constexpr, tl.dtype)) or hasattr(value, "arg_names"):
        return True
    if getattr(value, "__triton_builtin__", False) or getattr(value, "__triton_aggregate__", False):
        return True
    return getattr(value, "__module__", "").startswith("triton.language")


KERNELS = jitted_functions()


def test_the_kernels_are_found():
    names = {name.rsplit(".", 1)[1] for name, _ in KERNELS}
    # The kernel whose plain-int global compiled only under the interpreter is among them.
    assert {"quantize_energy_kernel", "gemm_kernel", "quantize_kernel"} <= names, sorted(names)


@pytest.mark.parametrize("name, jitted", KERNELS, ids=[n for n, _ in KERNELS])
def test_every_global_a_kernel_reads_compiles(name, jitted):
    fn = jitted.fn
    rejected = {g: type(fn.__globals__[g]).__name__ for g in global_names(fn)
                if g in fn.__globals__ and g not in vars(builtins)
                and not compiler_accepts(fn.__globals__[g])}
    assert not rejected, (f"{name} reads module globals the Triton compiler refuses: {rejected}; "
                          "define them as tl.constexpr(...) or pass them as constexpr arguments")
