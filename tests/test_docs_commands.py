"""Every command the docs show still runs: each `fp4stack ...` line parses with the CLI's own
parser and names config files, recipes and scripts that exist; each script the docs run
(`python benchmarks/...`, `python experiments/...`) exists and accepts the options it is shown
with. Commands are collected from ```bash blocks, and inline code that is a whole run (a config
or a script), in README.md and docs/."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_FENCE = re.compile(r"^```(\w*)\s*$")
_INLINE = re.compile(r"`((?:fp4stack|python) [^`]+)`")
_STARTS = ("fp4stack ", "python benchmarks/", "python experiments/")


def _fenced_lines(text: str):
    lang = None
    pending = ""
    for line in text.splitlines():
        fence = _FENCE.match(line.strip())
        if fence:
            lang = None if lang is not None else fence.group(1)
            continue
        if lang not in ("bash", "sh", "shell", "console"):
            continue
        line = line.strip().removeprefix("$ ")
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        yield pending + line
        pending = ""


def _commands() -> list[tuple[str, str]]:
    found = {}
    for doc in DOCS:
        text = doc.read_text()
        # inline code names a command as often as it runs one: only whole runs are checked
        inline = [c for c in _INLINE.findall(text) if "--config" in c or c.startswith("python")]
        lines = list(_fenced_lines(text)) + inline
        for line in lines:
            line = line.split(" #")[0].strip()
            if "<" in line or "..." in line:  # a pattern (`--recipe <name>`), not a command
                continue
            if line.startswith(_STARTS):
                found.setdefault(line, doc.relative_to(ROOT).as_posix())
    return sorted((where, cmd) for cmd, where in found.items())


COMMANDS = _commands()


def test_the_docs_show_commands():
    assert sum(c.startswith("fp4stack ") for _, c in COMMANDS) >= 10


def _tokens(command: str) -> list[str]:
    tokens = shlex.split(command)
    # a pipeline or a second command on the line ends this one
    for i, t in enumerate(tokens):
        if t in ("|", "&&", ";", ">", "2>&1"):
            return tokens[:i]
    return tokens


def _check_paths(tokens: list[str]) -> None:
    for t in tokens:
        for part in t.split(","):
            if part.startswith(("configs/", "benchmarks/", "experiments/")) and "*" not in part:
                assert (ROOT / part).exists(), f"{part} does not exist"


@pytest.mark.parametrize("where, command",
                         [c for c in COMMANDS if c[1].startswith("fp4stack ")],
                         ids=lambda v: v if "/" in v or len(v) < 60 else None)
def test_fp4stack_command_parses(where, command):
    from fp4stack.cli import build_parser
    from fp4stack.train.config import recipe_arg

    tokens = _tokens(command)[1:]
    try:
        args = build_parser().parse_args(tokens)
    except SystemExit as e:
        if e.code == 0:  # --help
            return
        pytest.fail(f"{where}: `{command}` does not parse (exit {e.code})")
    _check_paths(tokens)
    for key in ("recipe", "recipes"):
        value = getattr(args, key, None)
        if isinstance(value, str):
            for name in value.split(","):
                if name.endswith((".yaml", ".yml")):
                    if name.startswith("configs/"):  # else the user's own file
                        assert (ROOT / name).exists(), f"{where}: {name} does not exist"
                else:
                    recipe_arg(name)  # raises naming the recipe when it is unknown


def _scripts() -> dict[str, set[str]]:
    """Each script the docs run, with the options they show it with."""
    scripts: dict[str, set[str]] = {}
    for _, command in COMMANDS:
        if command.startswith("python "):
            tokens = _tokens(command)
            opts = {t.split("=")[0] for t in tokens[2:] if t.startswith("--")}
            scripts.setdefault(tokens[1], set()).update(opts)
    return scripts


@pytest.mark.parametrize("script, options", sorted(_scripts().items()))
def test_script_exists_and_takes_its_options(script, options):
    assert (ROOT / script).exists(), f"{script} does not exist"
    r = subprocess.run([sys.executable, str(ROOT / script), "--help"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    unknown = sorted(o for o in options if o not in r.stdout)
    assert not unknown, f"{script} --help does not list {unknown}"
