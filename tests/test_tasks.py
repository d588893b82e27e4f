"""RL tasks (arithmetic, reasoning-gym adapters, user tasks), pass@k and the char tokenizer."""

from __future__ import annotations

import itertools
import math
import re
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fp4stack.data.char_tokenizer import DEFAULT_ALPHABET, CharTokenizer
from fp4stack.data.tasks import (
    ARITHMETIC_OPS,
    BUILTIN_TASKS,
    ArithmeticTask,
    Example,
    Task,
    _score_number,
    load_task,
    pass_at_k,
)

ARITH_SPECS = [s for s in BUILTIN_TASKS if s.startswith("arithmetic")]


def take(task: Task, seed: int, n: int) -> list[Example]:
    return list(itertools.islice(task.train_examples(seed), n))


def evaluate(prompt: str) -> tuple[list[int], int]:
    """The operands of an arithmetic prompt and its value, parsed independently of the task."""
    m = re.fullmatch(r"(\d+)(?:([+*-])(\d+))+=", prompt)
    assert m, prompt
    tokens = re.findall(r"\d+|[+*-]", prompt[:-1])
    operands = [int(t) for t in tokens[::2]]
    value = operands[0]
    for op, x in zip(tokens[1::2], operands[1:], strict=True):
        value = value + x if op == "+" else value - x if op == "-" else value * x
    return tokens[::2], value


# --- arithmetic -------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ARITH_SPECS)
def test_train_stream_deterministic_per_seed(spec):
    a, b = load_task(spec), load_task(spec)
    assert take(a, 3, 50) == take(b, 3, 50)
    assert take(a, 3, 50) != take(a, 4, 50)
    assert a.test_set() == b.test_set() == a.test_set()
    assert a.test_set() != load_task(spec, seed=1).test_set()


@pytest.mark.parametrize("spec", ARITH_SPECS)
@pytest.mark.parametrize("level", [1, 2])
def test_train_never_sees_test_prompts(spec, level):
    task = load_task(spec, level=level)
    test = {ex.prompt for ex in task.test_set()}
    assert len(test) == len(task.test_set()) == task.n_test > 0
    seen = {ex.prompt for ex in take(task, 0, 3000)}
    assert not seen & test


def test_small_level_caps_test_set_and_train_covers_the_rest():
    task = load_task("arithmetic:add", level=1)  # 100 problems: a quarter held out
    assert len(task.test_set()) == 25
    seen = {ex.prompt for ex in take(task, 0, 3000)}
    assert len(seen) == 75
    assert load_task("arithmetic", level=3, n_test=17).n_test == 17


@pytest.mark.parametrize("op", ARITHMETIC_OPS)
@pytest.mark.parametrize("level", range(1, 7))
def test_levels_give_digit_counts_and_answers_are_right(op, level):
    task = load_task(f"arithmetic:{op}", level=level)
    examples = take(task, 0, 100) + task.test_set()[:50]
    for ex in examples:
        operands, value = evaluate(ex.prompt)
        assert len(operands) == (3 if op == "chain" else 2)
        assert all(len(x) == level for x in operands), ex.prompt
        assert ex.answer == str(value)
        assert ex.meta == {"level": level, "op": op}
        assert task.completion(ex) == ex.answer
        assert task.score(task.completion(ex), ex) == 1.0
    if op == "sub" and level > 1:
        assert any(ex.answer.startswith("-") for ex in examples)


@pytest.mark.parametrize("level", [1, 2, 3])
def test_worked_sums_are_answered_step_by_step(level):
    task = load_task("arithmetic:worked", level=level)
    examples = take(task, 0, 200) + task.test_set()[:50]
    tok = CharTokenizer()
    for ex in examples:
        operands, value = evaluate(ex.prompt)
        assert len(operands) == 5 and all(len(x) == level for x in operands)
        assert ex.answer == str(value) and ex.meta == {"level": level, "op": "worked"}
        steps = task.completion(ex).split(" ")
        assert len(steps) == 4 and steps[-1].endswith(f"={value}")
        total = int(operands[0])
        for step, x in zip(steps, operands[1:], strict=True):  # each step adds the next term
            assert step == f"{total}+{x}={total + int(x)}"
            total += int(x)
        assert task.score(task.completion(ex), ex) == 1.0
        assert tok.decode(tok.encode(ex.prompt + task.completion(ex))) == \
            ex.prompt + task.completion(ex)
    lengths = [len(task.completion(ex)) for ex in examples]
    if level >= 2:  # responses of 32+ tokens on average, for a character tokenizer
        assert sum(lengths) / len(lengths) >= 32


@pytest.mark.parametrize("response, reward", [
    ("12+34=46 46+56=102 102+78=180 180+91=271", 1.0), ("=271", 1.0), ("x = 271 ", 1.0),
    ("12+34=46 46+56=102 102+78=180 180+91=270", 0.0), ("271", 0.0), ("=271 =5", 0.0), ("", 0.0),
])
def test_worked_score_reads_the_last_step(response, reward):
    ex = Example("12+34+56+78+91=", "271", {"level": 2, "op": "worked"})
    assert load_task("arithmetic:worked").score(response, ex) == reward


def test_the_default_mix_has_no_worked_sums():
    ops = {ex.meta["op"] for ex in take(load_task("arithmetic"), 0, 400)}
    assert "worked" not in ops


def test_mix_uses_every_op():
    ops = {ex.meta["op"] for ex in take(load_task("arithmetic"), 0, 200)}
    assert ops == set(ARITHMETIC_OPS)


@pytest.mark.parametrize(
    "response, answer, reward",
    [
        ("42", "42", 1.0), (" 42", "42", 1.0), ("42abc", "42", 1.0), ("42=", "42", 1.0),
        ("\t 42\n", "42", 1.0), ("042", "42", 1.0), ("-7", "-7", 1.0), ("-7", "7", 0.0),
        ("7", "-7", 0.0), ("", "42", 0.0), ("4 2", "42", 0.0), ("abc42", "42", 0.0),
        ("43", "42", 0.0), ("420", "42", 0.0), ("- 7", "-7", 0.0), ("+42", "42", 0.0),
    ],
)
def test_arithmetic_score(response, answer, reward):
    ex = Example("40+2=" if answer == "42" else "0-7=", answer)
    assert load_task("arithmetic").score(response, ex) == reward


def test_example_equality_ignores_meta():
    assert Example("1+1=", "2", {"op": "add"}) == Example("1+1=", "2")
    assert len({Example("1+1=", "2", {"a": 1}), Example("1+1=", "2", {"b": 2})}) == 1


@pytest.mark.parametrize(
    "options", [{"level": 0}, {"level": 7}, {"level": "2"}, {"n_test": 0}, {"ops": ("div",)}]
)
def test_arithmetic_rejects_bad_options(options):
    with pytest.raises(ValueError):
        ArithmeticTask(**options)


# --- pass@k -----------------------------------------------------------------------------------


@given(st.integers(1, 9).flatmap(
    lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
def test_pass_at_k_matches_enumeration(nck):
    n, c, k = nck
    subsets = list(itertools.combinations(range(n), k))
    hits = sum(any(i < c for i in s) for s in subsets)  # samples 0..c-1 are the correct ones
    assert math.isclose(pass_at_k(n, c, k), hits / len(subsets), abs_tol=1e-12)


def test_pass_at_k_large_n_and_errors():
    assert pass_at_k(10_000, 0, 100) == 0.0
    assert pass_at_k(10_000, 10_000, 1) == 1.0
    assert math.isclose(pass_at_k(2000, 20, 1), 0.01)
    assert 0.0 < pass_at_k(5000, 1, 2) < 1.0
    for n, c, k in [(5, 1, 6), (5, 1, 0), (5, 6, 1), (5, -1, 1), (0, 0, 1)]:
        with pytest.raises(ValueError):
            pass_at_k(n, c, k)


# --- load_task --------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ARITH_SPECS)
def test_load_builtin(spec):
    task = load_task(spec, level=3, n_test=10, seed=5)
    assert isinstance(task, Task)
    assert task.name == spec
    assert len(task.test_set()) == 10
    assert all(ex.meta["level"] == 3 for ex in task.test_set())


USER_TASK = '''
from fp4stack.data.tasks import Example

class Echo:
    def __init__(self, word="hi", n_test=3):
        self.name = "echo"
        self.word, self.n_test = word, n_test
    def train_examples(self, seed):
        i = seed * 1000
        while True:
            i += 1
            yield Example(f"{self.word}{i}:", str(i))
    def test_set(self):
        return [Example(f"{self.word}-t{i}:", str(i)) for i in range(self.n_test)]
    def score(self, response, example):
        return float(response.strip() == example.answer)
    def completion(self, example):
        return example.answer

class NoScore:
    name = "broken"
    def train_examples(self, seed): ...
    def test_set(self): ...
    def completion(self, example): ...

not_a_function = 3
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rl_tasks.py").write_text(USER_TASK)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_rl_tasks", raising=False)
    return "my_rl_tasks"


def test_load_user_callable(user_module):
    task = load_task(f"{user_module}:Echo", word="yo", n_test=4)
    assert isinstance(task, Task) and task.name == "echo"
    assert len(task.test_set()) == 4
    ex = next(task.train_examples(2))
    assert ex.prompt == "yo2001:"
    assert task.score(" 2001 ", ex) == 1.0


def test_load_user_errors(user_module):
    with pytest.raises(TypeError, match="missing: score"):
        load_task(f"{user_module}:NoScore")
    with pytest.raises(TypeError, match="not callable"):
        load_task(f"{user_module}:not_a_function")
    with pytest.raises(ValueError, match="no attribute 'Nope'"):
        load_task(f"{user_module}:Nope")
    with pytest.raises(TypeError, match="bogus"):
        load_task(f"{user_module}:Echo", bogus=1)
    with pytest.raises(ImportError, match="no_such_module_xyz"):
        load_task("no_such_module_xyz:make")


@pytest.mark.parametrize("spec", ["arith", "sudoku", "", ":", "arithmetic:", "mod:"])
def test_unknown_spec_lists_builtins(spec):
    with pytest.raises(ValueError) as e:
        load_task(spec)
    assert "arithmetic" in str(e.value)
    if ":" not in spec:
        assert all(name in str(e.value) for name in BUILTIN_TASKS)


def test_unknown_arithmetic_op():
    with pytest.raises(ValueError, match="div.*chain"):
        load_task("arithmetic:div")


@pytest.mark.parametrize("spec", ["countdown", "gsm_symbolic"])
def test_reasoning_gym_missing_names_extra(spec, monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # makes `import` fail
    with pytest.raises(ImportError, match=re.escape("pip install 'fp4stack[tasks]'")):
        load_task(spec)


# --- reasoning-gym adapters -------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["countdown", "gsm_symbolic"])
def test_reasoning_gym_tasks(spec):
    pytest.importorskip("reasoning_gym")
    task = load_task(spec, n_test=8)
    assert isinstance(task, Task) and task.name == spec
    test = task.test_set()
    assert len(test) == 8 and len({ex.prompt for ex in test}) == 8
    train = take(task, 0, 12)
    assert train == take(load_task(spec, n_test=8), 0, 12)
    assert train != take(task, 1, 12)
    assert not {ex.prompt for ex in train} & {ex.prompt for ex in test}
    for ex in test + train:
        assert ex.prompt and ex.answer
        assert task.score(ex.answer, ex) == 1.0
        assert task.score(task.completion(ex), ex) == 1.0
        assert task.score(f"<answer>{ex.answer}</answer>", ex) == 1.0
        assert task.score("", ex) < 1.0
        assert task.score("1+1", ex) < 1.0


def test_gsm_symbolic_wrong_number_scores_zero():
    pytest.importorskip("reasoning_gym")
    task = load_task("gsm_symbolic", n_test=3)
    ex = task.test_set()[0]
    wrong = str(int(float(ex.answer)) + 1)
    assert task.score(wrong, ex) == 0.0
    assert task.score(f"First {wrong} apples, so the total is {ex.answer}.", ex) == 1.0
    assert task.score(f"{ex.answer} at first, then {wrong}", ex) == 0.0


@pytest.mark.parametrize("with_math_verify", [True, False])
def test_final_number_scoring(with_math_verify, monkeypatch):
    if with_math_verify:
        pytest.importorskip("math_verify")
    else:
        monkeypatch.setitem(sys.modules, "math_verify", None)
    assert _score_number("so 5 + 7 = 12\n#### 288", "288") == 1.0
    assert _score_number("The total is 288.", "288") == 1.0
    assert _score_number("288.0", "288") == 1.0
    assert _score_number("it is -3", "-3") == 1.0
    assert _score_number("288 then 289", "288") == 0.0
    assert _score_number("no number", "288") == 0.0
    assert _score_number("", "288") == 0.0
    # Rewards are often computed in worker threads.
    with ThreadPoolExecutor(2) as pool:
        assert list(pool.map(_score_number, ["#### 288", "#### 289"], ["288"] * 2)) == [1.0, 0.0]


# --- CharTokenizer ----------------------------------------------------------------------------


@given(st.text(alphabet=DEFAULT_ALPHABET, max_size=40))
def test_char_tokenizer_round_trip(text):
    tok = CharTokenizer()
    ids = tok.encode(text)
    assert len(ids) == len(text)
    assert all(3 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode([tok.bos_id, *ids, tok.eos_id, *tok.encode("123")]) == text
    assert tok.decode(torch.tensor([tok.bos_id, *ids, tok.pad_id, tok.pad_id])) == text


def test_char_tokenizer_layout_and_errors():
    tok = CharTokenizer("ab")
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.vocab_size) == (0, 1, 2, 5)
    assert tok.encode("ba") == [4, 3]
    assert tok.decode([tok.eos_id, 3]) == ""
    with pytest.raises(ValueError, match=r"'c'.*'ab'"):
        tok.encode("abc")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([3, 5])
    for bad in ["", "aa"]:
        with pytest.raises(ValueError):
            CharTokenizer(bad)


def test_char_tokenizer_save_load(tmp_path):
    tok = CharTokenizer("0123456789+-=xy")
    tok.save(tmp_path / "tok.json")
    back = CharTokenizer.load(tmp_path / "tok.json")
    assert back == tok and back.vocab_size == tok.vocab_size
    assert back.encode("12+x=") == tok.encode("12+x=")
    (tmp_path / "other.json").write_text('{"type": "bpe"}')
    with pytest.raises(ValueError, match="CharTokenizer"):
        CharTokenizer.load(tmp_path / "other.json")


@pytest.mark.parametrize("level", range(1, 7))
def test_default_alphabet_covers_arithmetic(level):
    tok, task = CharTokenizer(), load_task("arithmetic", level=level)
    for ex in take(task, 0, 200) + task.test_set():
        assert tok.decode(tok.encode(ex.prompt + ex.answer)) == ex.prompt + ex.answer
