"""AdamW4's step as the custom op fp4stack::adamw4_step (optim/adamw4_op.py): opcheck (schema,
declared mutations, fake implementation), the bits of AdamW4's reference step on the
parameters and every state field over several steps (the first calibrates its delayed amaxes),
and torch.compile of a function calling it: one graph, eager's bits. On the CPU the op runs the
reference step; on CUDA its fused kernels, whose bits the gpu test compares with the reference.
"""

from __future__ import annotations

import pytest
import torch

from fp4stack.optim import AdamW4
from fp4stack.optim.adamw4_op import FIELDS, adamw4_step, adamw4_step_op

pytestmark = pytest.mark.usefixtures("one_thread")
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, headroom=4.0, seed=3)
SHAPES = [(32, 64), (16, 48), (48, 32)]


def grads(step: int, device: str = "cpu") -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(s, generator=g) * 1e-2).to(device) for s in SHAPES]


def reference_run(steps: int, device: str = "cpu"):
    """AdamW4's own reference step (fused=False) from the same start."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter((torch.randn(s) * 0.1).to(device)) for s in SHAPES]
    opt = AdamW4(params, lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]),
                 eps=HYPER["eps"], weight_decay=HYPER["weight_decay"], seed=HYPER["seed"],
                 min_numel=0, fused=False)
    for step in range(1, steps + 1):
        for p, g in zip(params, grads(step, device), strict=True):
            p.grad = g
        opt.step()
    return [p.detach() for p in params], [opt.state[p] for p in params]


def fresh(device: str = "cpu"):
    """Parameters and states as AdamW4 creates them, before any step."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter((torch.randn(s) * 0.1).to(device)) for s in SHAPES]
    opt = AdamW4(params, min_numel=0, seed=HYPER["seed"])
    return [p.detach() for p in params], opt._states(params, opt.param_groups[0])


def same_state(a: dict, b: dict) -> bool:
    return all(torch.equal(*(t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
                             for t in (a[n], b[n]))) for n in FIELDS)


def op_args(params, states, step: int, device: str = "cpu"):
    per_field = [[s[n].view(torch.uint8) if n.endswith("scales") else s[n] for s in states]
                 for n in FIELDS]
    return (params, grads(step, device), *per_field, [0, 1, 2], step, *HYPER.values())


def test_op_passes_opcheck():
    params, states = fresh()
    for step in (1, 2):  # the first step calibrates, the second uses the delayed amaxes
        torch.library.opcheck(adamw4_step_op, op_args(params, states, step))
        adamw4_step_op(*op_args(params, states, step))


def test_op_steps_are_the_reference_steps():
    params, states = fresh()
    for step in (1, 2, 3):
        adamw4_step(params, grads(step), states, [0, 1, 2], step, **HYPER)
        want_p, want_s = reference_run(step)
        assert all(torch.equal(a, b) for a, b in zip(params, want_p, strict=True))
        assert all(same_state(a, b) for a, b in zip(states, want_s, strict=True))


def test_compiled_op_gives_eager_bits():
    def run(compiled: bool):
        params, states = fresh()
        fn = lambda *args: adamw4_step_op(*args)  # noqa: E731
        if compiled:
            fn = torch.compile(fn, fullgraph=True, backend="aot_eager")
        for step in (1, 2):
            fn(*op_args(params, states, step))
        return params, states

    (pe, se), (pc, sc) = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(pe, pc, strict=True))
    assert all(same_state(a, b) for a, b in zip(se, sc, strict=True))
    params, states = fresh()
    explained = torch._dynamo.explain(lambda *a: adamw4_step_op(*a))(*op_args(params, states, 1))
    assert explained.graph_break_count == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_op_on_cuda_runs_the_fused_kernels_with_the_reference_bits():
    params, states = fresh("cuda")
    for step in (1, 2):
        adamw4_step(params, grads(step, "cuda"), states, [0, 1, 2], step, **HYPER)
    want_p, want_s = reference_run(2, "cuda")
    assert all(torch.equal(a, b) for a, b in zip(params, want_p, strict=True))
    assert all(same_state(a, b) for a, b in zip(states, want_s, strict=True))


def test_fields_are_the_kernels_table_columns():
    layout = pytest.importorskip("fp4stack.kernels.adamw4_layout")
    assert FIELDS == layout.FIELDS
