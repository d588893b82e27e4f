"""Where a GRPO step's rollouts come from: generated when the step asks for them, or one step
ahead, in a background thread, while the trainer trains (`off_policy: 1`).

On-policy (off_policy 0), step s trains on rollouts sampled from the weights of step s - 1, the
trainer's own, and rollout and training take turns. One step off-policy, the engine samples the
rollouts of step s + 1 from the weights of step s - 1 while step s trains: with the engine on
its own device (`engine_device`) the two overlap and a step costs about the slower of the two,
not their sum. The price is one step of policy lag, which the mismatch metrics then include
(k3 and |dlogp| measure the rollout's log-probs against the trainer's at train time) and a
token-level correction (token-tis) weighs.

The order of everything random is fixed either way: prompts are drawn in the main thread in
step order, the engine's sampling generator is used by one generation at a time, and the engine
is refitted only while it is idle. A run is as reproducible one step off-policy as on-policy.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import nn

from .rollout import Rollout, RolloutEngine

OFF_POLICY = (0, 1)


@dataclass
class RolloutBatch:
    """One step's rollouts (on the trainer's device), the task examples of their rows, and
    the engine's seconds spent on them and the seconds the trainer waited for them."""

    group: list
    rollout: Rollout
    generate_s: float
    wait_s: float


class RolloutSource:
    """Rollouts for consecutive GRPO steps from `engine`.

    `draw()` gives the next step's examples, one per row (a GRPO group repeats each prompt);
    `encode(example)` its prompt token ids. With `off_policy=1` the next step's rollouts are
    generated in a background thread as soon as a step's are handed out. Call `sync(model)`
    after every update (it waits for the generation in flight, then refits the engine) and
    `close()` at the end.
    """

    def __init__(self, engine: RolloutEngine, draw: Callable[[], list],
                 encode: Callable[[object], list[int]], generator: torch.Generator | None,
                 device: torch.device, *, record: bool = False, off_policy: int = 0) -> None:
        if off_policy not in OFF_POLICY:
            raise ValueError(f"off_policy must be 0 (on-policy) or 1 (rollouts one step "
                             f"ahead), got {off_policy!r}")
        self.engine, self.draw, self.encode = engine, draw, encode
        self.generator, self.device, self.record = generator, device, record
        self.off_policy = off_policy
        self._pool = ThreadPoolExecutor(1, "rollout") if off_policy else None
        self._pending: Future | None = None
        self._ready: tuple[list, Rollout, float] | None = None

    def _generate(self, group: list) -> tuple[list, Rollout, float]:
        t0 = time.perf_counter()
        rollout = self.engine.generate([self.encode(e) for e in group], self.generator,
                                       record=self.record)
        return group, rollout, time.perf_counter() - t0

    def _submit(self) -> None:
        group = self.draw()  # in the main thread, in step order
        if self._pool is None:
            self._ready = self._generate(group)
        else:
            self._pending = self._pool.submit(self._generate, group)

    def _collect(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._ready = pending.result()  # re-raises what the thread raised

    def next(self, prefetch: bool = True) -> RolloutBatch:
        """This step's rollouts. One step off-policy, `prefetch` starts the next step's (pass
        False on the last step)."""
        t0 = time.perf_counter()
        if self._ready is None and self._pending is None:
            self._submit()
        self._collect()
        group, rollout, generate_s = self._ready
        self._ready = None
        wait_s = time.perf_counter() - t0
        if self._pool is not None and prefetch:
            self._submit()
        return RolloutBatch(group, rollout.to(self.device), generate_s, wait_s)

    def sync(self, model: nn.Module) -> int:
        """Refit the engine from `model` once no generation is in flight; returns the tensors
        verified (see RolloutEngine.sync)."""
        self._collect()
        return self.engine.sync(model)

    def close(self) -> None:
        """Stop the background thread (a generation in flight is finished, its rows dropped)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._pending = None
