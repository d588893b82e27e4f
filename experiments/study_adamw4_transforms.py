"""AdamW4's second-moment transform, state rounding and m storage, measured against fp32 AdamW.

Three CPU tasks, each trained from the same seeds by torch.optim.AdamW (fp32 states) and by AdamW4
with every transform x {stochastic, rne} state rounding x {m, m / sqrt(v)} first-moment storage:
- gpt: fp4stack's tiny GPT on a synthetic Zipf-Markov token stream (fresh batches, held-out eval),
  every matrix quantized;
- wide: an MLP regression whose 64 input features are scaled by 10^-1 .. 10^1 in random order, so
  the first layer's v spans 4 decades inside a 16-element block (the zero-v failure the
  transforms are for), while fp32 AdamW still learns the task in a few hundred steps;
- rows: one matrix whose rows' gradients differ by 8 decades, as rare and frequent tokens'
  embedding rows do; Adam moves every row alike, so eval is the mean relative error over rows.
Prints one markdown table: final eval loss (mean over seeds), its gap to fp32 AdamW in % (mean of
the per-seed gaps) and state bytes per parameter (of the tiny GPT: rank1's row and column means
weigh more there than on real matrices). About 9 CPU-minutes: 5 minutes on 2 idle cores.

    python experiments/study_adamw4_transforms.py [--steps 200] [--seeds 0,1] [--workers 2]
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import time
from collections.abc import Callable

import torch
from torch import nn

from fp4stack.models.gpt import GPT, GPTConfig
from fp4stack.optim import AdamW4, StateFormat
from fp4stack.optim.state_transforms import TRANSFORMS

Task = Callable[[int], tuple[nn.Module, Callable[[int], torch.Tensor], Callable[[], float]]]


def markov_chain(vocab: int, gen: torch.Generator) -> torch.Tensor:
    """Transition matrix [vocab, vocab] of a synthetic language: each token has a few likely
    successors, and tokens follow a Zipf law, so rare tokens' gradients (and v) are tiny."""
    zipf = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float32)
    zipf = zipf[torch.randperm(vocab, generator=gen)]
    succ = torch.multinomial(zipf.expand(vocab, vocab), 4, generator=gen)
    rows = 0.1 * zipf / zipf.sum() + torch.zeros(vocab, vocab)
    weights = torch.rand(vocab, 4, generator=gen)
    rows.scatter_add_(1, succ, 0.9 * weights / weights.sum(1, keepdim=True))
    return rows / rows.sum(1, keepdim=True)


def sample(chain: torch.Tensor, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    tok = torch.multinomial(chain.sum(0), batch, replacement=True, generator=gen)
    out = [tok]
    for _ in range(length - 1):
        tok = torch.multinomial(chain[tok], 1, generator=gen)[:, 0]
        out.append(tok)
    return torch.stack(out, 1)


def gpt_task(seed: int):
    """Tiny GPT on a synthetic Zipf-Markov token stream: fresh batches, a fixed held-out batch."""
    gen = torch.Generator().manual_seed(1000 + seed)
    chain = markov_chain(256, gen)
    held_out = sample(chain, 32, 65, gen)
    torch.manual_seed(seed)
    model = GPT(GPTConfig.tiny())

    def loss(step: int) -> torch.Tensor:
        batch = sample(chain, 16, 65, gen)
        return model(batch[:, :-1], batch[:, 1:])[1]

    @torch.no_grad()
    def evaluate() -> float:
        return float(model(held_out[:, :-1], held_out[:, 1:])[1])

    return model, loss, evaluate


def wide_task(seed: int):
    """MLP regression with input features spanning two decades of scale (random order)."""
    gen = torch.Generator().manual_seed(1000 + seed)
    d_in, hidden, d_out = 64, 256, 16
    scale = 10.0 ** torch.linspace(-1, 1, d_in)[torch.randperm(d_in, generator=gen)]
    # Every feature matters equally to the target, whatever its scale.
    teacher = torch.randn(d_in, d_out, generator=gen) / (8 * scale[:, None])
    x_eval = torch.randn(1024, d_in, generator=gen) * scale

    def target(x: torch.Tensor) -> torch.Tensor:
        z = x @ teacher
        return torch.tanh(z) + 0.5 * torch.sin(2 * z)

    y_eval = target(x_eval)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(d_in, hidden), nn.GELU(), nn.Linear(hidden, hidden),
                          nn.GELU(), nn.Linear(hidden, d_out))

    def loss(step: int) -> torch.Tensor:
        x = torch.randn(128, d_in, generator=gen) * scale
        return nn.functional.mse_loss(model(x), target(x))

    @torch.no_grad()
    def evaluate() -> float:
        return float(nn.functional.mse_loss(model(x_eval), y_eval))

    return model, loss, evaluate


def rows_task(seed: int):
    """Rows of one matrix whose gradients differ by 8 decades (rare and frequent tokens of an
    embedding): Adam moves every row alike; eval is the mean relative error over rows."""
    gen = torch.Generator().manual_seed(1000 + seed)
    weight = 10.0 ** torch.linspace(-8, 0, 64)[:, None]
    target = torch.randn(64, 256, generator=gen)
    torch.manual_seed(seed)
    model = nn.Linear(256, 64, bias=False)
    nn.init.zeros_(model.weight)

    def loss(step: int) -> torch.Tensor:
        noisy = target + 0.5 * torch.randn(64, 256, generator=gen)
        return (weight * (model.weight - noisy) ** 2).sum()

    @torch.no_grad()
    def evaluate() -> float:
        err = (model.weight - target).square().sum(1) / target.square().sum(1)
        return float(err.mean())

    return model, loss, evaluate


TASKS: dict[str, tuple[Task, float]] = {
    "gpt": (gpt_task, 3e-3), "wide": (wide_task, 1e-2), "rows": (rows_task, 3e-2),
}


def train(task: str, seed: int, steps: int, optimizer: str) -> tuple[float, float]:
    """Final eval loss and state bytes per parameter of one run.

    optimizer: "fp32" (torch AdamW), or "transform/state_rounding/first_moment[/scaling]" for
    AdamW4, scaling "current" or "h<N>" (delayed with headroom N); AdamW4's default unless
    given.
    """
    torch.manual_seed(seed)
    build, lr = TASKS[task]
    model, loss_fn, evaluate = build(seed)
    params = list(model.parameters())
    if optimizer == "fp32":
        opt = torch.optim.AdamW(params, lr=lr, foreach=False)
    else:
        # min_numel=0: the tiny models stand in for big ones, so every matrix is quantized.
        opt = AdamW4(params, lr=lr, min_numel=0, seed=seed,
                     state_format=state_format(optimizer))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * s / steps)))
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        loss_fn(step).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
    n = sum(p.numel() for p in params)
    state = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0)
    return evaluate(), state / n


def state_format(name: str) -> StateFormat:
    """The StateFormat that "transform/state_rounding/first_moment[/scaling]" names (scaling
    "current" or "h<N>": delayed with headroom N; AdamW4's default unless given)."""
    transform, rounding, first, *scaling = name.split("/")
    extra = {}
    if scaling and scaling[0] == "current":
        extra["scaling"] = "current"
    elif scaling:
        extra["headroom"] = float(scaling[0][1:])
    return StateFormat(transform=transform, rounding=rounding, first_moment=first, **extra)


def _run(job: tuple[str, int, int, str]) -> tuple[float, float]:
    torch.set_num_threads(1)
    return train(*job)


def optimizers(transforms: list[str]) -> list[str]:
    """fp32 AdamW, AdamW4 with fp32 states, then every transform x rounding x m storage (with
    delayed scaling), then the default setting with other scalings."""
    names = ["fp32", "none/rne/direct"]
    for first in ("direct", "normalized"):
        names += [f"{t}/{r}/{first}" for t in transforms for r in ("stochastic", "rne")]
    if "rank1" in transforms:
        names += [f"rank1/stochastic/normalized/{s}" for s in ("h2", "h8", "current")]
    return names


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--tasks", default=",".join(TASKS))
    p.add_argument("--transforms", default=",".join(TRANSFORMS))
    p.add_argument("--workers", type=int, default=2, help="processes, one thread each")
    args = p.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    tasks = args.tasks.split(",")
    names = optimizers(args.transforms.split(","))
    jobs = [(t, s, args.steps, n) for t in tasks for n in names for s in seeds]
    t0 = time.time()
    with multiprocessing.get_context("spawn").Pool(args.workers) as pool:
        out = dict(zip(jobs, pool.map(_run, jobs, chunksize=1), strict=True))
    print(f"{args.steps} steps, seeds {seeds}, {time.time() - t0:.0f} s on {args.workers} "
          "processes\n")
    head = " | ".join(f"{t} loss | {t} gap" for t in tasks)
    print(f"| optimizer | v stored as | state rounding | m stored as | {head} | bytes/param |")
    print("|---|---|---|---|" + "---:|---:|" * len(tasks) + "---:|")
    for name in names:
        cells = []
        for task in tasks:
            runs = [out[task, s, args.steps, name] for s in seeds]
            base = [out[task, s, args.steps, "fp32"] for s in seeds]
            loss = sum(r[0] for r in runs) / len(runs)
            gap = sum(100 * (r[0] / b[0] - 1) for r, b in zip(runs, base, strict=True))
            cells.append(f"{loss:.4f} | {gap / len(runs):+.2f}%")
        if name == "fp32":
            label = "torch AdamW | v (fp32) | - | m (fp32)"
        elif name.startswith("none/"):
            label = "AdamW4 | v (fp32) | - | m (fp32)"
        else:
            t, r, first, *scaling = name.split("/")
            m = "m / sqrt(v)" if first == "normalized" else "m"
            how = ""
            if scaling:
                how = (", current scaling" if scaling[0] == "current"
                       else f", headroom {scaling[0][1:]}")
            label = f"AdamW4 | {t}{how} | {r} | {m}"
        bytes_per_param = out[tasks[0], seeds[0], args.steps, name][1]
        print(f"| {label} | {' | '.join(cells)} | {bytes_per_param:.3f} |")


if __name__ == "__main__":
    main()
