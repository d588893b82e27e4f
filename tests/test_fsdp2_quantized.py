"""FSDP2 quantizes what one process quantizes, bit for bit (gloo, two CPU processes).

FSDP2 shards every weight by rows and all-gathers it before its block's forward and backward,
so each FP4 quantizer sees the whole tensor: its global amax is the whole weight's, and the
values the forward multiplies by equal one process's. With every rank fed the same batch, the
logits equal one process's bit for bit, and so do the gradients FSDP2 reduce-scatters (the mean
of equal values is that value). The training runs of test_distributed.py compare losses only
(each rank trains other rows there, so fp32 sums differ in order); this checks the values.
"""

from __future__ import annotations

import contextlib
import copy
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fp4stack.convert import quantize_model
from fp4stack.models import GPT, GPTConfig
from fp4stack.nn.linear import QuantLinear
from fp4stack.train import distributed

RECIPES = ("nvfp4", "nvfp4-nvidia", "nvfp4-4over6", "lowrank-svd-4over6", "fullstack-paper",
           "qat-w")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().float().contiguous().view(torch.int32)


def _check(recipe: str, rank: int) -> None:
    torch.manual_seed(0)
    # four blocks: nvfp4-nvidia keeps the first and the last in BF16
    model = GPT(GPTConfig.tiny_moe(vocab_size=64, max_seq_len=32, moe_hidden=32,
                                   n_layers=4)).train()
    quantize_model(model, recipe)
    one = copy.deepcopy(model)  # this process alone, unsharded
    seen: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            module.register_forward_pre_hook(
                lambda m, args, name=name: seen.__setitem__(name, m.quantized_weight()))
    env = distributed.DistEnv(rank, 2, rank, torch.device("cpu"), owns_group=False)
    sharded = distributed.wrap(model, "fsdp2", env)
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


def _worker(rank: int, port: int, failures) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        torch.set_num_threads(1)
        for recipe in RECIPES:
            _check(recipe, rank)
    except BaseException as e:  # reported to the parent with its message
        failures.put(f"rank {rank}: {type(e).__name__}: {e}")
        raise
    finally:
        dist.destroy_process_group()


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
