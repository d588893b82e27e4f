"""nn.operands.weight_operands_once: the weights' quantized operands made once per optimizer
step, not once per micro-batch, with the same bits (the trainer's forward_backward uses it)."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from fp4stack import recipe
from fp4stack.formats.spec import QuantSpec
from fp4stack.models.gpt import GPT, GPTConfig
from fp4stack.nn import operands
from fp4stack.nn.linear import QuantLinear
from fp4stack.nn.operands import weight_operands_once
from fp4stack.train import trainer

pytestmark = pytest.mark.usefixtures("one_thread")
SR_WEIGHTS = recipe("nvfp4").with_(name="sr-w", w=QuantSpec(rounding="stochastic"))


def model(name) -> GPT:
    torch.manual_seed(0)
    gpt = GPT(GPTConfig.tiny(vocab_size=64, n_layers=3))  # nvfp4-nvidia: one block quantized
    from fp4stack.convert import quantize_model

    quantize_model(gpt, recipe(name) if isinstance(name, str) else name)
    return gpt


def batch():
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 64, (8, 17), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def step(name, cached: bool, monkeypatch):
    """Loss and gradients of one 4-micro-batch step, and how many weight quantizations ran
    (rounded to nearest, stochastically)."""
    if not cached:
        monkeypatch.setattr(trainer, "weight_operands_once", nullcontext)
    calls = []
    real = operands.quantize_operand

    def counted(t, spec, *a, **k):
        if isinstance(t, torch.nn.Parameter) and spec is not None:
            calls.append(spec.rounding)
        return real(t, spec, *a, **k)

    monkeypatch.setattr(operands, "quantize_operand", counted)
    gpt, (x, y) = model(name), batch()
    torch.manual_seed(5)  # the stochastic roundings' draws
    loss = trainer.forward_backward(gpt, x, y, 2, False, nullcontext())
    monkeypatch.undo()
    return [loss] + [p.grad for p in gpt.parameters()], (calls.count("rne"),
                                                           calls.count("stochastic"))


@pytest.mark.parametrize("name", ["nvfp4", "nvfp4-nvidia", "fp8", SR_WEIGHTS],
                         ids=["nvfp4", "nvfp4-nvidia", "fp8", "sr-weights"])
def test_a_step_gives_the_same_bits_with_fewer_weight_quantizations(name, monkeypatch):
    (eager, n_eager), (cached, n_cached) = (step(name, c, monkeypatch) for c in (False, True))
    assert all(torch.equal(a, b) for a, b in zip(eager, cached, strict=True))
    # 4 micro-batches: each round-to-nearest weight operand once instead of four times; the
    # stochastic ones are drawn afresh for every micro-batch.
    assert n_cached[0] > 0 and n_eager[0] == 4 * n_cached[0]
    assert n_eager[1] == n_cached[1] and (n_cached[1] > 0) == (name is SR_WEIGHTS)


def test_an_in_place_change_quantizes_again_and_exit_drops_the_cache():
    layer = QuantLinear(32, 16, bias=False, recipe="nvfp4")
    x = torch.randn(4, 32)
    with torch.no_grad(), weight_operands_once():
        a = layer(x)  # Q(W) and the backward's column-wise Q(W)
        assert len(operands._STEP_WEIGHTS) == 2 and torch.equal(layer(x), a)
        assert len(operands._STEP_WEIGHTS) == 2
        layer.weight.mul_(2)  # the version counter moves: new operands
        b = layer(x)
        assert len(operands._STEP_WEIGHTS) == 4
        with weight_operands_once():  # nested: the same cache
            assert torch.equal(layer(x), b)
        assert operands._STEP_WEIGHTS is not None
    assert operands._STEP_WEIGHTS is None
    with torch.no_grad():
        assert torch.equal(layer(x), b)
    torch.testing.assert_close(b, 2 * a, rtol=0, atol=0)  # scaling by 2 is exact in NVFP4


P = dict(nan_policy="propagate")


@pytest.mark.parametrize(("specs", "shares"), [
    ((QuantSpec(**P), QuantSpec(**P)), True),
    ((QuantSpec(**P), QuantSpec(rounding="stochastic", four_over_six=True, **P)), True),
    ((QuantSpec(**P), QuantSpec(hadamard=True, **P)), False),  # amax of the transformed tensor
    ((QuantSpec(**P), QuantSpec(global_scale="row", **P)), False),  # one amax a row
    ((QuantSpec(**P), QuantSpec()), False),  # a NaN check must see the tensor itself
    ((QuantSpec(**P), QuantSpec.fp8()), False),
    ((QuantSpec(**P), None), False),
])
def test_one_amax_serves_an_operand_and_its_columnwise_copy(specs, shares):
    # The row-wise and column-wise quantizations of x share max |x| when both specs compute it
    # plainly; the operands are then bit-identical to quantizing each with its own amax.
    x = torch.randn(40, 64)
    x[3, 5] = -30.0
    amax = operands.common_amax(x, *specs)
    assert (amax is not None) == shares
    if shares:
        assert torch.equal(amax, x.abs().amax())
        for columnwise, spec in zip((False, True), specs, strict=True):
            torch.manual_seed(1)
            own = operands.quantize_operand(x, spec, columnwise=columnwise, seed=3)
            given = operands.quantize_operand(x, spec, amax, columnwise=columnwise, seed=3)
            assert torch.equal(own, given)


def _rl_update(trainer_recipe: str, cached: bool, monkeypatch):
    """Gradients of one 2-micro-batch GRPO update of a grouped-experts MoE, and how many
    expert stacks the grouped ops quantized."""
    from fp4stack.convert import quantize_model
    from fp4stack.nn import grouped_experts
    from fp4stack.rl import update
    from fp4stack.rl.config import RLConfig
    from fp4stack.rl.rollout import Rollout

    if not cached:
        monkeypatch.setattr(update, "weight_operands_once", nullcontext)
    made = []
    real = grouped_experts.fake_quantize_stack

    def counted(t, spec, **k):
        made.append(t.shape)
        return real(t, spec, **k)

    monkeypatch.setattr(grouped_experts, "fake_quantize_stack", counted)
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, ffn_hidden=32, moe=True,
                        n_experts=4, top_k=2, moe_hidden=32, max_seq_len=32)).train()
    if trainer_recipe != "bf16":
        quantize_model(gpt, trainer_recipe)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 64, (8, 12), generator=g)
    mask = torch.ones_like(tokens, dtype=torch.bool)
    resp = mask.clone()
    resp[:, :4] = False
    rollout = Rollout(tokens, mask, resp, -torch.rand(tokens.shape, generator=g) * resp, 4)
    opt = torch.optim.SGD(gpt.parameters(), lr=0.0)  # the gradients are what is compared
    cfg = RLConfig(micro_batch_size=4, trainer=trainer_recipe, trainer_dtype="bfloat16")
    update.train_step(gpt, opt, rollout, torch.randn(8, generator=g), cfg, None,
                      log=lambda *a: None)
    monkeypatch.undo()
    return [p.grad for p in gpt.parameters()], len(made)


def test_grouped_experts_quantize_their_stack_once_an_update_with_the_same_bits(monkeypatch):
    (eager, n_eager), (cached, n_cached) = (_rl_update("qat-w", c, monkeypatch)
                                            for c in (False, True))
    assert all(torch.equal(a, b) for a, b in zip(eager, cached, strict=True))
    # 2 blocks x 2 projections (4 experts a stack): quantized once an update instead of in the
    # forward and the backward of each of the 2 micro-batches
    assert n_cached == 2 * 2 and n_eager == 4 * n_cached
