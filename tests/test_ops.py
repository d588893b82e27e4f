"""fp4stack's custom ops: schemas and fake implementations (torch.library.opcheck), the same bits
as the functions they wrap, and stochastic-rounding seeds as tensors (the same draws as ints)."""

import pytest
import torch

import fp4stack
from fp4stack import ops
from fp4stack.api import global_amax
from fp4stack.formats import nvfp4 as reference
from fp4stack.formats import random as rnd
from fp4stack.formats.spec import QuantSpec
from fp4stack.nn import grouped_experts as ge
from fp4stack.nn.lowrank import count_and_refresh, lowrank_factors
from fp4stack.nn.recipe import recipe

SPECS = [QuantSpec(), QuantSpec(block=(16, 16)), QuantSpec(rounding="stochastic"),
         QuantSpec(four_over_six=True, nan_policy="propagate"), QuantSpec(hadamard=True),
         QuantSpec.fp8("row"), QuantSpec(global_scale="row"),
         QuantSpec(global_scale="row", hadamard=True, rounding="stochastic", four_over_six=True)]


def data(shape=(32, 48), seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: ops.spec_key(s))
def test_spec_key_round_trips(spec):
    assert ops.spec_from_key(ops.spec_key(spec)) == spec


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: ops.spec_key(s))
def test_quantizer_ops_pass_opcheck_and_give_the_reference_bits(spec):
    x, key = data(), ops.spec_key(spec)
    seed = torch.tensor(12345) if spec.rounding == "stochastic" else None
    imposed = None if spec.row_scaled else torch.tensor(5.0)  # a row's amax is its own
    for amax, dtype in ((None, None), (imposed, torch.bfloat16)):
        torch.library.opcheck(ops.fake_quantize_op, (x, key, amax, seed, "x", dtype))
        got = ops.fake_quantize_op(x, key, amax, seed, "x", dtype)
        want = fp4stack.fake_quantize(x, spec=spec, amax=amax, dtype=dtype,
                                      seed=None if seed is None else 12345)
        assert torch.equal(got, want) and got.dtype == want.dtype
    if spec.format != "nvfp4":
        return
    torch.library.opcheck(ops.quantize_op, (x, key, None, seed, "x"))
    data_, scales, amax = ops.quantize_op(x, key, None, seed, "x")
    t = reference.quantize(x, spec, seed=None if seed is None else 12345)
    assert torch.equal(data_, t.data) and torch.equal(scales, t.scales.view(torch.uint8))
    assert torch.equal(amax, t.amax)
    args = (data_, scales, amax, list(x.shape), key, torch.float32)
    torch.library.opcheck(ops.dequantize_op, args)
    assert torch.equal(ops.dequantize_op(*args), reference.dequantize(t))


@pytest.mark.parametrize("pair", [(QuantSpec(), QuantSpec(hadamard=True)),
                                  (QuantSpec(rounding="stochastic", nan_policy="propagate"),
                                   QuantSpec(hadamard=True, rounding="stochastic",
                                             nan_policy="propagate"))], ids=["rne", "sr"])
def test_pair_op_passes_opcheck_and_gives_the_two_calls_bits(pair):
    spec, spec_t = pair
    x = data((40, 48))
    seeds = ((torch.tensor(3), torch.tensor(4)) if spec.rounding == "stochastic"
             else (None, None))
    args = (x, ops.spec_key(spec), ops.spec_key(spec_t), None, None, *seeds, 48, "x",
            torch.bfloat16)
    torch.library.opcheck(ops.fake_quantize_pair_op, args)
    got, got_t = ops.fake_quantize_pair_op(*args)
    s1, s2 = (None, None) if seeds[0] is None else (3, 4)
    want = fp4stack.fake_quantize(x, spec=spec, seed=s1, dtype=torch.bfloat16)
    want_t = fp4stack.fake_quantize(torch.nn.functional.pad(x.t(), (0, 8)), spec=spec_t, seed=s2,
                                    dtype=torch.bfloat16)
    assert torch.equal(got, want) and torch.equal(got_t, want_t) and got_t.shape == (48, 48)


def test_an_imposed_amax_comes_back_as_a_new_tensor():
    amax = torch.tensor(4.0)
    _, _, got = ops.quantize_op(data(), ops.spec_key(QuantSpec()), amax, None, "x")
    assert torch.equal(got, amax) and got.data_ptr() != amax.data_ptr()


@pytest.mark.parametrize("hadamard", [False, True])
def test_global_amax_op(hadamard):
    x = data((8, 32))
    torch.library.opcheck(ops.global_amax_op, (x, hadamard))
    want = reference.quantize(x, QuantSpec(hadamard=hadamard)).amax  # what quantize scales by
    assert torch.equal(global_amax(x, hadamard=hadamard), want)
    x[3, 5] = float("nan")
    assert global_amax(x).isnan()


@pytest.mark.parametrize("seed", [0, 1, 2**32 + 3, 2**62 - 1, 2**63 - 1, 2**64 + 9, -5])
def test_a_seed_tensor_draws_what_its_int_draws(seed):
    index = torch.arange(4096)
    as_tensor = ops.seed_tensor(seed)
    assert torch.equal(rnd.uniform(index, seed), rnd.uniform(index, as_tensor))
    spec = QuantSpec(rounding="stochastic")
    assert torch.equal(fp4stack.fake_quantize(data(), spec=spec, seed=seed),
                       fp4stack.fake_quantize(data(), spec=spec, seed=as_tensor))


def test_the_tensor_draw_is_draw_seeds_draw():
    torch.manual_seed(3)
    ints = [rnd.draw_seed() for _ in range(3)]
    torch.manual_seed(3)
    tensors = [rnd.draw_seed_tensor() for _ in range(3)]
    assert ints == [int(t) for t in tensors] and all(t.dtype == torch.int64 for t in tensors)


def test_compiled_stochastic_rounding_draws_eagers_seeds():
    # The draw is a node of the compiled graph: after the same manual_seed, the same bits.
    spec = QuantSpec(rounding="stochastic", nan_policy="propagate")
    fn = lambda x: fp4stack.fake_quantize(x, spec=spec) * 2  # noqa: E731
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    x = data()
    torch.manual_seed(5)
    eager = [fn(x), fn(x)]
    torch.manual_seed(5)
    assert all(torch.equal(a, compiled(x)) for a in eager)
    assert not torch.equal(eager[0], eager[1])  # two calls, two draws


def test_seed_type_errors_name_the_fix():
    with pytest.raises(TypeError, match="int64 with one element"):
        fp4stack.fake_quantize(data(), seed=torch.tensor([1.0]))


@pytest.mark.parametrize("every", [1, 3])
def test_lowrank_op_counts_and_refits_on_schedule(every):
    w = data((48, 32))
    spec = QuantSpec(nan_policy="propagate")
    a0, b0 = torch.zeros(4, 32), torch.zeros(48, 4)
    args = (torch.zeros((), dtype=torch.int64), a0.clone(), b0.clone(), w, every,
            ops.spec_key(spec))
    torch.library.opcheck(count_and_refresh, args)
    count, a, b = torch.zeros((), dtype=torch.int64), a0.clone(), b0.clone()
    want_a, want_b = lowrank_factors(w, spec, 4)
    for n in range(1, 4):
        count_and_refresh(count, a, b, w, every, ops.spec_key(spec))
        assert int(count) == n
        refit = n >= every
        assert torch.equal(a, want_a if refit else a0) and torch.equal(b, want_b if refit else b0)


@pytest.mark.parametrize("name", [None, "nvfp4", "nvfp4-nvidia"])
def test_grouped_expert_ops_pass_opcheck(name):
    rec = None if name is None else recipe(name)
    x, w = data((12, 32)), data((3, 48, 32), seed=1) / 10
    counts = torch.tensor([5, 0, 7])
    seeds = torch.randint(0, 2**62, (3, 6)) if ge.stochastic(rec) else None
    key = ge.recipe_key(rec)
    torch.library.opcheck(ge.grouped_linear, (x.requires_grad_(), w.requires_grad_(), counts,
                                              None, seeds, key, torch.float32))
    dy = data((12, 48), seed=2)
    torch.library.opcheck(ge.grouped_linear_backward,
                          (dy, x.detach(), w.detach(), counts, None, seeds, key, torch.float32))
    # Eager callers pass the counts read on the host already.
    torch.library.opcheck(ge.grouped_linear, (x, w, counts, None, seeds, key, torch.float32,
                                              counts.tolist()))
    torch.library.opcheck(ge.grouped_linear_backward, (dy, x.detach(), w.detach(), counts, None,
                                                       seeds, key, torch.float32, [5, 0, 7]))


@pytest.mark.parametrize("hadamard", [False, True])
def test_the_kernels_take_tensor_seeds_and_give_the_amax(hadamard):
    # On the GPU, or under the Triton interpreter on the CPU.
    pytest.importorskip("triton")
    from fp4stack.kernels import nvfp4 as kernels

    x = data((16, 32)).to("cuda" if torch.cuda.is_available() else "cpu")
    spec = QuantSpec(rounding="stochastic", hadamard=hadamard)
    got = kernels.fake_quantize(x, spec, seed=ops.seed_tensor(2**63 - 1))
    assert torch.equal(got, reference.fake_quantize(x, spec, seed=2**63 - 1))
    assert torch.equal(kernels.global_amax(x, hadamard), global_amax(x, hadamard=hadamard))
