"""experiments/study_lowrank_capture.py: the share of W - Q(W) a rank-r branch can hold."""

from __future__ import annotations

from pathlib import Path

import study_lowrank_capture as study
import torch

from fp4stack.nn.lowrank import lowrank_factors

ROOT = Path(__file__).resolve().parents[2]


def test_shares_grow_with_rank_to_one_and_match_the_branch():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 80, generator=g)
    err = w - study.fake_quantize(w, spec=study.SPECS["1x16"])
    shares = study.energy_shares(err, [1, 16, 48, 80])
    assert 0 < shares[0] < shares[1] < shares[2] and abs(shares[2] - 1) < 1e-9 and shares[3] == 1
    # The branch fp4stack builds removes exactly that share of the error's energy.
    a, b = lowrank_factors(w, study.SPECS["1x16"], 16)
    left = (err - b @ a).norm() ** 2 / err.norm() ** 2
    assert abs(float(left) - (1 - shares[1])) < 1e-5


def test_absorbed_error_is_the_residual_of_w_minus_its_top_directions():
    g = torch.Generator().manual_seed(1)
    # A rank-2 spike on top of small noise: absorbing it leaves the noise to quantize, whose
    # blocks have no outlier, so the error falls far below that of quantizing W whole.
    spike = 30 * torch.randn(40, 2, generator=g) @ torch.randn(2, 64, generator=g)
    w = spike + 0.1 * torch.randn(40, 64, generator=g)
    spec = study.SPECS["1x16"]
    whole = float((w - study.fake_quantize(w, spec=spec)).norm() / w.norm())
    r0, r2, r40 = study.absorbed_errors(w, spec, [0, 2, 40])
    assert abs(r0 - whole) < 1e-6  # rank 0 absorbs nothing
    assert r2 < whole / 20
    assert r40 < 1e-5  # full rank: nothing left to quantize


def test_rows_and_summary_on_a_tiny_model(capsys):
    layer = torch.nn.Linear(64, 32)
    model = torch.nn.ModuleDict({"proj": layer, "lm_head": torch.nn.Linear(32, 10)})
    rows = study.layer_rows(model, [4, 16])
    assert [r["name"] for r in rows] == ["proj"] and rows[0]["shape"] == (32, 64)
    for label in study.SPECS:
        assert 0 < rows[0][label]["rel_error"] < 0.3
        assert rows[0][label]["shares"][0] < rows[0][label]["shares"][1] < 1
        assert rows[0][label]["absorbed"][1] < rows[0][label]["absorbed"][0] < rows[0][label][
            "rel_error"]
    table = study.summary(rows, [4, 16])
    assert table.count("\n| 1x16 |") == 2 and table.count("\n| 16x16 |") == 2


def test_cli_on_the_tiny_random_llama(capsys):
    study.main(["--model", "tiny-dense", "--ranks", "8"])
    out = capsys.readouterr().out
    assert "linear layers" in out and "| 16x16 | 8 |" in out
