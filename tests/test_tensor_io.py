"""NVFP4Tensor: construction checks, device moves, and the safetensors round trip (atomic)."""

import json
import os
import re

import pytest
import torch

import fp4stack
from fp4stack import NVFP4Tensor, QuantSpec


def randn(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g)


def assert_same(a: NVFP4Tensor, b: NVFP4Tensor):
    assert torch.equal(a.data, b.data)
    assert torch.equal(a.scales.view(torch.uint8), b.scales.view(torch.uint8))
    assert a.amax.dtype == b.amax.dtype == torch.float32
    assert torch.equal(a.amax.view(torch.int32), b.amax.view(torch.int32))
    assert a.shape == b.shape and a.spec == b.spec


@pytest.mark.parametrize(
    "shape,opts",
    [
        ((16, 64), {}),
        ((3, 17, 33), {"block": (16, 16), "four_over_six": True}),
        ((5, 48), {"hadamard": True, "rounding": "stochastic", "seed": 3}),
        ((7,), {"nan_policy": "propagate"}),
        ((0, 20), {}),
    ],
)
def test_save_load_round_trip(tmp_path, shape, opts):
    t = fp4stack.quantize(randn(*shape), **opts)
    path = tmp_path / "w.safetensors"
    t.save(path)
    back = NVFP4Tensor.load(path)
    assert_same(back, t)
    assert torch.equal(fp4stack.dequantize(back), fp4stack.dequantize(t))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.safetensors"]  # no temp file left


def test_saved_file_is_plain_safetensors(tmp_path):
    from safetensors import safe_open

    t = fp4stack.quantize(randn(4, 32), block=(16, 16))
    t.save(tmp_path / "w.safetensors")
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as f:
        assert set(f.keys()) == {"data", "scales", "amax"}
        meta = f.metadata()
        assert f.get_tensor("scales").dtype == torch.float8_e4m3fn
    assert meta["format"] == "nvfp4"
    assert json.loads(meta["shape"]) == [4, 32]
    assert json.loads(meta["spec"])["block"] == [16, 16]


def test_save_overwrites_atomically(tmp_path):
    path = tmp_path / "w.safetensors"
    first = fp4stack.quantize(randn(8, 32, seed=1))
    second = fp4stack.quantize(randn(8, 32, seed=2))
    first.save(path)
    second.save(path)
    assert_same(NVFP4Tensor.load(path), second)
    assert [p.name for p in tmp_path.iterdir()] == ["w.safetensors"]


def test_failed_save_keeps_the_existing_file(tmp_path, monkeypatch):
    import safetensors.torch

    path = tmp_path / "w.safetensors"
    old = fp4stack.quantize(randn(8, 32, seed=1))
    old.save(path)
    before = path.read_bytes()

    def broken_save_file(tensors, filename, metadata=None):
        with open(filename, "wb") as f:  # a partial write, then the crash
            f.write(b"\x00garbage")
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", broken_save_file)
    with pytest.raises(OSError, match="disk full"):
        fp4stack.quantize(randn(8, 32, seed=2)).save(path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["w.safetensors"]
    monkeypatch.undo()
    assert_same(NVFP4Tensor.load(path), old)


def test_failed_save_leaves_nothing_when_no_file_existed(tmp_path, monkeypatch):
    import safetensors.torch

    def broken_save_file(tensors, filename, metadata=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_file", broken_save_file)
    with pytest.raises(KeyboardInterrupt):
        fp4stack.quantize(randn(4, 16)).save(tmp_path / "w.safetensors")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("mask,mode", [(0o022, 0o644), (0o027, 0o640)])
def test_saved_file_follows_the_umask(tmp_path, mask, mode):
    old = os.umask(mask)
    try:
        fp4stack.quantize(randn(4, 16)).save(tmp_path / "w.safetensors")
    finally:
        os.umask(old)
    assert (tmp_path / "w.safetensors").stat().st_mode & 0o777 == mode


def test_the_next_save_removes_a_killed_saves_temporary_file(tmp_path):
    stale = tmp_path / ".w.safetensors.4242.0123abcd.tmp"  # what a kill -9 mid-save leaves
    stale.write_bytes(b"\x00half a tensor")
    other = tmp_path / ".v.safetensors.4242.0123abcd.tmp"  # another file's: not this save's
    other.write_bytes(b"")
    fp4stack.quantize(randn(4, 16)).save(tmp_path / "w.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == [other.name, "w.safetensors"]


def test_loading_a_foreign_safetensors_file_is_a_clear_error(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "model.safetensors"
    save_file({"weight": torch.zeros(4, 4)}, str(path))
    with pytest.raises(ValueError, match="not an fp4stack NVFP4 tensor file"):
        NVFP4Tensor.load(path)
    save_file({"weight": torch.zeros(4, 4)}, str(path), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="not an fp4stack NVFP4 tensor file"):
        NVFP4Tensor.load(path)


def write_file(path, tensors=None, meta=None) -> None:
    """A tensor file as `save` writes it, with some tensors or metadata fields replaced (None
    removes one)."""
    from safetensors.torch import save_file

    t = fp4stack.quantize(randn(4, 32))
    header = {k: v for k, v in {**t.metadata(), **(meta or {})}.items() if v is not None}
    tensors = {k: v for k, v in {**t.state_dict(), **(tensors or {})}.items() if v is not None}
    save_file(tensors, str(path), metadata=header)


def e4m3(*raw: int) -> torch.Tensor:
    return torch.tensor([raw] * 4, dtype=torch.uint8).view(torch.float8_e4m3fn)


@pytest.mark.parametrize(
    "tensors,meta,match",
    [
        ({"amax": torch.tensor(float("nan"))}, None, "amax must be finite and >= 0, got nan"),
        ({"amax": torch.tensor(-2.0)}, None, "amax must be finite and >= 0, got -2.0"),
        ({"amax": torch.tensor(float("inf"))}, None, "amax must be finite and >= 0, got inf"),
        ({"scales": e4m3(0x38, 0x7F)}, None, r"scales must be finite .*nan at index \(0, 1\)"),
        ({"scales": e4m3(0xB8, 0x38)}, None, r"scales must be finite .*-1.0 at index \(0, 0\)"),
        ({"amax": torch.tensor([1.0])}, None, "NVFP4Tensor.amax must be a float32 0-d"),
        ({"data": torch.zeros(4, 8, dtype=torch.uint8)}, None, "NVFP4Tensor.data must be uint8 of"),
        ({"amax": None}, None, r"missing tensors \['amax'\]"),
        (None, {"spec": None}, "metadata field 'spec' is missing"),
        (None, {"spec": "{"}, "metadata field 'spec' is not valid JSON"),
        (None, {"spec": "[]"}, "metadata field 'spec' must be a dict"),
        (None, {"spec": '{"rounding": "up"}'}, "invalid metadata field 'spec': .*rounding"),
        (None, {"spec": '{"colour": 1}'}, "invalid metadata field 'spec': .*colour"),
        (None, {"spec": '{"format": "fp8", "block": [-1, -1]}'},
         "metadata field 'spec' has format='fp8'"),
        (None, {"shape": None}, "metadata field 'shape' is missing"),
        (None, {"shape": "[4, -32]"}, "metadata field 'shape' must be a list of sizes"),
    ],
)
def test_load_checks_what_it_reads_and_names_the_file_and_field(tmp_path, tensors, meta, match):
    path = tmp_path / "w.safetensors"
    write_file(path, tensors, meta)
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))}: {match}"):
        NVFP4Tensor.load(path)


def test_load_names_a_truncated_or_unreadable_file(tmp_path):
    path = tmp_path / "w.safetensors"
    fp4stack.quantize(randn(4, 32)).save(path)
    data = path.read_bytes()
    for cut in (data[:-8], data[:5], b""):
        path.write_bytes(cut)
        with pytest.raises(ValueError, match="not a safetensors file or truncated: "
                                             f"{re.escape(str(path))}"):
            NVFP4Tensor.load(path)
    with pytest.raises(ValueError, match=f"truncated: {re.escape(str(tmp_path))} "):
        NVFP4Tensor.load(tmp_path)  # a directory: a bare OSError from the reader


def good_parts(shape=(4, 20)):
    t = fp4stack.quantize(randn(*shape))
    return dict(data=t.data, scales=t.scales, amax=t.amax, shape=t.shape, spec=t.spec)


@pytest.mark.parametrize(
    "change,match",
    [
        ({"data": torch.zeros(4, 10, dtype=torch.uint8)}, r"data must be uint8 of shape \(4, 16\)"),
        ({"data": torch.zeros(4, 16, dtype=torch.int8)}, "data must be uint8"),
        ({"scales": torch.zeros(4, 2)}, "scales must be float8_e4m3fn"),
        ({"scales": torch.zeros(4, 3, dtype=torch.float8_e4m3fn)}, r"shape \(4, 2\)"),
        ({"amax": torch.tensor([1.0])}, "NVFP4Tensor.amax must be a float32 0-d"),
        ({"amax": torch.tensor(1.0, dtype=torch.float64)}, "amax must be a float32"),
        ({"shape": ()}, "at least one dim"),
        ({"shape": (4, 40)}, "data must be uint8 of shape"),
    ],
)
def test_constructor_validation(change, match):
    with pytest.raises(ValueError, match=match):
        NVFP4Tensor(**{**good_parts(), **change})


def test_constructor_accepts_valid_parts_and_normalizes_shape():
    parts = good_parts()
    t = NVFP4Tensor(**{**parts, "shape": [4, 20]})
    assert t.shape == torch.Size([4, 20])
    assert t.nbytes == 4 * 16 + 4 * 2 + 4
    with pytest.raises(AttributeError):
        t.amax = torch.tensor(2.0)  # frozen


def test_to_cpu():
    t = fp4stack.quantize(randn(6, 48), four_over_six=True)
    moved = t.to("cpu")
    assert moved.device == torch.device("cpu")
    assert_same(moved, t)


def test_dequantize_goes_through_the_backend_dispatch(monkeypatch):
    # One way to read an NVFP4Tensor back: fp4stack.dequantize, which picks the backend of the
    # tensor's device (Triton for CUDA tensors); the data class itself knows no backend.
    from fp4stack import kernels, ops

    t = fp4stack.quantize(randn(4, 32))
    assert not hasattr(t, "dequantize")
    calls = []
    monkeypatch.setattr(ops, "backend_for", lambda device: "triton")
    monkeypatch.setattr(kernels, "dequantize", lambda t, dtype: calls.append(dtype) or "kernel")
    assert fp4stack.dequantize(t, torch.bfloat16) == "kernel" and calls == [torch.bfloat16]


def test_decode_scale_is_amax_times_reciprocal():
    # amax * (1 / 2688), not amax / 2688 (they differ in the last bit for some amax).
    for spec, denom in ((QuantSpec(), 2688.0), (QuantSpec(four_over_six=True), 1536.0)):
        t = fp4stack.quantize(randn(4, 32) * 3.3, spec=spec)
        want = t.amax * torch.tensor(1.0 / denom, dtype=torch.float32)
        assert torch.equal(t.decode_scale, want)
    found = False
    for a in torch.linspace(1.0, 2.0, 2001):
        if (a * torch.tensor(1 / 2688.0)).item() != (a / 2688.0).item():
            found = True
            break
    assert found, "the two formulas should differ somewhere (else the doc note is moot)"
