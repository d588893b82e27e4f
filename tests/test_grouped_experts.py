"""The sorted MoE path (nn/grouped_experts.py: every expert's GEMMs in one op per projection)
against its reference, the per-expert loop: the same loss and gradient bits for round-to-nearest
recipes, including an expert without tokens, a calibrated static activation amax and autocast."""

import pytest
import torch

from fp4stack import recipe
from fp4stack.convert import calibrate, quantize_model
from fp4stack.models.gpt import GPT, GPTConfig
from fp4stack.nn import grouped_experts as ge
from fp4stack.nn.moe import Experts, MoEBlock


def tokens(seed=1):
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(seed))


def model_for(name: str, static: bool = False) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny_moe(n_experts=6))
    if name != "bf16":
        quantize_model(model, recipe(name).with_(activation_amax="static") if static
                       else recipe(name))
        if static:
            calibrate(model, [tokens(2)])
            assert model.model.layers[0].mlp.experts.x_amax is not None
    return model


def step(model: GPT, loop: bool, autocast: bool = False):
    if loop:  # the reference: every Experts module takes its per-expert loop
        for m in model.modules():
            if isinstance(m, Experts):
                m.sorted_operands = lambda: None
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        _, loss = model(tokens(), tokens())
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


@pytest.mark.parametrize("name", ["bf16", "nvfp4", "fp8", "qat-w"])
@pytest.mark.parametrize("autocast", [False, True])
def test_sorted_path_gives_the_loops_bits(name, autocast):
    (loss_a, grads_a), (loss_b, grads_b) = (step(model_for(name), loop, autocast)
                                            for loop in (True, False))
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b, strict=True))


def test_sorted_path_with_static_activation_amax():
    (loss_a, grads_a), (loss_b, grads_b) = (step(model_for("nvfp4", static=True), loop)
                                            for loop in (True, False))
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b, strict=True))


def test_an_expert_without_tokens():
    torch.manual_seed(0)
    model = model_for("nvfp4")
    experts = model.model.layers[0].mlp.experts
    x = torch.randn(10, experts.dim)
    weights = torch.rand(10, 2)
    indices = torch.stack([torch.arange(10) % 3, torch.arange(10) % 3 + 3], 1)  # 0..5 used
    indices[indices == 4] = 5  # expert 4 gets nothing
    out = experts(x, weights, indices)
    assert torch.equal(out, experts.loop_forward(x, weights, indices))


def test_eager_reads_each_blocks_counts_on_the_host_once(monkeypatch):
    # Forward and backward of both projections take the counts the block read once, so an
    # eager step makes one device sync per MoE block, not four.
    seen, real = [], ge._rows

    def spy(counts, host_counts):
        seen.append(host_counts is not None and host_counts == counts.tolist())
        return real(counts, host_counts)

    monkeypatch.setattr(ge, "_rows", spy)
    model = model_for("nvfp4")
    step(model, loop=False)
    blocks = sum(isinstance(m, MoEBlock) for m in model.modules())
    assert blocks > 0 and seen == [True] * (4 * blocks)
