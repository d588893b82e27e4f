"""A process killed (SIGKILL) in the middle of writing, then a rerun: only complete files are
left, and no temporary file stays where a reader looks (save_quantized has its own such test in
test_checkpoint.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from test_data import VOCAB, build, make_corpus, paragraphs
from test_train import config, make_data

from fp4stack.train import train
from fp4stack.train.checkpoint import checkpoint_dirs

TESTS = Path(__file__).resolve().parent

# Dies after writing the first shard of the build's temporary directory.
KILLED_BUILD = """
import os, signal, sys
sys.path.insert(0, sys.argv[3])
import fp4stack.data.build as build_module
from test_data import build

real = build_module.write_shard
def dies(path, tokens, vocab_size):
    real(path, tokens, vocab_size)
    os.kill(os.getpid(), signal.SIGKILL)
build_module.write_shard = dies
from pathlib import Path
build(Path(sys.argv[1]), Path(sys.argv[2]))
"""

# Trains with checkpoints every 2 steps and dies in the middle of writing the second one.
KILLED_CHECKPOINT = """
import os, signal, sys
sys.path.insert(0, sys.argv[3])
import fp4stack.train.checkpoint as ckpt
from test_train import config
from fp4stack.train import train

real, calls = ckpt.save_file, []
def dies(tensors, path, metadata=None):
    calls.append(path)
    if len(calls) == 2:
        with open(path, "wb") as f:
            f.write(b"half a checkpoint")
        os.kill(os.getpid(), signal.SIGKILL)
    real(tensors, path, metadata=metadata)
ckpt.save_file = dies
from pathlib import Path
train(config(Path(sys.argv[1]), Path(sys.argv[2]), max_steps=6, ckpt_every=2, eval_every=2))
"""


def _visible(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if not p.name.startswith("."))


def test_a_killed_data_build_leaves_nothing_half_written(tmp_path):
    corpus = make_corpus(tmp_path / "corpus", paragraphs())
    out = tmp_path / "out"
    killed = subprocess.run([sys.executable, "-c", KILLED_BUILD, str(corpus), str(out),
                             str(TESTS)], capture_output=True, text=True)
    assert killed.returncode == -9, killed.stderr
    assert not out.exists() and _visible(tmp_path) == ["corpus"]
    assert any(p.name.startswith(".out.building-") for p in tmp_path.iterdir())
    build(corpus, out, vocab_size=VOCAB)
    assert _visible(out) == ["manifest.json", "tokenizer.json", "train.bin", "val.bin"]
    assert not any(p.name.startswith(".out.") for p in tmp_path.iterdir())  # stale dir gone


def test_a_killed_checkpoint_write_resumes_from_the_last_complete_one(tmp_path):
    data = make_data(tmp_path / "data")
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    killed = subprocess.run([sys.executable, "-c", KILLED_CHECKPOINT, str(data), str(out),
                             str(TESTS)], capture_output=True, text=True, env=env)
    assert killed.returncode == -9, killed.stderr
    root = out / "checkpoints"
    assert [p.name for p in checkpoint_dirs(out)] == ["step_00000002"]
    assert _visible(root) == ["step_00000002"]  # the half-written one is hidden
    result = train(config(data, out, max_steps=6, ckpt_every=2, eval_every=2), resume=True)
    assert result["steps_this_run"] == 4
    assert not any(p.name.startswith(".tmp-") for p in root.iterdir())
    assert [p.name for p in checkpoint_dirs(out)] == ["step_00000004", "step_00000006"]
