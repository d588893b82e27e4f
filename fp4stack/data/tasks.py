"""RL tasks with verifiable rewards: prompts, reference answers and a scoring function.

A task gives an endless, seeded stream of training examples, a fixed held-out test set that never
shares a prompt with training, a reward in [0, 1] for a response text, and a reference response
for supervised warm-up. `load_task` builds one from a short spec:

- ``"arithmetic"`` (all operations mixed), ``"arithmetic:add"``, ``":sub"``, ``":mul"``,
  ``":chain"`` (three-term sums), with ``level`` = digits per operand (1..6);
- ``"arithmetic:worked"``: five-term sums answered step by step ("12+34=46 46+56=102 ..."), the
  reward on the last step's value: long responses (about 40 characters at level 2);
- ``"countdown"`` and ``"gsm_symbolic"`` from the optional ``reasoning-gym`` package;
- ``"package.module:callable"``: any callable that returns an object with the `Task` members.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import random
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from ..config_fields import suggest


@dataclass(frozen=True)
class Example:
    """One problem: the text the policy sees, its canonical answer, and free-form metadata."""

    prompt: str
    answer: str
    meta: dict = field(default_factory=dict, compare=False, hash=False)


@runtime_checkable
class Task(Protocol):
    """What a trainer needs from a task; see the module docstring."""

    name: str

    def train_examples(self, seed: int) -> Iterator[Example]: ...

    def test_set(self) -> list[Example]: ...

    def score(self, response: str, example: Example) -> float: ...

    def completion(self, example: Example) -> str: ...


ARITHMETIC_OPS = ("add", "sub", "mul", "chain")  # "arithmetic" mixes these
WORKED = "worked"  # a sum written out step by step: only by name, never in the default mix
_OPS = (*ARITHMETIC_OPS, WORKED)
BUILTIN_TASKS = (
    "arithmetic", *(f"arithmetic:{op}" for op in _OPS), "countdown", "gsm_symbolic",
)
_TASK_MEMBERS = ("name", "train_examples", "test_set", "score", "completion")
_SYMBOL = {"add": "+", "sub": "-", "mul": "*", "chain": "+", WORKED: "+"}
_TERMS = {"chain": 3, WORKED: 5}
_LAST_STEP = re.compile(r"=\s*(-?\d+)")
_LEADING_INT = re.compile(r"\s*(-?\d+)")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from `n` samples of which `c` are correct: 1 - C(n-c, k) / C(n, k).

    Computed as a product of ratios, which stays accurate where the binomials overflow floats.
    """
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got n={n}, k={k}")
    if n - c < k:
        return 1.0  # every k-subset holds a correct sample
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def _leading_int(text: str) -> int | None:
    """The integer that `text` starts with (after spaces), or None."""
    m = _LEADING_INT.match(text)
    return int(m.group(1)) if m else None


def _unique(stream: Iterator[Example], n: int, what: str) -> list[Example]:
    """The first `n` examples of `stream` with distinct prompts."""
    out: dict[str, Example] = {}
    for tries, ex in enumerate(stream):
        out.setdefault(ex.prompt, ex)
        if len(out) == n:
            return list(out.values())
        if tries > 100 * n + 1000:
            break
    raise RuntimeError(f"{what}: found only {len(out)} distinct prompts of {n} wanted")


class ArithmeticTask:
    """Integer arithmetic with exact answers, e.g. ``"17+25="`` -> ``"42"``.

    Each operand has exactly `level` digits (level 1 includes 0). Subtraction keeps negative
    results. The test set has `n_test` distinct prompts drawn with `seed`, but at most a quarter
    of all distinct problems, so that small levels keep most problems for training; training
    streams skip every test prompt. Reward is 1.0 when the response starts (after spaces) with
    the answer as an integer, whatever follows it, else 0.0. The "worked" op's sums are answered
    step by step, ``"12+34+56+78+91="`` -> ``"12+34=46 46+56=102 102+78=180 180+91=271"``, and
    rewarded when the value after the response's last "=" is the answer.
    """

    def __init__(
        self, ops: str | tuple[str, ...] = ARITHMETIC_OPS, level: int = 2, n_test: int = 200,
        seed: int = 0,
    ):
        ops = (ops,) if isinstance(ops, str) else tuple(ops)
        bad = [op for op in ops if op not in _OPS]
        if not ops or bad:
            raise ValueError(f"arithmetic ops must be among {_OPS}, got {ops}")
        if not (isinstance(level, int) and 1 <= level <= 6):
            raise ValueError(f"level (digits per operand) must be an int in 1..6, got {level!r}")
        if not (isinstance(n_test, int) and n_test >= 1):
            raise ValueError(f"n_test must be a positive int, got {n_test!r}")
        self.ops, self.level, self.seed = ops, level, seed
        self.name = "arithmetic" if ops == ARITHMETIC_OPS else "arithmetic:" + "+".join(ops)
        self._lo = 0 if level == 1 else 10 ** (level - 1)
        self._hi = 10**level - 1
        values = self._hi - self._lo + 1
        space = sum(values ** _TERMS.get(op, 2) for op in ops)
        self.n_test = min(n_test, space // 4)
        self._test: list[Example] | None = None

    def _stream(self, rng: random.Random) -> Iterator[Example]:
        while True:
            op = rng.choice(self.ops)
            terms = [rng.randint(self._lo, self._hi) for _ in range(_TERMS.get(op, 2))]
            if op == "sub":
                value = terms[0] - terms[1]
            elif op == "mul":
                value = terms[0] * terms[1]
            else:
                value = sum(terms)
            prompt = _SYMBOL[op].join(map(str, terms)) + "="
            yield Example(prompt, str(value), {"level": self.level, "op": op})

    def _rng(self, split: str, seed: int) -> random.Random:
        # A string seed is hashed with SHA-512 by `random`, so streams are stable across runs
        # and the train and test seed spaces never coincide.
        return random.Random(f"{self.name}:{self.level}:{split}:{seed}")

    def test_set(self) -> list[Example]:
        if self._test is None:
            stream = self._stream(self._rng("test", self.seed))
            self._test = _unique(stream, self.n_test, f"{self.name} test set")
        return list(self._test)

    def train_examples(self, seed: int) -> Iterator[Example]:
        held_out = {ex.prompt for ex in self.test_set()}
        return (ex for ex in self._stream(self._rng("train", seed)) if ex.prompt not in held_out)

    def score(self, response: str, example: Example) -> float:
        if example.meta.get("op") == WORKED:
            steps = _LAST_STEP.findall(response)
            return 1.0 if steps and int(steps[-1]) == int(example.answer) else 0.0
        return 1.0 if _leading_int(response) == int(example.answer) else 0.0

    def completion(self, example: Example) -> str:
        if example.meta.get("op") != WORKED:
            return example.answer
        terms = [int(t) for t in example.prompt[:-1].split("+")]
        steps, total = [], terms[0]
        for t in terms[1:]:
            steps.append(f"{total}+{t}={total + t}")
            total += t
        return " ".join(steps)


def _reasoning_gym(task: str):
    try:
        import reasoning_gym
    except ImportError as e:
        raise ImportError(
            f"task {task!r} needs reasoning-gym: pip install 'fp4stack[tasks]'"
        ) from e
    return reasoning_gym


def _seed_base(*parts: object) -> int:
    # reasoning-gym seeds item i of a dataset with `seed + i`: a hashed 48-bit start puts the
    # train and test index ranges far apart.
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:6], "big")


_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _final_answer(response: str) -> str:
    """The part of a response that holds its final answer: the last <answer> tag if any."""
    tagged = _ANSWER_TAG.findall(response)
    return (tagged[-1] if tagged else response).strip()


class ReasoningGymTask:
    """Adapter for a `reasoning_gym` procedural dataset (e.g. ``"countdown"``).

    Extra options go to the dataset's config. Responses may wrap the answer in
    ``<answer>...</answer>``. ``gsm_symbolic`` is scored on the final number (after ``####`` when
    present, else the last one), with `math_verify` when installed; other datasets use the
    dataset's own `score_answer`, which may give small partial credit for well-formed answers.
    """

    def __init__(self, dataset: str, n_test: int = 200, seed: int = 0, **config: Any):
        if not (isinstance(n_test, int) and n_test >= 1):
            raise ValueError(f"n_test must be a positive int, got {n_test!r}")
        self._rg = _reasoning_gym(dataset)
        self.name, self.n_test, self.seed, self._config = dataset, n_test, seed, config
        # One small dataset up front: config errors surface here, not mid-training.
        self._scorer = self._rg.create_dataset(dataset, size=1, seed=0, **config)
        self._test: list[Example] | None = None

    def _stream(self, base: int, chunk: int = 256) -> Iterator[Example]:
        for start in range(base, base + 2**40, chunk):
            ds = self._rg.create_dataset(self.name, size=chunk, seed=start, **self._config)
            for entry in ds:
                meta = {"dataset": self.name, "entry": entry}
                yield Example(entry["question"], str(entry["answer"]), meta)

    def test_set(self) -> list[Example]:
        if self._test is None:
            stream = self._stream(_seed_base(self.name, "test", self.seed))
            self._test = _unique(stream, self.n_test, f"{self.name} test set")
        return list(self._test)

    def train_examples(self, seed: int) -> Iterator[Example]:
        held_out = {ex.prompt for ex in self.test_set()}
        stream = self._stream(_seed_base(self.name, "train", seed))
        return (ex for ex in stream if ex.prompt not in held_out)

    def score(self, response: str, example: Example) -> float:
        answer = _final_answer(response)
        if self.name == "gsm_symbolic":
            return _score_number(answer, example.answer)
        entry = example.meta.get("entry") or {"answer": example.answer, "metadata": {}}
        return float(self._scorer.score_answer(answer, entry))

    def completion(self, example: Example) -> str:
        cot = example.meta.get("entry", {}).get("metadata", {}).get("answer_cot")
        if cot and "####" in cot:
            return cot  # gsm_symbolic: worked solution ending in "#### <answer>"
        return example.answer


def _score_number(answer: str, gold: str) -> float:
    """1.0 when the final number of `answer` equals `gold`, else 0.0."""
    text = answer.rsplit("####", 1)[-1]
    try:
        import math_verify
    except ImportError:
        math_verify = None
    if math_verify is not None:
        # Its timeouts use signal.alarm, which works only in the main thread.
        t = 5 if threading.current_thread() is threading.main_thread() else None
        gold_parsed, pred = (math_verify.parse(x, parsing_timeout=t) for x in (gold, text))
        return float(math_verify.verify(gold_parsed, pred, timeout_seconds=t))
    numbers = _NUMBER.findall(text)
    if not numbers:
        return 0.0
    try:
        return float(float(numbers[-1].replace(",", "")) == float(gold))
    except ValueError:
        return 0.0


def _check_task(obj: object, spec: str) -> Task:
    missing = [m for m in _TASK_MEMBERS if not hasattr(obj, m)]
    methods = [m for m in _TASK_MEMBERS[1:] if m not in missing]
    not_callable = [m for m in methods if not callable(getattr(obj, m))]
    if missing or not_callable:
        why = "; ".join(
            f"{label}: {', '.join(names)}"
            for label, names in (("missing", missing), ("not callable", not_callable)) if names
        )
        raise TypeError(f"{spec!r} returned a {type(obj).__name__}, which is not a Task ({why})")
    return obj  # type: ignore[return-value]


def _check_options(build: Callable[..., Any], options: dict[str, Any], spec: str,
                   positional: tuple[str, ...] = ()) -> None:
    """ValueError naming an option `build` does not take (and the closest one it does)."""
    params = inspect.signature(build).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return  # it takes any option: its own code checks them
    known = [n for n in params if n not in ("self", *positional)]
    for key in options:
        if key not in known:
            raise ValueError(f"task {spec!r}: unknown task option {key!r}{suggest(key, known)}; "
                             f"its options: {known}")


def load_task(spec: str, **options: Any) -> Task:
    """The task named by `spec` (see the module docstring), built with `options`.

    Arithmetic takes ``level``, ``n_test`` and ``seed`` (the test-set seed); reasoning-gym tasks
    take ``n_test``, ``seed`` and their dataset's config fields; a ``"module:callable"`` spec
    passes every option to the callable.
    """
    if spec == "arithmetic":
        _check_options(ArithmeticTask, options, spec)
        return ArithmeticTask(**options)
    if spec.startswith("arithmetic:"):
        op = spec.split(":", 1)[1]
        if op not in _OPS:
            raise ValueError(f"unknown arithmetic op {op!r} in {spec!r}; ops: {_OPS}")
        _check_options(ArithmeticTask, options, spec, positional=("ops",))
        return ArithmeticTask(op, **options)
    if spec in ("countdown", "gsm_symbolic"):
        return ReasoningGymTask(spec, **options)
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"unknown task {spec!r}; built-in tasks: {', '.join(BUILTIN_TASKS)}; "
            "or give 'package.module:callable'"
        )
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ImportError(f"task {spec!r}: cannot import module {module_name!r}: {e}") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"task {spec!r}: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"task {spec!r}: {attr!r} is not callable")
    return _check_task(obj(**options), spec)
