"""q/k/v and gate/up as one GEMM at inference (nn.fused_projections) against the unfused model.

The fused GEMM multiplies the same values (one input, so one activation amax; the siblings'
rows, quantized with their shared global amax): outputs equal the unfused ones up to the
summation order a wider GEMM may choose, hence the fp32 tolerance. On CPU the packed path runs
its Triton kernels under the interpreter (nn.operands._FUSED_ON_CPU); on a GPU the packed and
engine tests run on it.
"""

from __future__ import annotations

import copy

import pytest
import torch

from fp4stack import recipe
from fp4stack.convert import calibrate, quantize_model
from fp4stack.data.char_tokenizer import CharTokenizer
from fp4stack.formats.spec import QuantSpec
from fp4stack.models import GPT, GPTConfig
from fp4stack.nn import operands as operands_mod
from fp4stack.nn.fused_projections import FusedProjection, fuse_projections, project
from fp4stack.nn.recipe_types import ResidualCompensation
from fp4stack.rl.fast_rollout import FastRolloutEngine
from fp4stack.rl.rollout import RolloutEngine

TOK = CharTokenizer()
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def gpt(seed: int = 0, moe: bool = False, **fields) -> GPT:
    torch.manual_seed(seed)
    cfg = GPTConfig.tiny_moe if moe else GPTConfig.tiny
    return GPT(cfg(vocab_size=TOK.vocab_size, max_seq_len=32, **fields)).eval().requires_grad_(
        False)


def tokens() -> torch.Tensor:
    return torch.randint(0, TOK.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))


def packed(model: GPT, name: str = "w4a4") -> GPT:
    rec = recipe("w4a4") if name == "w4a16" else recipe(name)
    if name == "w4a16":
        rec = rec.with_(x=QuantSpec(format="none"))
    quantize_model(model, rec)  # packs q/k/v and gate/up each with one shared global amax
    assert model.model.layers[0].self_attn.q_proj.weight is None
    return model


def test_bf16_groups_share_one_weight_and_match_the_unfused_model():
    model, x = gpt(), tokens()
    with torch.no_grad():
        want = model(x)[0]
        fused = copy.deepcopy(model)
        n = fuse_projections(fused)
        got = fused(x)[0]
    blocks = fused.config.n_layers
    assert n == 2 * blocks  # q/k/v and gate/up of every block
    attn = fused.model.layers[0].self_attn
    group = attn.q_proj.fused_projection
    assert group.members == (attn.q_proj, attn.k_proj, attn.v_proj)
    assert attn.k_proj.weight.data_ptr() == group.weight[group.sizes[0]].data_ptr()
    assert fused.state_dict().keys() == model.state_dict().keys()  # nothing held twice
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_load_writes_the_fused_weight_and_a_conversion_unfuses():
    model, other, x = gpt(0), gpt(1), tokens()
    fuse_projections(model)
    model.load_state_dict(other.state_dict())  # in place: what a weight sync does
    with torch.no_grad():
        torch.testing.assert_close(model(x)[0], other(x)[0], rtol=1e-5, atol=1e-5)
        model.double()  # replaces every tensor: the members run on their own again
        attn = model.model.layers[0].self_attn
        assert not attn.q_proj.fused_projection.intact()
        torch.testing.assert_close(model(x)[0], other.double()(x)[0], rtol=1e-12, atol=1e-12)


def test_no_fusion_under_gradients_or_for_groups_that_differ(monkeypatch):
    model = gpt()
    fuse_projections(model)
    mlp = model.model.layers[0].mlp
    calls = []
    real = FusedProjection.__call__
    monkeypatch.setattr(FusedProjection, "__call__",
                        lambda self, x: calls.append(1) or real(self, x))
    x = torch.randn(3, model.config.dim)
    with torch.no_grad():
        project(x, mlp.gate_proj, mlp.up_proj)
    assert calls == [1]
    project(x.requires_grad_(), mlp.gate_proj, mlp.up_proj)  # a gradient is wanted
    assert calls == [1]
    assert project(x, mlp.up_proj, mlp.gate_proj)[0].shape[-1] == mlp.up_proj.out_features
    assert calls == [1]  # not the fused members' order


@pytest.mark.parametrize("name", ["w4a4", "w4a16", "w4a4-rc", "w4a4-rc-token"])
def test_packed_groups_match_the_unfused_layers(name, monkeypatch):
    # QUADS too: one x~ per member (its own channels) in one GEMM, as each member alone.
    monkeypatch.setattr(operands_mod, "_FUSED_ON_CPU", True)
    model, x = packed(gpt().to(DEVICE), name), tokens().to(DEVICE)
    with torch.no_grad():
        want = model(x)[0]
        fused = copy.deepcopy(model)
        assert fuse_projections(fused) == 2 * fused.config.n_layers
        got = fused(x)[0]
    attn = fused.model.layers[0].self_attn
    group = attn.q_proj.fused_projection
    assert group.data is not None and group.intact()
    assert attn.v_proj.weight_data.data_ptr() == group.data[sum(group.sizes[:2])].data_ptr()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_static_channels_fuse_and_match_the_unfused_layers(monkeypatch):
    # Static QUADS: each member's calibrated channels as its own keep mask in one launch, one
    # GEMM for the group, as each member alone.
    monkeypatch.setattr(operands_mod, "_FUSED_ON_CPU", True)
    r = recipe("w4a4-rc")
    static = r.with_(compensation=ResidualCompensation(k=0.25, mode="static"))
    model, x = packed(gpt().to(DEVICE), static), tokens().to(DEVICE)
    calibrate(model, [x])
    attn = model.model.layers[0].self_attn
    assert not torch.equal(attn.q_proj.rc_channels, attn.k_proj.rc_channels)
    with torch.no_grad():
        want = model(x)[0]
        fused = copy.deepcopy(model)
        assert fuse_projections(fused) == 2 * fused.config.n_layers
        got = fused(x)[0]
        dynamic = packed(gpt().to(DEVICE), r)
        dynamic.load_state_dict(model.state_dict(), strict=False)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.equal(got, dynamic(x)[0])  # the calibrated channels, not this batch's


@pytest.mark.parametrize("precision", ["bf16", "nvfp4", "quads"])
def test_fast_engine_with_fused_projections_decodes_as_the_reference(precision, monkeypatch):
    monkeypatch.setattr(operands_mod, "_FUSED_ON_CPU", True)
    # One block: under the interpreter every decoding step runs each kernel program in numpy.
    base = gpt(moe=precision == "bf16", n_layers=1).to(DEVICE)
    prompts = [TOK.encode(p) for p in ("12+34=", "7+5=", "40+41+1=")]
    kw = dict(temperature=0.0, max_new_tokens=5, logprobs="sample")
    ref = RolloutEngine(base, TOK, precision, **kw)
    fast = FastRolloutEngine(base, TOK, precision, fuse_projections=True, **kw)
    assert fast.fused_groups == (1 if precision == "bf16" else 2) * base.config.n_layers
    a, b = ref.generate(prompts), fast.generate(prompts)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.mask, b.mask)
    torch.testing.assert_close(b.logprobs, a.logprobs, rtol=1e-5, atol=1e-5)
    trainer = gpt(3, moe=precision == "bf16", n_layers=1).to(DEVICE)
    ref.sync(trainer)
    fast.sync(trainer)  # the sync's self-check reads the members' (fused) buffers
    a, b = ref.generate(prompts), fast.generate(prompts)
    assert torch.equal(a.tokens, b.tokens)
