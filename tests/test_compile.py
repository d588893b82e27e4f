"""torch.compile over fp4stack's GPT on the CPU reference: no graph breaks, compiled = eager.

A user compiles the model and calls backward outside, so the forward must trace as one graph
(`torch._dynamo.explain` counts the breaks) and a compiled step must give eager's bits. Not
yet covered: the low-rank recipes, whose refit counts training forwards on the host (a break
at every layer), and MoE training, whose per-expert loop reads expert counts on the host.
"""

import pytest
import torch

from fp4stack import recipe
from fp4stack.convert import quantize_model
from fp4stack.models.gpt import GPT, GPTConfig


def gpt(name: str) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny())
    if name != "bf16":
        rec = recipe(name.removesuffix("-nolowrank"))
        quantize_model(model, rec.with_(lowrank=None) if name.endswith("-nolowrank") else rec)
    return model


def tokens() -> torch.Tensor:
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name", ["bf16", "qat-w", "fp8", "fullstack-nolowrank"])
def test_forward_and_loss_trace_as_one_graph(name):
    model, x = gpt(name), tokens()
    explained = torch._dynamo.explain(lambda x: model(x, x)[1])(x)
    assert explained.graph_break_count == 0, [str(r.reason)[:200] for r in
                                              explained.break_reasons]


def test_compiled_step_gives_eager_bits():
    # NVIDIA's recipe (16x16 weights, stochastic rounding of the gradients in the backward,
    # Hadamard-transformed wgrad operands): its forward traces as one graph here too.
    x = tokens()
    results = []
    for compiled in (False, True):
        model = gpt("nvfp4-nvidia")
        step = torch.compile(model, fullgraph=True, backend="aot_eager") if compiled else model
        torch.manual_seed(7)  # the stochastic rounding seeds come from torch's generator
        _, loss = step(x, x)
        loss.backward()
        results.append((loss.detach(), [p.grad for p in model.parameters()]))
    (loss_e, grads_e), (loss_c, grads_c) = results
    assert torch.equal(loss_e, loss_c)
    assert all(torch.equal(a, b) for a, b in zip(grads_e, grads_c, strict=True))
