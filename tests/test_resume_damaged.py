"""--resume with a damaged newest checkpoint: the bad file is named, and the run continues from
the newest intact checkpoint, or is refused when there is none (fp4stack.train.checkpoint_check)."""

from __future__ import annotations

import json

import pytest
from test_train import config, make_data

from fp4stack.train import train
from fp4stack.train.checkpoint import checkpoint_dirs
from fp4stack.train.checkpoint_check import checkpoint_problem


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished 4-step run with checkpoints at steps 2 and 4 (the data, the config)."""
    root = tmp_path_factory.mktemp("damaged")
    data = make_data(root / "data")
    cfg = config(data, root / "run", max_steps=4, ckpt_every=2, eval_every=2)
    train(cfg)
    return data, root / "run"


def _truncate(path, keep=0.5):
    raw = path.read_bytes()
    path.write_bytes(raw[: int(len(raw) * keep)])


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.pt", "state.json"])
def test_each_damaged_file_is_named(run, tmp_path, name):
    import shutil

    _, out = run
    newest = checkpoint_dirs(out)[-1]
    copy = tmp_path / newest.name
    shutil.copytree(newest, copy)
    assert checkpoint_problem(copy) == ""
    _truncate(copy / name)
    assert str(copy / name) in checkpoint_problem(copy)


def test_resume_passes_over_a_damaged_newest_checkpoint(run, tmp_path, capsys):
    import shutil

    data, out = run
    work = tmp_path / "run"
    shutil.copytree(out, work)
    step2, step4 = checkpoint_dirs(work)
    _truncate(step4 / "model.safetensors")
    capsys.readouterr()
    result = train(config(data, work, max_steps=6, ckpt_every=2, eval_every=2), resume=True)
    said = capsys.readouterr().out
    assert f"{step4 / 'model.safetensors'} is truncated" in said
    assert f"resuming from the newest intact checkpoint, {step2.name}" in said
    assert result["steps_this_run"] == 4  # steps 3 to 6, from the step-2 checkpoint
    assert json.loads((work / "result.json").read_text())["final_val_loss"] == \
        result["final_val_loss"]


def test_resume_without_an_intact_checkpoint_is_refused_naming_each(run, tmp_path):
    import shutil

    data, out = run
    work = tmp_path / "run"
    shutil.copytree(out, work)
    for ckpt in checkpoint_dirs(work):
        _truncate(ckpt / "optimizer.pt")
    with pytest.raises(ValueError, match="no intact checkpoint") as e:
        train(config(data, work, max_steps=6, ckpt_every=2, eval_every=2), resume=True)
    for ckpt in checkpoint_dirs(work):
        assert str(ckpt / "optimizer.pt") in str(e.value)
