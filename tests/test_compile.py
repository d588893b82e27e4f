"""torch.compile over fp4stack's models on the CPU reference: no graph breaks, compiled = eager.

A user compiles the model and calls backward outside, so the forward must trace as one graph
(`torch._dynamo.explain` counts the breaks) and a compiled step must give eager's bits. Checked
for the GPT under every preset of the recipe registry (the low-rank recipes refit inside one
custom op, not on the host), the MoE GPT (its experts as custom ops over tokens sorted by
expert, static shapes) and a Hugging Face Llama converted with `quantize_model`. Compiled steps
use backend "aot_eager" (every recipe's ops, the stochastic-rounding seeds drawn in the graph)
and "inductor" for two recipes; the quantizer's custom ops are checked by torch.library.opcheck
in test_ops.py. The kernels' other custom ops (packed inference GEMM, grouped MoE experts, FP4
attention passes, AdamW4 step) have their opcheck and compile tests in test_kernel_ops.py and
test_adamw4_op.py: a GPT with packed inference weights and the FP4 attention kernels as one
graph, compiled steps with the attention kernels and compiled AdamW4 steps with eager's bits.
"""

from dataclasses import replace

import pytest
import torch

from fp4stack import recipe
from fp4stack.convert import quantize_model
from fp4stack.models import hf
from fp4stack.models.gpt import GPT, GPTConfig
from fp4stack.nn.linear import QuantLinear
from fp4stack.nn.recipe import preset_names

PRESETS = preset_names()


def gpt(name: str, moe: bool = False) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny_moe() if moe else GPTConfig.tiny())
    if name != "bf16":
        rec = recipe(name.removesuffix("-nolowrank"))
        quantize_model(model, rec.with_(lowrank=None) if name.endswith("-nolowrank") else rec)
    return model


def tokens() -> torch.Tensor:
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))


def llama(name: str):
    model = hf.tiny_dense().model
    quantize_model(model, recipe(name))
    return lambda x: model(input_ids=x, labels=x).loss, model


def assert_one_graph(loss_fn, x) -> None:
    explained = torch._dynamo.explain(loss_fn)(x)
    assert explained.graph_break_count == 0, [str(r.reason)[:200] for r in
                                              explained.break_reasons]


def test_the_registry_is_covered():
    assert {"bf16", "nvfp4-nvidia", "lowrank", "fullstack", "w4a4-rc"} <= set(PRESETS)


@pytest.mark.parametrize("name", PRESETS)
def test_gpt_trains_as_one_graph(name):
    model, x = gpt(name), tokens()
    assert model.training
    assert_one_graph(lambda x: model(x, x)[1], x)


# (The compiled-step tests below are fullgraph=True: they fail on any break too.)
@pytest.mark.parametrize("name", ["bf16", "fullstack"])
def test_moe_gpt_trains_as_one_graph(name):
    model, x = gpt(name, moe=True), tokens()
    assert_one_graph(lambda x: model(x, x)[1], x)


def test_padded_moe_gpt_trains_as_one_graph():
    # Left-padded rows, as the RL trainer scores them: the aux loss masks the pads rather than
    # selecting the real rows (a data-dependent shape).
    model, x = gpt("bf16", moe=True), tokens()
    mask = torch.ones_like(x, dtype=torch.bool)
    mask[0, :5] = False
    assert_one_graph(lambda x: model(x, attention_mask=mask)[0].float().square().mean()
                     + model.aux_loss, x)


def test_quantized_hf_llama_trains_as_one_graph():
    loss_fn, _ = llama("nvfp4")
    assert_one_graph(loss_fn, tokens())


def step_bits(make, backend: str | None, steps: int = 2):
    """Loss and gradients of `steps` training steps (an SGD update between them, so the second
    quantizes new weights and the low-rank refit counter moves on), eager or compiled."""
    loss_fn, model = make()
    run = loss_fn if backend is None else torch.compile(loss_fn, fullgraph=True, backend=backend)
    torch.manual_seed(7)  # the stochastic rounding seeds come from torch's generator
    out = []
    for _ in range(steps):
        loss = run(tokens())
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        out.append((loss.detach(), grads))
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= 0.1 * p.grad
                    p.grad = None
    return out


def assert_same_bits(a, b) -> None:
    for (loss_a, grads_a), (loss_b, grads_b) in zip(a, b, strict=True):
        assert torch.equal(loss_a, loss_b)
        assert len(grads_a) == len(grads_b) > 0
        assert all(torch.equal(g, h) for g, h in zip(grads_a, grads_b, strict=True))


def gpt_step(name: str, moe: bool = False):
    def make():
        model = gpt(name, moe)
        if name.startswith("lowrank"):
            for m in model.modules():  # refit at the second step, inside the compiled graph
                if getattr(m, "recipe", None) is not None and m.recipe.lowrank is not None:
                    m.recipe = m.recipe.with_(lowrank=replace(m.recipe.lowrank, refresh_every=2))
        return (lambda x: model(x, x)[1]), model
    return make


@pytest.mark.parametrize("name", ["nvfp4-nvidia", "lowrank-nvidia", "fp8"])
def test_compiled_gpt_step_gives_eager_bits(name):
    # NVIDIA's recipe: 16x16 weights, stochastic rounding of the gradients in the backward
    # (seeds drawn in the graph), Hadamard-transformed wgrad operands.
    make = gpt_step(name)
    assert_same_bits(step_bits(make, None), step_bits(make, "aot_eager"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a model on a GPU")
def test_compiled_lowrank_on_a_gpu_counts_on_the_host():
    # The refresh counter stays on the CPU beside a CUDA model, and the compiled step's op
    # reads and bumps it there: aot_eager gives eager's bits, Inductor refits at the same step.
    def make():
        loss_fn, model = gpt_step("lowrank-nvidia")()
        model.cuda()
        return (lambda x: loss_fn(x.cuda())), model

    assert_same_bits(step_bits(make, None), step_bits(make, "aot_eager"))
    _, model = make()
    layer = next(m for m in model.modules() if hasattr(m, "lowrank_forwards"))
    first = layer.lowrank_a.clone()
    loss_fn = torch.compile(lambda x: model(x.cuda(), x.cuda())[1], fullgraph=True)
    for n in (1, 2):
        loss_fn(tokens()).backward()
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= 0.1 * p.grad
                    p.grad = None
        assert layer.lowrank_forwards.device.type == "cpu" and int(layer.lowrank_forwards) == n
        assert torch.equal(layer.lowrank_a, first) == (n == 1)  # refitted at forward 2


@pytest.mark.parametrize("name", ["nvfp4", "nvfp4-nvidia"])
def test_compiled_moe_step_gives_eager_bits(name):
    make = gpt_step(name, moe=True)
    assert_same_bits(step_bits(make, None), step_bits(make, "aot_eager"))


def test_compiled_hf_llama_step_gives_eager_bits():
    make = lambda: llama("nvfp4-nvidia")  # noqa: E731
    assert_same_bits(step_bits(make, None), step_bits(make, "aot_eager"))


@pytest.mark.parametrize("in_place", [False, True], ids=["copied", "in-place"])
def test_compiled_quantizers_take_an_amax_the_graph_computes(in_place, monkeypatch):
    # Under compile, a plain NVFP4 operand's amax (per tensor, no Hadamard transform, no NaN
    # check) is torch ops before the quantizer op, which Inductor fuses into x's producer,
    # instead of the op's own amax launch. Same bits: the tests above and below. Where the
    # kernels read transposes in place, x and dy go with their column-wise copies as pairs;
    # otherwise each operand is its own op, the column-wise ones on copies made in the graph.
    pytest.importorskip("triton")
    from fp4stack.kernels import nvfp4

    monkeypatch.setattr(nvfp4, "TRANSPOSE_IN_KERNEL", in_place)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    layer = QuantLinear(64, 48, bias=False, recipe="nvfp4")
    torch.compile(layer, fullgraph=True, backend=backend)(torch.randn(32, 64))
    calls = [n for gm in graphs for sub in gm.modules() if isinstance(sub, torch.fx.GraphModule)
             for n in sub.graph.nodes if n.op == "call_function"]  # autograd.Function's too
    single = [n for n in calls if str(n.target).endswith("fake_quantize.default")]
    pairs = [n for n in calls if "fake_quantize_pair" in str(n.target)]
    if in_place:
        assert len(single) == 2  # W and its column-wise copy
        assert len(pairs) == 2  # x with the column-wise x, dy with the column-wise dy
    else:
        assert len(single) == 6 and not pairs  # x, W, dy and the column-wise copy of each
        copies = [n for gm in graphs for sub in gm.modules()
                  if isinstance(sub, torch.fx.GraphModule) for n in sub.graph.nodes
                  if n.op == "call_method" and n.target == "contiguous"]
        assert len(copies) >= 2, "the column-wise copies are made in the graph"
    assert all(n.args[2] is not None for n in single)  # (x, spec, amax, ...)
    assert all(n.args[3] is not None and n.args[4] is not None for n in pairs)  # both amaxes
    assert not any("global_amax" in str(n.target) for n in calls)
    torch._dynamo.reset()


@pytest.mark.parametrize("name", ["nvfp4", "nvfp4-nvidia"])
def test_inductor_linear_gives_eager_bits(name):
    # Inductor rewrites the float maths around the ops (norms, softmax, even a bias gradient's
    # sum: other reduction orders than eager's), so whole models are compared under aot_eager;
    # a bias-free linear, whose maths is the quantizer ops and the GEMMs, keeps eager's bits
    # under inductor too.
    def run(compiled: bool):
        torch.manual_seed(0)
        layer = QuantLinear(64, 48, bias=False, recipe=name)
        x = torch.randn(32, 64, requires_grad=True)
        dy = torch.randn(32, 48)
        fn = torch.compile(layer, fullgraph=True, backend="inductor") if compiled else layer
        torch.manual_seed(7)
        y = fn(x)
        y.backward(dy)
        return y.detach(), x.grad, layer.weight.grad
    eager, compiled = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled, strict=True))
