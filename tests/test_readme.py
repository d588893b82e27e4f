"""Every ```python block of README.md runs, in order, on the CPU; its YAML recipes build."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def test_readme_python_blocks_run(tmp_path, monkeypatch, capsys):
    # A block loads a saved checkpoint with transformers, which needs compressed-tensors.
    pytest.importorskip("compressed_tensors")
    blocks = python_blocks(README.read_text(encoding="utf-8"))
    assert len(blocks) >= 5
    monkeypatch.chdir(tmp_path)  # the save/load example writes a file
    namespace: dict = {"__name__": "__readme__"}
    for i, block in enumerate(blocks):
        exec(compile(block, f"README.md python block {i + 1}", "exec"), namespace)
    out = capsys.readouterr().out
    assert "NaN or Inf" in out


def test_readme_yaml_recipes_build():
    """Each ```yaml block with a `recipe` mapping builds the Recipe it describes."""
    import yaml

    from fp4stack import recipe

    blocks = re.findall(r"^```yaml\n(.*?)^```", README.read_text(encoding="utf-8"),
                        flags=re.S | re.M)
    recipes = [yaml.safe_load(b)["recipe"] for b in blocks if "recipe:" in b]
    assert recipes, "README has no YAML recipe example"
    for m in recipes:
        r, preset = recipe(m), recipe(m["preset"])
        assert r.name == m.get("name", r.name)
        assert all(getattr(r, k) != getattr(preset, k) for k in m if k != "preset"), m
