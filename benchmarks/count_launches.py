"""Kernel launches of one optimizer step, one decoding step of the fast rollout engine, one
GRPO update of the RL trainer or one refit of the engine, counted on the CPU: the work a
launch-bound step does.

A GPU step of Muon4 is bound by its launches (docs/PERFORMANCE.md): thousands of small kernels,
and so is a decoding step of a small MoE policy at a GRPO batch. This counts them without a
GPU. The step runs on CPU tensors with the Triton kernels under the interpreter
(TRITON_INTERPRET=1, set here) standing in for the GPU's, and counts each Triton launch and
each torch op that computes (views and other metadata-only ops excluded), which on a GPU is one
kernel each. A count, not a time: the GPU's fusions (cuBLAS epilogues, Inductor)
are not modelled.

    python benchmarks/count_launches.py [--dim 64] [--blocks 7] [--out counts.json]
    python benchmarks/count_launches.py --decode [--precisions bf16,nvfp4,quads,quads:static]
    python benchmarks/count_launches.py --update [--trainers bf16,qat-w]
    python benchmarks/count_launches.py --refit [--precisions bf16,nvfp4,quads]

The default: the matrices of 7 GPT blocks (49, as bench_optim.py's 100M-parameter set at dim
1024), at dim 64 so the interpreter takes seconds; the count does not depend on the dim.
--decode: one decoding step (`FastRolloutEngine._decode`, eager: a CUDA graph replays the same
launches) of an MoE GPT with the upcycled SmolLM2's block (grouped-query attention, 8 experts
top-2, tied embeddings) at dim 64, per block (a 2-block model's count less a 1-block one's)
and outside the blocks. As on CUDA, RoPE takes its kernel and an RMSNorm counts as one launch
(torch's fused CUDA kernel; on the CPU it decomposes). Ops inside a Triton launch (the
interpreter's copies of its arguments) are not counted; a custom op counts as the ops it runs.
--update: one micro-batch of `rl.update.train_step` (8 rows of 24 tokens) on the same model,
per block and outside the blocks; RMSNorm's backward counts as the CPU's decomposition.
--refit: one `RolloutEngine.sync` of a fast engine in each precision from the same model (the
trainer's weights quantized, loaded and checked tensor by tensor), per block and outside.
"""

from __future__ import annotations

import argparse
import json
import os
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

os.environ["TRITON_INTERPRET"] = "1"  # before fp4stack.kernels defines its kernels

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

# Ops that only make a view or read metadata: no kernel on a GPU.
_VIEWS = {"view", "_unsafe_view", "t", "transpose", "expand", "as_strided", "select", "slice",
          "unsqueeze", "squeeze", "permute", "alias", "detach", "split", "split_with_sizes",
          "unbind", "diagonal", "lift_fresh", "empty", "empty_strided", "empty_like", "size",
          "stride", "numel", "is_same_size", "_reshape_alias", "view_as_real", "view_as_complex",
          "unflatten", "chunk", "narrow", "movedim", "reshape", "_local_scalar_dense",
          "resolve_conj", "resolve_neg", "set_", "new_empty", "new_empty_strided",
          "to", "matmul"}  # composites, counted as the ops they run (inside a custom op)


class OpCounter(TorchDispatchMode):
    """Counts the torch ops that compute, by name (not while `paused`)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace not in ("aten", "prims"):  # a custom op: count the kernels it runs
            from torch._library.custom_ops import OPDEFS

            op = OPDEFS.get(func._schema.name)
            if op is not None:
                with self:
                    return op._init_fn(*args, **(kwargs or {}))
        name = func._schema.name.split("::")[-1]
        if name not in _VIEWS and not self.paused:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def count_step(make_optimizer, params: list[torch.nn.Parameter]) -> dict:
    """Ops and Triton launches of the second step (the first also builds states)."""
    from triton.runtime.interpreter import InterpretedFunction

    from fp4stack import ops

    launches: Counter[str] = Counter()
    run = InterpretedFunction.run

    def counted(self, *args, **kwargs):
        launches[self.fn.__name__] += 1
        return run(self, *args, **kwargs)

    backend = ops.backend_for
    ops.backend_for = lambda device: "triton"  # the kernels for CPU tensors too
    InterpretedFunction.run = counted
    try:
        opt = make_optimizer(params)
        opt.step()
        launches.clear()
        with OpCounter() as counter:
            opt.step()
    finally:
        InterpretedFunction.run = run
        ops.backend_for = backend
    return {"torch_ops": sum(counter.ops.values()), "triton_launches": sum(launches.values()),
            "top_torch_ops": counter.ops.most_common(12), "triton": dict(launches)}


@contextmanager
def counting() -> Iterator[tuple[Counter, Counter]]:
    """(torch ops, Triton launches) of the work inside, counted as on CUDA: an RMSNorm is one
    launch (torch's fused CUDA kernel; on the CPU it decomposes) and the ops inside a Triton
    launch (the interpreter's copies of its arguments) are not counted."""
    import torch.nn.functional as F
    from triton.runtime.interpreter import InterpretedFunction

    counter, launches = OpCounter(), Counter()
    run, rms_norm = InterpretedFunction.run, F.rms_norm

    def launch(self, *args, **kwargs):
        launches[self.fn.__name__] += 1
        paused, counter.paused = counter.paused, True
        try:
            return run(self, *args, **kwargs)
        finally:
            counter.paused = paused

    def fused_rms_norm(*args, **kwargs):
        counter.ops["rms_norm"] += not counter.paused
        paused, counter.paused = counter.paused, True
        try:
            return rms_norm(*args, **kwargs)
        finally:
            counter.paused = paused

    InterpretedFunction.run, F.rms_norm = launch, fused_rms_norm
    try:
        with counter:
            yield counter.ops, launches
    finally:
        InterpretedFunction.run, F.rms_norm = run, rms_norm


@contextmanager
def kernels_as_on_cuda() -> Iterator[None]:
    """CPU tensors take the paths CUDA tensors take: the Triton kernels (interpreted), the fused
    operand kernels, the RoPE kernel where the engine uses it."""
    from fp4stack import ops
    from fp4stack.kernels import rope as rope_kernel
    from fp4stack.models import gpt as gpt_mod
    from fp4stack.models.rope import apply_rope_reference
    from fp4stack.nn import operands

    def rope_as_on_cuda(x, cos, sin):
        if not torch.is_grad_enabled() and rope_kernel.supported(x, cos):
            return rope_kernel.apply_rope(x, cos, sin)
        return apply_rope_reference(x, cos, sin)

    saved = ops.backend_for, operands._FUSED_ON_CPU, gpt_mod.apply_rope
    ops.backend_for, operands._FUSED_ON_CPU = (lambda device: "triton"), True
    gpt_mod.apply_rope = rope_as_on_cuda
    try:
        yield
    finally:
        ops.backend_for, operands._FUSED_ON_CPU, gpt_mod.apply_rope = saved


def _count_generate(engine, prompts: list[list[int]]) -> tuple[Counter, Counter]:
    """(torch ops, Triton launches) of engine.generate(prompts), the second call (the first
    builds the engine's static buffers)."""
    engine.generate(prompts, torch.Generator().manual_seed(0))
    with counting() as (ops, launches):
        engine.generate(prompts, torch.Generator().manual_seed(0))
    return ops, launches


def _smollm2_block_gpt(blocks: int, dim: int):
    """A GPT of `blocks` blocks with the upcycled SmolLM2's structure (grouped-query attention,
    8 experts top-2, tied embeddings) at width `dim`, seeded."""
    from fp4stack.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=128, dim=dim, n_layers=blocks, n_heads=4, n_kv_heads=2,
                         ffn_hidden=dim, moe=True, n_experts=8, top_k=2, moe_hidden=dim,
                         qk_norm=False, tie_embeddings=True, max_seq_len=64))


def _per_block(count) -> dict:
    """count(blocks) -> (torch ops, Triton launches), split into a block's and the rest's (a
    2-block model's count less a 1-block one's)."""
    with kernels_as_on_cuda():
        (ops1, tl1), (ops2, tl2) = count(1), count(2)
    block_ops, block_tl = ops2 - ops1, tl2 - tl1
    return {"block": {"torch_ops": sum(block_ops.values()), "triton_launches":
                      sum(block_tl.values()), "top_torch_ops": block_ops.most_common(12),
                      "triton": dict(block_tl)},
            "outside": {"torch_ops": sum((ops1 - block_ops).values()),
                        "triton_launches": sum((tl1 - block_tl).values()),
                        "top_torch_ops": (ops1 - block_ops).most_common(12)}}


def count_decode(precision: str, dim: int) -> dict:
    """Launches of one decoding step per block and outside the blocks (see the module doc)."""
    from fp4stack.data.char_tokenizer import CharTokenizer
    from fp4stack.rl.fast_rollout import FastRolloutEngine

    rollout, _, mode = precision.partition(":")  # quads:static, channels calibrated first

    def step(blocks: int) -> tuple[Counter, Counter]:
        counts = []
        for new in (3, 4):  # one decoding step apart, everything else the same
            engine = FastRolloutEngine(
                _smollm2_block_gpt(blocks, dim), CharTokenizer(), rollout, max_new_tokens=new,
                dtype=torch.bfloat16, compensation=0.5 if rollout.startswith("quads") else None,
                compensation_mode=mode or None,
                eos_check_every=100)  # no EOS check inside the counted steps
            if mode == "static":
                engine.calibrate([[5, 6, 7, 8, 9, 10, 11, 12]] * 4)
            counts.append(_count_generate(engine, [[5, 6, 7, 8]] * 4))
        return counts[1][0] - counts[0][0], counts[1][1] - counts[0][1]

    return _per_block(step)


def count_refit(precision: str, dim: int) -> dict:
    """Launches of one refit (`RolloutEngine.sync`, after a first one) of a fast engine in
    `precision` from the model it was built from, per block and outside the blocks."""
    from fp4stack.data.char_tokenizer import CharTokenizer
    from fp4stack.rl.fast_rollout import FastRolloutEngine

    def step(blocks: int) -> tuple[Counter, Counter]:
        model = _smollm2_block_gpt(blocks, dim)
        engine = FastRolloutEngine(model, CharTokenizer(), precision, dtype=torch.bfloat16,
                                   compensation=0.5 if precision.startswith("quads") else None)
        engine.sync(model)  # the first refit makes what later ones reuse
        with counting() as (ops, launches):
            engine.sync(model)
        return ops, launches

    return _per_block(step)


def count_update(trainer: str, dim: int) -> dict:
    """Launches of one GRPO update (`rl.update.train_step` on one micro-batch: forward and
    backward under bfloat16 autocast, gradient clipping, a fused AdamW step) of a trainer in
    `trainer`'s recipe, per block and outside the blocks."""
    from fp4stack.convert import quantize_model
    from fp4stack.rl.config import RLConfig
    from fp4stack.rl.rollout import Rollout
    from fp4stack.rl.update import train_step

    def step(blocks: int) -> tuple[Counter, Counter]:
        model = _smollm2_block_gpt(blocks, dim).train()
        if trainer != "bf16":
            quantize_model(model, trainer)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
        cfg = RLConfig(micro_batch_size=8, trainer=trainer, trainer_dtype="bfloat16")
        tokens = torch.randint(0, 128, (8, 24))
        mask = torch.ones_like(tokens, dtype=torch.bool)
        resp = mask.clone()
        resp[:, :8] = False  # 8 prompt tokens, 16 response tokens a row
        rollout = Rollout(tokens, mask, resp, -torch.rand(tokens.shape) * resp, 8)
        adv = torch.randn(8)
        train_step(model, opt, rollout, adv, cfg, None, log=lambda *a: None)  # builds states
        with counting() as (ops, launches):
            train_step(model, opt, rollout, adv, cfg, None, log=lambda *a: None)
        return ops, launches

    return _per_block(step)


def main_per_block(args) -> None:
    """--decode, --update or --refit: the counts of each precision or trainer, as a table."""
    if args.decode:
        what, key, count, names = "precision", "decode", count_decode, args.precisions
        title = "One decoding step"
    elif args.refit:
        what, key, count, names = "precision", "refit", count_refit, args.precisions
        title = "One refit of the engine (weight sync, checked)"
    else:
        what, key, count, names = "trainer", "update", count_update, args.trainers
        title = "One GRPO update (one micro-batch)"
    results = {name: count(name, args.dim) for name in names.split(",")}
    print(f"{title}, per block of the upcycled SmolLM2's structure and outside them; at "
          f"{args.blocks_total} blocks:")
    print(f"| {what} | torch ops a block | Triton a block | outside blocks | "
          f"total at {args.blocks_total} blocks |\n|---|---:|---:|---:|---:|")
    for name, r in results.items():
        b, o = r["block"], r["outside"]
        per_block = b["torch_ops"] + b["triton_launches"]
        outside = o["torch_ops"] + o["triton_launches"]
        print(f"| {name} | {b['torch_ops']} | {b['triton_launches']} | {outside} | "
              f"{per_block * args.blocks_total + outside:,} |")
    for name, r in results.items():
        print(f"{name}: a block's torch ops {r['block']['top_torch_ops']}; "
              f"Triton {r['block']['triton']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"dim": args.dim, key: results}, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=7)
    ap.add_argument("--decode", action="store_true",
                    help="count a decoding step of the fast rollout engine instead")
    ap.add_argument("--precisions", default="bf16,nvfp4,quads",
                    help="--decode, --refit: the engine's rollout precisions")
    ap.add_argument("--blocks-total", type=int, default=30,
                    help="--decode, --update, --refit: blocks of the policy the total is "
                         "given for")
    ap.add_argument("--update", action="store_true",
                    help="count a GRPO update of the RL trainer instead")
    ap.add_argument("--refit", action="store_true",
                    help="count a refit of the fast rollout engine instead")
    ap.add_argument("--trainers", default="bf16,qat-w",
                    help="--update: the trainer recipes")
    ap.add_argument("--out", help="write the counts as JSON here")
    args = ap.parse_args()
    if args.decode or args.update or args.refit:
        return main_per_block(args)

    from fp4stack.optim.muon4 import Muon4

    d = args.dim
    shapes = ([(d, d)] * 4 + [(3 * d, d)] * 2 + [(d, 3 * d)]) * args.blocks
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(r, c) * 0.02) for r, c in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    arms = {"Muon (bf16 Newton-Schulz)": lambda ps: Muon4(ps, quantize=False, cuda_graphs=False),
            "Muon4": lambda ps: Muon4(ps, cuda_graphs=False)}
    results = {name: count_step(make, params) for name, make in arms.items()}
    print(f"{len(shapes)} matrices ({args.blocks} GPT blocks at dim {d}); one optimizer step")
    print("| optimizer | torch ops (GPU kernels) | Triton launches | total |\n|---|---:|---:|---:|")
    for name, r in results.items():
        total = r["torch_ops"] + r["triton_launches"]
        print(f"| {name} | {r['torch_ops']:,} | {r['triton_launches']:,} | {total:,} |")
    for name, r in results.items():
        print(f"{name}: most frequent torch ops {r['top_torch_ops']}; Triton {r['triton']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"dim": d, "matrices": len(shapes), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
