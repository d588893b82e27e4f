"""FSDP2 quantizes what one process quantizes, bit for bit (gloo, two CPU processes).

FSDP2 shards every weight by rows and all-gathers it before its block's forward and backward,
so each FP4 quantizer sees the whole tensor: its global amax is the whole weight's, and the
values the forward multiplies by equal one process's. With every rank fed the same batch, the
logits equal one process's bit for bit, and so do the gradients FSDP2 reduce-scatters (the mean
of equal values is that value). The training runs of test_distributed.py compare losses only
(each rank trains other rows there, so fp32 sums differ in order); this checks the values.

With fsdp_gather="nvfp4" each rank quantizes its own rows and FSDP2 all-gathers the NVFP4 bytes
(train/fsdp_nvfp4.py): the same checks hold, bit for bit, and after an AdamW step too.
"""

from __future__ import annotations

import contextlib
import copy
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fp4stack.convert import quantize_model
from fp4stack.models import GPT, GPTConfig
from fp4stack.nn.linear import QuantLinear
from fp4stack.train import distributed, fsdp_nvfp4

RECIPES = ("nvfp4", "nvfp4-nvidia", "nvfp4-4over6", "lowrank-svd-4over6", "fullstack-paper",
           "qat-w", "lowrank-r1")
# lowrank's branch refitted at every training forward: from W, which the NVFP4 all-gather does
# not deliver, so its layers gather W's rows for the refit
FORMS = {"lowrank-r1": {"preset": "lowrank", "name": "lowrank-r1", "lowrank": {"refresh_every": 1}}}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().float().contiguous().view(torch.int32)


# Layers each recipe gathers in NVFP4 on two ranks (the first and last blocks of nvfp4-nvidia
# are BF16; low-rank recipes read W itself and keep fp32).
GATHERED = {"nvfp4": 16, "nvfp4-nvidia": 8, "nvfp4-4over6": 16, "lowrank-svd-4over6": 0,
            "fullstack-paper": 0, "qat-w": 16, "lowrank-r1": 16}


def _check(recipe: str, rank: int, gather: str = "fp32") -> None:
    torch.manual_seed(0)
    # four blocks: nvfp4-nvidia keeps the first and the last in BF16
    model = GPT(GPTConfig.tiny_moe(vocab_size=64, max_seq_len=32, moe_hidden=32,
                                   n_layers=4)).train()
    quantize_model(model, FORMS.get(recipe, recipe))
    one = copy.deepcopy(model)  # this process alone, unsharded
    seen: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            module.register_forward_pre_hook(
                lambda m, args, name=name: seen.__setitem__(name, m.quantized_weight()))
    env = distributed.DistEnv(rank, 2, rank, torch.device("cpu"), owns_group=False)
    sharded = distributed.wrap(model, "fsdp2", env, gather=gather)
    if gather == "nvfp4":
        plans = [m.nvfp4_gather for m in sharded.modules()
                 if getattr(m, "nvfp4_gather", None) is not None]
        assert len(plans) == GATHERED[recipe], f"{recipe}: {len(plans)} layers gathered"
    tokens = torch.randint(0, 64, (4, 25), generator=torch.Generator().manual_seed(1))

    def step(m):
        # Stochastic rounding draws its seeds from torch's generator: the same stream for both,
        # as the trainer seeds each micro-batch by (seed, step, micro-batch) on every rank.
        torch.manual_seed(2)
        logits, loss = m(tokens[:, :-1], tokens[:, 1:])  # with the MoE's load-balance loss
        loss.backward()
        return logits, loss

    (logits, loss), (want, want_loss) = step(sharded), step(one)
    assert torch.equal(_bits(logits), _bits(want)), f"{recipe}: logits differ"
    assert seen, f"{recipe}: no quantized linear ran"
    for name, q in seen.items():
        assert torch.equal(_bits(q), _bits(one.get_submodule(name).quantized_weight())), \
            f"{recipe}: {name}'s quantized weight differs"
    assert torch.equal(_bits(loss), _bits(want_loss)), f"{recipe}: losses differ"
    for (name, p), (_, p1) in zip(sharded.named_parameters(), one.named_parameters(),
                                  strict=True):
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        assert torch.equal(_bits(grad), _bits(p1.grad)), f"{recipe}: {name}'s gradient differs"
    if gather == "fp32":
        return
    # An AdamW step on both, then a forward of the new weights: new amaxes, the same bits.
    for m in (sharded, one):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        opt.step()
        opt.zero_grad()
    (logits, _), (want, _) = step(sharded), step(one)
    assert torch.equal(_bits(logits), _bits(want)), f"{recipe}: logits differ after a step"
    for (name, p), (_, p1) in zip(sharded.named_parameters(), one.named_parameters(),
                                  strict=True):
        assert torch.equal(_bits(p.full_tensor()), _bits(p1)), f"{recipe}: {name} differs"
    sent, gathers = fsdp_nvfp4.gathered_bytes(sharded)
    # Two forwards and two backwards: four gathers a layer, each of a rank's NVFP4 bytes:
    # codes and scales of Q(W) (0.5625 bytes an element), and of the column-wise copy for
    # nvfp4's and 4/6's dgrad.
    assert gathers == 4 * len(plans)
    per_element = 1.125 if model_has_dgrad(recipe) else 0.5625
    elements = sum(m.weight.numel() for m in one.modules() if isinstance(m, QuantLinear)
                   and m.recipe.w is not None and m.recipe.w.format == "nvfp4"
                   and not (m.recipe.lowrank and m.recipe.lowrank.fit == "weight"))
    assert sent == 4 * per_element * elements / 2, (recipe, sent, elements)


def model_has_dgrad(recipe: str) -> bool:
    from fp4stack.nn.recipe import recipe as get_recipe

    return get_recipe(FORMS.get(recipe, recipe)).w_dgrad is not None


def _check_nonfinite(rank: int) -> None:
    """A NaN in one rank's rows of a weight: every rank raises the same ValueError, before any
    rank starts an all-gather the other would not join."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny_moe(vocab_size=64, max_seq_len=32, moe_hidden=32, n_layers=2))
    quantize_model(model, "nvfp4")
    sharded = distributed.wrap(model, "fsdp2", distributed.DistEnv(
        rank, 2, rank, torch.device("cpu"), owns_group=False), gather="nvfp4")
    if rank == 1:
        with torch.no_grad():
            fsdp_nvfp4.unwrap(sharded.model.layers[1].self_attn.o_proj.weight.to_local())[0, 3] = \
                float("nan")
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    try:
        sharded(tokens)
    except ValueError as e:
        assert "model.layers.1.self_attn.o_proj" in str(e), e
    else:
        raise AssertionError("no error for a NaN weight")


def _worker(rank: int, port: int, failures) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        torch.set_num_threads(1)
        for recipe in RECIPES:
            _check(recipe, rank)
            _check(recipe, rank, gather="nvfp4")
        _check_nonfinite(rank)
    except BaseException as e:  # reported to the parent with its message
        failures.put(f"rank {rank}: {type(e).__name__}: {e}")
        raise
    finally:
        dist.destroy_process_group()
    # As `fp4stack.cli.program` does for a torchrun rank: FSDP2 keeps gloo's threads alive past
    # destroy_process_group, and one can abort the interpreter's finalization.
    os._exit(0)


def test_fsdp2_quantizes_the_whole_weight_as_one_process_does():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    failures = mp.get_context("spawn").SimpleQueue()
    with contextlib.suppress(mp.ProcessRaisedException):
        mp.start_processes(_worker, args=(port, failures), nprocs=2, start_method="spawn")
    errors = []
    while not failures.empty():
        errors.append(failures.get())
    assert not errors, errors
