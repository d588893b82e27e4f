"""The package's import structure: layers import only downwards, and no module imports itself
back through others (a cycle). Lazy imports inside functions count too: they are dependencies
all the same, and so are imports for annotations only (`if TYPE_CHECKING:`)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "fp4stack"

# Lower layers first; a module may import from its own layer or any layer below it.
LAYERS: dict[str, int] = {
    "formats": 0,
    "device": 0,
    "config_fields": 0,
    "files": 0,
    "finished_runs": 0,
    "parallel_runs": 0,
    "kernels": 1,
    "api": 2,
    "ops": 2,
    "nn": 3,
    "models": 4,
    "optim": 4,
    "convert": 5,
    "compressed_tensors": 5,
    "compressed_tensors_read": 5,
    "compressed_tensors_moe": 5,
    "transformers_experts": 5,
    "data": 5,
    "analysis": 6,
    "train": 7,
    "rl": 8,
    "cli": 9,
    "__main__": 9,
    "__init__": 9,
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The fp4stack modules `path` imports, relative imports resolved."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "fp4stack")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.split(".")[0] != "fp4stack":
                continue
            # `from . import x` names a submodule x, or a name defined in the package
            for a in node.names:
                if a.name.startswith("__"):
                    continue  # the package's metadata (__version__), not a dependency
                sub = f"{module}.{a.name}"
                found.add(sub if sub in modules else module)
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        graph[name] = {m for m in _imports(path, set(modules)) if m in modules and m != name}
    return graph


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _is_package_init(module: str) -> bool:
    return (PACKAGE.parent / module.replace(".", "/") / "__init__.py").exists()


def test_every_module_has_a_layer():
    unknown = sorted({_layer(m) for m in _graph()} - set(LAYERS))
    assert not unknown, f"give these top-level modules a layer in LAYERS: {unknown}"


def test_imports_go_down_the_layers():
    upward = []
    for module, deps in _graph().items():
        for dep in deps:
            if _layer(dep) not in LAYERS or _layer(module) not in LAYERS:
                continue
            if LAYERS[_layer(dep)] > LAYERS[_layer(module)]:
                upward.append(f"{module} -> {dep}")
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(sorted(upward))


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    # A package's __init__ re-exports its modules; those edges are a package's face, not a
    # dependency of the modules on each other, so they are left out.
    graph = {m: {d for d in deps if not _is_package_init(d)} for m, deps in _graph().items()}
    cycles = _cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


@pytest.mark.parametrize("graph, expected", [
    ({"a": {"b"}, "b": {"a"}, "c": set()}, [["a", "b"]]),
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
])
def test_the_cycle_finder_finds_cycles(graph, expected):
    assert _cycles(graph) == expected


MAX_LINES = 450
MAX_DOCSTRING_LINES = 40


def test_modules_stay_small():
    big = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        lines = len(source.splitlines())
        doc = ast.get_docstring(ast.parse(source), clean=False) or ""
        if lines > MAX_LINES:
            big.append(f"{path.relative_to(PACKAGE.parent)}: {lines} lines")
        if len(doc.splitlines()) > MAX_DOCSTRING_LINES:
            big.append(f"{path.relative_to(PACKAGE.parent)}: docstring of "
                       f"{len(doc.splitlines())} lines")
    assert not big, "split these, or move their prose to docs/:\n" + "\n".join(big)

