"""benchmarks/bench_launch_overhead.py: its cases run and its table names each (CPU here)."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from scripts import load_script

bench = load_script("benchmarks/bench_launch_overhead.py")


def test_every_case_quantizes_like_the_reference():
    # The cases must time the real path: each returns the reference's values for its inputs
    # (the cases draw x, then w, from torch's generator; the same seed draws them again here).
    from fp4stack.formats import nvfp4 as reference

    spec = bench.SPECS["rne 16x16"]
    torch.manual_seed(0)
    fns = bench.cases(spec, 16, torch.device("cpu"))
    torch.manual_seed(0)
    x = torch.randn(16, 512, dtype=torch.bfloat16)
    w = torch.randn(16, 512)
    x_hat = reference.fake_quantize(x, spec)
    assert torch.equal(fns["fake_quantize"](), x_hat)
    assert torch.equal(fns["fake_quantize, amax given"](), x_hat)
    assert torch.equal(fns["fp4stack.fake_quantize (autograd)"](), x_hat)
    assert not torch.equal(x_hat, x)  # it did quantize
    w_hat = fns["weight operand: fp32 -> bf16"]()
    assert w_hat.dtype == torch.bfloat16
    assert torch.equal(w_hat, reference.fake_quantize(w, spec).to(torch.bfloat16))


def test_main_prints_a_row_per_case_and_writes_json(tmp_path, monkeypatch, capsys):
    out = tmp_path / "o.json"
    monkeypatch.setattr(sys, "argv", ["bench", "--calls", "2", "--rows", "16", "--device", "cpu",
                                      "--out", str(out)])
    bench.main()
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "| call | rne 1x16 | rne 16x16 | sr+rht 1x16 |"
    body = {line.split(" | ")[0][2:] for line in lines[3:]}
    assert body == {"torch op (x + 1)", "fake_quantize, amax given", "fake_quantize",
                    "fp4stack.fake_quantize (autograd)", "weight operand: fp32 -> bf16",
                    "x and x.t(): two operands", "x and x.t(): quantize_operand_pair"}
    data = json.loads(out.read_text())
    assert set(data["us_per_call"]) == set(bench.SPECS)
    assert all(v > 0 for r in data["us_per_call"].values() for v in r.values())


def test_bad_arguments_are_refused(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench", "--rows", "8", "--device", "cpu"])
    with pytest.raises(SystemExit, match="--rows"):
        bench.main()
