"""experiments/paired_gap.py: runs paired by seed, the differences it prints, its sign test."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import paired_gap
import pytest

ROOT = Path(__file__).resolve().parents[2]


def write_run(root: Path, name: str, val: dict[int, float], train: float) -> None:
    run = root / name
    run.mkdir(parents=True)
    lines = [{"step": s, "loss": train} for s in range(10, 201, 10)]
    lines += [{"step": s, "val_loss": v} for s, v in val.items()]
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    (run / "result.json").write_text("{}")


def test_sign_test():
    assert paired_gap.sign_test(3, 3) == 1 / 8
    assert paired_gap.sign_test(0, 5) == 1.0
    assert paired_gap.sign_test(6, 7) == 8 / 128


def test_pairs_by_seed_and_reports_differences(tmp_path):
    a, b = tmp_path / "one", tmp_path / "two"
    write_run(a, "x-s0", {100: 4.0, 200: 3.3}, train=2.2)
    write_run(b, "y-s0", {100: 4.0, 200: 3.0}, train=2.0)
    write_run(a, "x-s1", {100: 4.0, 200: 2.9}, train=2.0)
    write_run(b, "y-s1", {100: 4.0, 200: 3.0}, train=2.0)
    write_run(a, "x-s2", {100: 4.0, 200: 9.0}, train=2.0)  # no y at seed 2: not paired
    (a / "x-s3").mkdir()  # unfinished (no result.json): ignored
    png = tmp_path / "pairs.png"
    out = subprocess.run([sys.executable, str(ROOT / "experiments" / "paired_gap.py"), str(a),
                          str(b), "--pairs", "x:y", "--plot", str(png)],
                         capture_output=True, text=True, check=True).stdout
    assert "| x | y | 0 | 3.3000 | 3.0000 | +10.00% | +10.00% |" in out
    assert "| x | y | 1 | 2.9000 | 3.0000 | -3.33% | +0.00% |" in out
    assert "| x | y | 2 |" not in out
    assert "x worse than y at 1 of 2 seeds (mean +3.33%); one-sided sign test p = 0.7500" in out
    assert png.stat().st_size > 0


def test_refuses_a_pair_without_common_seeds(tmp_path):
    write_run(tmp_path, "x-s0", {100: 3.0}, train=2.0)
    with pytest.raises(subprocess.CalledProcessError) as err:
        subprocess.run([sys.executable, str(ROOT / "experiments" / "paired_gap.py"),
                        str(tmp_path), "--pairs", "x:y"], capture_output=True, text=True,
                       check=True)
    assert "no seed with finished runs of both x and y" in err.value.stderr
