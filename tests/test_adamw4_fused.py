"""AdamW4's fused Triton step (fp4stack/kernels/adamw4.py) against its reference step, bit for bit.

On the CPU the kernel runs under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET),
so the shapes are small: about 70 ms per program and pass. With CUDA, the same tests also run on
the GPU with larger shapes.
"""

from __future__ import annotations

import io
import os

import pytest
import torch

import fp4stack.kernels.adamw4 as fused_kernels
import fp4stack.kernels.adamw4_step as fused_launch
from fp4stack.optim import AdamW4, StateFormat

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = (["cpu"] if INTERPRETED else []) + (["cuda"] if torch.cuda.is_available() else [])
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # for the tests run on one device
CHECK_AFTER = (1, 2, 5)
# The interpreter divides by zero where the kernel then selects another value.
pytestmark = [pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning"),
              pytest.mark.usefixtures("one_thread")]


def randn(*shape, seed=0, device="cpu"):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device)


def make_grad(shape, seed, device, decades=0.0, spike=False):
    """A gradient whose 16-element blocks' scales span `decades` decades at random (0: all
    alike), with one row all zero; `spike`: 1000x larger at scattered elements (the stored
    moments saturate: see test_adamw4.py)."""
    g = randn(*shape, seed=seed)
    if spike:
        g[torch.rand(shape, generator=torch.Generator().manual_seed(seed)) < 0.05] *= 1000
    if decades:
        g2 = g.reshape(-1, shape[-1] // 16, 16)
        u = torch.rand(g2.shape[:2], generator=torch.Generator().manual_seed(seed + 1))
        g2 *= (10.0 ** (-decades * u))[:, :, None]
        g2[g2.shape[0] // 2] = 0
    return g.to(device)


def twin_runs(groups_of_shapes, group_options, device, steps, grad_pattern=None, decades=0.0,
              spike_step=None, **options):
    """Yield (step, fused optimizer, reference optimizer) after each step of two optimizers that
    differ only in `fused`, fed the same gradients. grad_pattern(step, i) False leaves param i
    without a gradient at that step; at `spike_step` the gradients spike (make_grad)."""
    optimizers = []
    for fused in (True, False):
        groups, k = [], 0
        for shapes, extra in zip(groups_of_shapes, group_options, strict=True):
            params = [torch.nn.Parameter(randn(*s, seed=100 + k + i, device=device))
                      for i, s in enumerate(shapes)]
            k += len(shapes)
            groups.append({"params": params, **extra})
        optimizers.append(AdamW4(groups, fused=fused, **options))
    for step in range(1, steps + 1):
        for opt in optimizers:
            params = [p for g in opt.param_groups for p in g["params"]]
            for i, p in enumerate(params):
                keep = grad_pattern is None or grad_pattern(step, i)
                p.grad = make_grad(p.shape, 1000 * step + i, device, decades,
                                   spike=step == spike_step) if keep else None
            opt.step()
        yield step, optimizers[0], optimizers[1]


def bits(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def assert_same(fused, reference):
    """Parameters and every state tensor equal bit for bit (torch.equal)."""
    pf = [p for g in fused.param_groups for p in g["params"]]
    pr = [p for g in reference.param_groups for p in g["params"]]
    for i, (a, b) in enumerate(zip(pf, pr, strict=True)):
        assert torch.equal(a, b), f"param {i} {tuple(a.shape)}: max diff {(a - b).abs().max()}"
        sa, sb = fused.state[a], reference.state[b]
        assert sa.keys() == sb.keys()
        for key in sb:
            assert sa[key].dtype == sb[key].dtype and sa[key].shape == sb[key].shape, key
            assert torch.equal(bits(sa[key]), bits(sb[key])), f"param {i}: state {key} differs"


@pytest.fixture
def mid_tiles(monkeypatch):
    """Under the interpreter, whose cost is per tile and program rather than per element, tiles
    of 16 rows x 4 blocks, two to a program: the shapes of a test still span several tiles
    each way, with partial ones at the edges. Only test_fused_equals_reference_with_full_tiles
    keeps the compiled default tiles on the CPU (the GPU runs every test with them)."""
    if not INTERPRETED:
        return
    monkeypatch.setattr(fused_kernels, "BM", 16)
    monkeypatch.setattr(fused_kernels, "KB", 4)
    monkeypatch.setattr(fused_kernels, "STEP_ITERS", 2)


@pytest.fixture
def wide_tiles(monkeypatch):
    """Fewer, larger programs still, for the tests below whose tensors are small."""
    if not INTERPRETED:
        return
    monkeypatch.setattr(fused_kernels, "BM", 32)
    monkeypatch.setattr(fused_kernels, "KB", 16)
    monkeypatch.setattr(fused_kernels, "STEP_ITERS", 2)


def shapes_for(device):
    if device == "cpu":
        # A 3-D param, rows not a multiple of the tile (and more than one sums tile of rows),
        # last dims 16 and 80 (5 blocks), 1-D and small params with fp32 states (min_numel=256).
        return [(72, 48), (3, 6, 160), (20, 16), (33, 80), (48,), (8, 16)]
    return [(1000, 48), (3, 50, 160), (300, 16), (333, 1040), (48,), (8, 16), (64, 4096)]


@pytest.mark.parametrize("device", DEVICES)
def test_fused_equals_reference_for_assorted_shapes(device, mid_tiles):
    # A large lr, so that an ulp of the update shows in the parameters.
    runs = twin_runs([shapes_for(device)], [{}], device, max(CHECK_AFTER), min_numel=256, lr=0.3)
    for step, fused, reference in runs:
        if step in CHECK_AFTER:
            assert_same(fused, reference)
    assert "exp_avg_sq_row" in fused.state[fused.param_groups[0]["params"][1]]
    assert "exp_avg" in fused.state[fused.param_groups[0]["params"][4]]  # fp32 fallback


@pytest.mark.parametrize("device", DEVICES)
def test_fused_equals_reference_with_full_tiles(device):
    # Every tile full (rows a multiple of the step and sums tiles', blocks of KB): the kernels
    # drop their masks.
    scale = 1 if device == "cpu" else 16
    shapes = [(64 * scale, 128), (64, 256 * scale)]
    runs = twin_runs([shapes], [{}], device, 3, min_numel=0, lr=0.3)
    for _, fused, reference in runs:
        assert_same(fused, reference)
    assert all(plan.even and plan.even_sums for plan in fused._plans.values())


@pytest.mark.parametrize("device", DEVICES)
def test_fused_follows_the_lr_and_gradients_that_move(device, mid_tiles):
    # A schedule changes the lr every step and the gradients sometimes land at new addresses:
    # the per-step scalars and the gradient table are read from device memory, so the launches
    # (on CUDA replayed from a CUDA graph from the third step) see the new ones.
    shapes = [(16, 128), (24, 64)] if device == "cpu" else [(256, 1024), (96, 640)]
    optimizers, params = [], []
    for fused in (True, False):
        ps = [torch.nn.Parameter(randn(*s, seed=i, device=device)) for i, s in enumerate(shapes)]
        optimizers.append(AdamW4(ps, lr=0.1, min_numel=0, fused=fused))
        params.append(ps)
    keep = []
    for step in range(1, 7):
        for opt, ps in zip(optimizers, params, strict=True):
            opt.param_groups[0]["lr"] = 0.1 / step
            for i, p in enumerate(ps):
                if step % 2:  # fresh storage, kept alive: a new address
                    keep.append(torch.empty(1 << 12, device=device))
                p.grad = make_grad(p.shape, 100 * step + i, device)
            opt.step()
        assert_same(*optimizers)
    if device == "cuda":
        assert any(plan.graphs for plan in optimizers[0]._plans.values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_graph_replays_equal_eager_launches():
    shapes = [(512, 768), (300, 1024)]
    results = []
    for graphs in (True, False):
        ps = [torch.nn.Parameter(randn(*s, seed=i, device="cuda")) for i, s in enumerate(shapes)]
        opt = AdamW4(ps, lr=1e-2, min_numel=0, fused=True, cuda_graphs=graphs)
        for step in range(1, 6):
            for i, p in enumerate(ps):
                p.grad = make_grad(p.shape, 10 * step + i, "cuda", decades=4.0)
            opt.step()
        assert bool(any(plan.graphs for plan in opt._plans.values())) == graphs
        results.append(opt)
    assert_same(*results)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_scalars_stay_right_with_the_host_far_ahead_of_the_gpu():
    # The per-step scalars go up from a ring of pinned buffers: queue more steps than it has
    # slots behind a long GPU sleep, the lr changing every step, so that a slot is reused while
    # earlier copies may not have run yet.
    from fp4stack.kernels.adamw4_step import SCALAR_SLOTS

    steps = 2 * SCALAR_SLOTS + 3
    grads = [make_grad((64, 256), step, "cuda") for step in range(steps)]
    results = []
    for fused in (True, False):
        p = torch.nn.Parameter(randn(64, 256, device="cuda"))
        opt = AdamW4([p], lr=0.1, min_numel=0, fused=fused)
        torch.cuda.synchronize()
        torch.cuda._sleep(int(1e9))
        for step in range(steps):
            opt.param_groups[0]["lr"] = 0.1 / (step + 1)
            p.grad = grads[step]
            opt.step()
        torch.cuda.synchronize()
        results.append(opt)
    assert_same(*results)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_step_inside_a_graph_capture_is_an_error():
    p = torch.nn.Parameter(randn(64, 256, device="cuda"))
    p.grad = randn(64, 256, seed=1, device="cuda")
    opt = AdamW4([p], min_numel=0, fused=True)
    opt.step()
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match="outside"), torch.cuda.graph(torch.cuda.CUDAGraph()):
        opt.step()


@pytest.mark.parametrize("device", DEVICES)
def test_fused_equals_reference_across_groups_and_missing_grads(device, wide_tiles):
    scale = 1 if device == "cpu" else 20
    shapes_a = [(24 * scale, 32), (16, 64 * scale), (10, 16)]
    shapes_b = [(32 * scale, 48), (64,)]
    # Param 1 has no gradient at step 2 (so its step count falls behind, and it is launched
    # apart from the others afterwards); param 3 never has one.
    def pattern(step, i):
        return not (i == 1 and step == 2) and i != 3

    runs = twin_runs([shapes_a, shapes_b],
                     [{"lr": 3e-3, "weight_decay": 0.1}, {"lr": 1e-2, "weight_decay": 0.0}],
                     device, max(CHECK_AFTER), grad_pattern=pattern, min_numel=128, seed=7,
                     state_format=StateFormat(headroom=2.0))
    for step, fused, reference in runs:
        if step in CHECK_AFTER:
            assert_same(fused, reference)
    p1, p3 = fused.param_groups[0]["params"][1], fused.param_groups[1]["params"][0]
    assert fused.state[p1]["step"].item() == 4 and not fused.state[p3]


@pytest.mark.parametrize("device", DEVICES)
def test_fused_equals_reference_when_rows_span_decades(device, wide_tiles):
    # Block scales over 8 decades (no rank-1 estimate removes them) and an all-zero row: zero
    # codes lifted to the block floor, zero block scales, zero rows of v (a zero estimate);
    # and at step 4 a spike that saturates the stored moments.
    shapes = [(32, 64), (20, 48)] if device == "cpu" else [(512, 768), (300, 1024)]
    runs = twin_runs([shapes], [{}], device, max(CHECK_AFTER), decades=8.0, spike_step=4,
                     min_numel=0, lr=1e-2)
    for step, fused, reference in runs:
        if step in CHECK_AFTER:
            assert_same(fused, reference)
    scales = fused.state[fused.param_groups[0]["params"][0]]["exp_avg_sq_scales"]
    assert (scales.float() == 0).any()  # the case the zero-scale bound is for


def test_fused_path_is_taken_and_the_reference_is_not(monkeypatch, wide_tiles):
    calls = []
    real = fused_launch.fused_step
    monkeypatch.setattr(fused_launch, "fused_step",
                        lambda *a, **k: calls.append(len(a[0])) or real(*a, **k))

    def refuse(*args):
        raise AssertionError("reference step taken")

    monkeypatch.setattr(AdamW4, "_step_param", refuse)
    params = [torch.nn.Parameter(randn(32, 64, seed=i, device=DEV)) for i in range(3)]
    opt = AdamW4(params, fused=True, min_numel=0)
    for p in params:
        p.grad = randn(32, 64, seed=9, device=DEV)
    opt.step()
    assert calls == [3]  # the three tensors in one fused step


def test_fused_none_on_the_cpu_takes_the_reference(monkeypatch):
    monkeypatch.setattr(fused_launch, "fused_step", None)  # would fail if called
    p = torch.nn.Parameter(randn(32, 64))
    p.grad = randn(32, 64, seed=1)
    opt = AdamW4([p], min_numel=0)
    opt.step()
    assert "exp_avg_data" in opt.state[p]


@pytest.mark.parametrize("options, match", [
    (dict(transform="sqrt"), "transform='rank1'"),
    (dict(rounding="rne"), "rounding='stochastic'"),
    (dict(first_moment="direct"), "first_moment='normalized'"),
    (dict(scaling="current"), "scaling='delayed'"),
])
def test_fused_true_with_other_settings_raises(options, match):
    with pytest.raises(ValueError, match=match):
        AdamW4([torch.nn.Parameter(torch.zeros(32, 64))], fused=True,
               state_format=StateFormat(**options))


def test_fused_true_with_a_bf16_param_raises():
    p = torch.nn.Parameter(torch.zeros(32, 64, dtype=torch.bfloat16, device=DEV))
    p.grad = torch.ones_like(p)
    opt = AdamW4([p], fused=True, min_numel=0)
    with pytest.raises(ValueError, match="float32"):
        opt.step()


def test_fused_true_on_the_cpu_without_the_interpreter_raises(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    p = torch.nn.Parameter(torch.zeros(32, 64))
    p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match="CUDA"):
        AdamW4([p], fused=True, min_numel=0).step()


def test_state_dict_moves_between_the_two_paths(wide_tiles):
    # Two fused steps, saved, reloaded into a reference optimizer and a fused one: the next
    # step agrees, and the saved layout is the reference's.
    shapes = [(32, 64), (16, 48)]
    *_, (_, fused, reference) = twin_runs([shapes], [{}], DEV, 2, min_numel=0)
    assert_same(fused, reference)
    buf = io.BytesIO()
    torch.save(fused.state_dict(), buf)
    saved = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    assert saved["param_groups"] == reference.state_dict()["param_groups"]
    params = [p for g in fused.param_groups for p in g["params"]]
    resumed = []
    for fused_flag in (True, False):
        copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
        opt = AdamW4(copies, min_numel=0, fused=fused_flag)
        opt.load_state_dict(saved)
        for i, c in enumerate(copies):
            c.grad = make_grad(c.shape, 77 + i, DEV)
        opt.step()
        resumed.append(opt)
    assert_same(*resumed)


def resident_bytes(opt):
    """Bytes of the tensors reachable from the optimizer's attributes other than its states,
    parameters and gradients (the fused step's spares, device tables, step counters...), each
    storage once."""
    params = [p for g in opt.param_groups for p in g["params"]]
    owned = {t.untyped_storage().data_ptr() for s in opt.state.values() for t in s.values()
             if isinstance(t, torch.Tensor)}
    owned |= {t.untyped_storage().data_ptr() for p in params
              for t in (p, p.grad) if t is not None}
    seen, storages = set(), {}
    todo = [v for k, v in vars(opt).items() if k != "state"]
    while todo:
        x = todo.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            storage = x.untyped_storage()
            if storage.data_ptr() not in owned:
                storages[storage.data_ptr()] = storage.nbytes()
        elif isinstance(x, dict):
            todo += [*x.keys(), *x.values()]
        elif isinstance(x, list | tuple | set):
            todo += list(x)
        elif type(x).__module__.startswith("fp4stack"):  # the fused step's plans
            todo += list(vars(x).values())
    return sum(storages.values())


@pytest.mark.parametrize("device", DEVICES)
def test_fused_step_keeps_no_second_set_of_states(device, wide_tiles):
    # Between steps, the fused optimizer holds its states and, besides them, only small things:
    # sums and reciprocal roots per row and column, launch tables. A spare set of NVFP4 states
    # (1.125 bytes per parameter) would exceed the bound below several times over.
    scale = 1 if device == "cpu" else 16
    shapes = [(64 * scale, 256), (48, 128 * scale), (3, 16, 64)]
    numel = sum(torch.Size(s).numel() for s in shapes)
    rows_cols = sum(torch.Size(s).numel() // s[-1] + s[-1] for s in shapes)
    # float64 sums, float32 roots and reciprocal roots per row and column; work lists (4 bytes
    # per tile of 1024 elements and of 4096); a table row, scalars and pointers per tensor.
    bound = 16 * rows_cols + 8 * numel // 1024 + 1024 * len(shapes)
    assert bound < 0.5 * 1.125 * numel
    for step, fused, reference in twin_runs([shapes], [{}], device, 3, min_numel=0, lr=0.1):
        assert_same(fused, reference)
        assert resident_bytes(fused) <= bound
        assert fused.state_bytes() == reference.state_bytes()
        if device == "cuda" and step == 3:
            # A step allocates nothing on the device that outlives it (the grads below are the
            # same size as before). The last step: the fused optimizer is one step ahead of the
            # reference after it.
            params = [p for g in fused.param_groups for p in g["params"]]
            for i, p in enumerate(params):
                p.grad = make_grad(p.shape, 5000 + step + i, device)
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            fused.step()
            torch.cuda.synchronize()
            assert torch.cuda.memory_allocated() == before
            transient = 1 << 20  # room for the caching allocator's rounding
            assert torch.cuda.max_memory_allocated() - before <= transient
