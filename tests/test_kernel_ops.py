"""The kernels' custom ops beyond the quantizer's: the packed inference GEMM and the grouped MoE
experts (nn/inference_ops.py), the FP4 attention passes (nn/attention_ops.py).

Each op passes torch.library.opcheck (schema, fake implementation, dispatch under
torch.compile's tracing), on its torch reference and, under the Triton interpreter (CPU) or on
CUDA, on its kernels; the references equal the paths they stand for (QuantLinear's dequantize
and matmul, Experts' per-expert loop) bit for bit and the kernels equal them where their sums
run in the same order. Then torch.compile: a GPT with packed inference weights and the FP4
attention kernels traces as one graph (torch._dynamo.explain), and a compiled training step with
the attention kernels gives eager's bits.
"""

from __future__ import annotations

import pytest
import torch

from fp4stack import fake_quantize, ops, recipe
from fp4stack.convert import quantize_model
from fp4stack.models.gpt import GPT, GPTConfig
from fp4stack.nn import inference_ops
from fp4stack.nn import operands as operands_mod
from fp4stack.nn.attention import AttentionQuant, use_fp4_attention
from fp4stack.nn.attention_quant import NVFP4_SR
from fp4stack.nn.linear import QuantLinear
from fp4stack.nn.moe import Experts
from fp4stack.nn.quant_experts import QuantExperts

pytest.importorskip("triton")
from fp4stack.nn import attention_ops  # noqa: E402

# The interpreter runs on numpy, which warns where a padding block's zero scale divides.
pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")]
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def randn(*shape: int, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    return t.to(DEVICE, dtype)


@pytest.fixture(params=[False, True], ids=["reference", "kernels"])
def kernels(request, monkeypatch):
    """The ops' two paths: the kernels (CUDA, or the interpreter on the CPU) or the reference."""
    if request.param:
        monkeypatch.setattr(operands_mod, "_FUSED_ON_CPU", True)
    elif CUDA:
        monkeypatch.setenv("FP4STACK_BACKEND", "reference")
    return request.param


def packed_layer(dtype=torch.float32, bias=True) -> QuantLinear:
    torch.manual_seed(0)
    layer = QuantLinear(80, 48, bias=bias, recipe="w4a4").to(DEVICE)  # K not a multiple of 16
    layer.pack()
    return layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_op_is_the_layers_reference_gemm(kernels, dtype):
    layer = packed_layer()
    w, x = layer.packed_weight, randn(7, 80, seed=1, dtype=dtype)
    a = fake_quantize(x, spec=layer.recipe.x)  # the layer's activation operand
    args = (a, w.data, w.scales.view(torch.uint8), w.amax, 80, ops.spec_key(w.spec),
            layer.bias.detach(), [])
    torch.library.opcheck(inference_ops.packed_linear_op, args)
    # Two siblings' rows (32 + 16), an operand each (fused QUADS projections).
    pair = (torch.stack([a, a.flip(0)]), *args[1:-1], [32, 16])
    torch.library.opcheck(inference_ops.packed_linear_op, pair)
    y2 = inference_ops.packed_linear_op(*pair)
    y1 = inference_ops.packed_linear_op(a.flip(0), *args[1:])
    if dtype == torch.bfloat16 or CUDA:
        assert torch.equal(y2[:, 32:], y1[:, 32:])
    else:  # the interpreter's fp32 dot is numpy's sgemm, whose sums depend on the tile's shape
        torch.testing.assert_close(y2[:, 32:], y1[:, 32:], rtol=1e-6, atol=1e-6)
    got = inference_ops.packed_linear_op(*args)
    with torch.no_grad():  # what a packed layer computes off the fused path
        want = layer._reference_forward(x)
    assert got.dtype == dtype and got.shape == (7, 48)
    if dtype == torch.bfloat16 or not kernels:
        assert torch.equal(got, want)
    else:  # the kernel's fp32 sums run in another order than the CPU's matmul
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def experts(kind: str, dtype):
    torch.manual_seed(0)
    plain = Experts(32, 16, 6).to(DEVICE, dtype)
    return plain if kind == "bf16" else QuantExperts.from_experts(plain, recipe(kind))


@pytest.mark.parametrize("kind", ["bf16", "w4a4", "w8a8", "w4a4-rc"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mlp_op_is_the_per_expert_loop(kernels, kind, dtype):
    if kind == "w4a4-rc" and dtype == torch.bfloat16:
        pytest.skip("the loop's second GEMM rounds apart in bf16 (test_moe_grouped covers it)")
    mod = experts(kind, dtype)
    g = torch.Generator().manual_seed(1)
    weights, indices = torch.randn(9, 6, generator=g).softmax(-1).topk(2, dim=-1)
    weights, indices = weights.to(DEVICE), indices.to(DEVICE)
    x = randn(9, 32, seed=2, dtype=dtype)
    gate_up, down, x_spec, comp = mod.grouped_operands(dtype)
    with torch.no_grad():
        got = inference_ops.grouped_mlp(x, weights, indices, gate_up, down, x_spec, dtype, comp)
        want = mod.loop_forward(x, weights, indices)
    assert got.dtype == torch.float32
    if comp is not None:  # the loop adds the correction as its own GEMM: rounding apart
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    elif dtype == torch.bfloat16 or not kernels:
        assert torch.equal(got.to(dtype), want)
    else:
        torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)
    # Inference only (no autograd formula): plain weights enter without their gradient.
    parts = [gate_up.detach()] if isinstance(gate_up, torch.Tensor) else \
        [gate_up.data, gate_up.scales.view(torch.uint8), gate_up.amax]
    dn = [down.detach()] if isinstance(down, torch.Tensor) else \
        [down.data, down.scales.view(torch.uint8), down.amax]
    w_spec = "" if isinstance(gate_up, torch.Tensor) else ops.spec_key(gate_up.spec)
    xs = "" if x_spec is None else ops.spec_key(x_spec)
    counts, norms = ([], []) if comp is None else map(list, zip(*comp, strict=True))
    torch.library.opcheck(inference_ops.grouped_mlp_op,
                          (x, weights, indices, parts, dn, [32, 16], w_spec, xs, dtype, counts,
                           norms))


def qkv(seed: int = 0, heads: tuple[int, int] = (4, 2), s: int = 24):
    return (randn(2, heads[0], s, 16, seed=seed), randn(2, heads[1], s, 16, seed=seed + 1),
            randn(2, heads[1], s, 16, seed=seed + 2))


def test_attention_ops_pass_opcheck():
    q, k, v = qkv(heads=(2, 1))  # two query heads a K/V head: grouped, at half the interpreted work
    seeds = [torch.tensor(11), torch.tensor(12), None]  # Q, K stochastic, V to nearest
    fwd_args = (q, k, v, True, 0.25, False, *seeds)
    torch.library.opcheck(attention_ops.attention_forward, fwd_args)
    out, lse, amax, qu, ku, vu = attention_ops.attention_forward(*fwd_args)
    bwd_seeds = (torch.tensor(13), None, torch.tensor(14))
    op_args = (q, k, v, amax, *seeds[:2], *bwd_seeds)
    torch.library.opcheck(attention_ops.attention_backward_operands, op_args)
    operands = attention_ops.attention_backward_operands(*op_args)
    do = randn(*q.shape, seed=9)
    for units, alt in (((qu, ku, vu), (None, None)), (operands[:3], operands[3:])):
        for quant_ds in (True, False):
            torch.library.opcheck(attention_ops.attention_backward,
                                  (do, *units, out, lse, amax, True, 0.25, quant_ds, False, *alt))
    # V unquantized (the paper's form): its units are a copy of v, never v itself
    raw = (q, k, v, True, 0.25, False, *seeds, False)
    torch.library.opcheck(attention_ops.attention_forward, raw)
    amax = attention_ops.attention_forward(*raw)[2]
    torch.library.opcheck(attention_ops.attention_backward_operands,
                          (q, k, v, amax, *seeds[:2], *bwd_seeds, False))


def test_attention_forward_op_is_the_kernels_forward():
    from fp4stack.kernels.attention import fp4_attention_forward

    q, k, v = qkv(seed=3)
    out, lse, *_ = attention_ops.attention_forward(q, k, v, True, 0.25, False, None, None, None)
    want_out, want_lse = fp4_attention_forward(q, k, v, True, 0.25)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


def tokens() -> torch.Tensor:
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1)).to(DEVICE)


def gpt(name: str, attention: AttentionQuant) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny()).to(DEVICE)
    quantize_model(model, recipe(name))
    return use_fp4_attention(model, attention, backend="triton")


def test_packed_gpt_with_fp4_attention_infers_as_one_graph(kernels):
    model = gpt("w4a4", AttentionQuant.paper()).eval()
    fn = lambda x: model(x)[0]  # noqa: E731
    with torch.no_grad():
        explained = torch._dynamo.explain(fn)(tokens())
        assert explained.graph_break_count == 0, [str(r.reason)[:200]
                                                  for r in explained.break_reasons]
        names = {str(op) for graph in explained.ops_per_graph for op in graph}
        assert "fp4stack.attention_forward.default" in names
        assert ("fp4stack.packed_linear.default" in names) == kernels
        compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
        assert torch.equal(compiled(tokens()), fn(tokens()))


def test_compiled_step_with_attention_kernels_gives_eager_bits():
    # Stochastic Q, K, V without reuse: the forward's seeds and the backward's fresh ones are
    # drawn in the graph, in the reference's order.
    cfg = AttentionQuant(q=NVFP4_SR, k=NVFP4_SR, v=NVFP4_SR, reuse=False)

    def run(compiled: bool):
        model = gpt("nvfp4", cfg)
        fn = lambda x: model(x, x)[1]  # noqa: E731
        if compiled:
            fn = torch.compile(fn, fullgraph=True, backend="aot_eager")
        torch.manual_seed(7)
        loss = fn(tokens())
        loss.backward()
        return [loss.detach()] + [p.grad for p in model.parameters() if p.grad is not None]

    eager, compiled = run(False), run(True)
    assert len(eager) > 1 and all(torch.equal(a, b) for a, b in zip(eager, compiled, strict=True))
    model = gpt("nvfp4", cfg)
    explained = torch._dynamo.explain(lambda x: model(x, x)[1])(tokens())
    assert explained.graph_break_count == 0
