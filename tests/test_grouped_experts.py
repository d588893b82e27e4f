"""The sorted MoE path (nn/grouped_experts.py: every expert's GEMMs in one op per projection)
against its reference, the per-expert loop: the same loss and gradient bits for round-to-nearest
recipes, including an expert without tokens, a calibrated static activation amax and autocast."""

import copy
from dataclasses import replace

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


def step(model: GPT, loop: bool, autocast: bool = False, device: str = "cpu"):
    model.to(device)
    if loop:  # the reference: every Experts module takes its per-expert loop
        for m in model.modules():
            if isinstance(m, Experts):
                m.sorted_operands = lambda: None
    with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
        _, loss = model(tokens().to(device), tokens().to(device))
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


@pytest.mark.parametrize("name", ["bf16", "qat-w"])
def test_plain_and_weight_only_experts_take_one_grouped_gemm_and_no_host_read(monkeypatch, name):
    # Plain experts (the bf16 trainer's) and weight-only ones (qat-w's: Q(W) for W) run each
    # projection as one torch._grouped_mm, forward and backward, with no host read of the
    # counts; their bits are the loop's on the CPU (test_sorted_path_gives_the_loops_bits).
    calls, real = [], torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(ge, "_rows", lambda *a: pytest.fail("the per-expert loop ran"))
    model = model_for(name)
    step(model, loop=False)
    blocks = sum(isinstance(m, MoEBlock) for m in model.modules())
    assert blocks > 0 and len(calls) == 6 * blocks  # 2 projections x (forward, dx, dw)


@pytest.mark.parametrize("name,weight_only", [
    ("qat-w", True), ("nvfp4", False), ("fp8", False), ("w4a4@weights", False)])
def test_which_recipes_are_weight_only(name, weight_only):
    # w4a4@weights keeps the weights packed (an inference recipe), and its dgrad operand is
    # its own: only qat-w's GEMMs are the plain ones with Q(W).
    assert ge.weight_only(ge.recipe_key(recipe(name))) is weight_only
    assert not ge.weight_only("plain")
    sr = recipe("qat-w").with_(w=replace(recipe("qat-w").w, rounding="stochastic"))
    assert not ge.weight_only(ge.recipe_key(sr))  # its draws are not the loop's


@pytest.mark.parametrize("shape,dtype,runs", [
    ((4, 64, 32), torch.float32, True), ((4, 64, 32), torch.bfloat16, True),
    ((4, 64, 30), torch.float32, False),  # rows of 120 bytes: not 16-byte aligned
    ((4, 60, 32), torch.bfloat16, False), ((4, 64, 32), torch.float64, False)])
def test_grouped_mm_runs_only_where_torch_has_it(shape, dtype, runs):
    assert ge.grouped_mm_runs(torch.empty(shape), dtype) is runs


def test_unaligned_plain_experts_take_each_experts_gemm(monkeypatch):
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny_moe(n_experts=6, moe_hidden=30))  # down's rows: 120 bytes
    experts = model.model.layers[0].mlp.experts
    assert ge.grouped_mm_runs(experts.gate_up_proj, torch.float32)
    assert not ge.grouped_mm_runs(experts.down_proj, torch.float32)
    reference = copy.deepcopy(model)
    seen, real = [], ge._rows
    monkeypatch.setattr(ge, "_rows", lambda *a: seen.append(1) or real(*a))
    loss, grads = step(model, loop=False)
    assert len(seen) == 2 * len(model.model.layers)  # down's forward and backward
    loss_ref, grads_ref = step(reference, loop=True)
    assert torch.equal(loss, loss_ref)  # gradients: up to the order of the input-grad sums
    for a, b in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["bf16", "qat-w"])
def test_plain_experts_on_cuda_close_to_the_loop(name):
    # On sm90 in bfloat16 torch._grouped_mm's kernel is not cuBLAS's: close, not the same bits.
    (loss_a, grads_a), (loss_b, grads_b) = (step(model_for(name), loop, True, "cuda")
                                            for loop in (True, False))
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-2, atol=0)
    for a, b in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(b, a, rtol=5e-2, atol=5e-2 * a.abs().max().item())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_plain_grouped_gemm_takes_operands_at_an_offset(device):
    # CUDA's kernel refuses data that starts off a 16-byte boundary: such views are copied.
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    counts = torch.tensor([3, 0, 5], device=device)
    x = torch.randn(8 * 32 + 1, device=device, dtype=dtype)[1:].view(8, 32)
    w = torch.randn(3, 16, 32, device=device, dtype=dtype)
    dy = torch.randn(8 * 16 + 1, device=device, dtype=dtype)[1:].view(8, 16)
    assert ge.grouped_mm_runs(w, dtype) and x.data_ptr() % 16
    y = ge.grouped_linear(x, w, counts, None, None, "plain", dtype)
    dx, dw = ge.grouped_linear_backward(dy, x, w, counts, None, None, "plain", dtype)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(y, torch.cat([x[:3] @ w[0].t(), x[3:] @ w[2].t()]), **tol)
    torch.testing.assert_close(dx, torch.cat([dy[:3] @ w[0], dy[3:] @ w[2]]), **tol)
    assert dw[1].abs().max() == 0
    torch.testing.assert_close(dw[2], dy[3:].t() @ x[3:], **tol)
