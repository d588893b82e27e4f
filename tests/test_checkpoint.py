"""save_quantized / load_quantized: compressed-tensors NVFP4 checkpoints (what vLLM loads).

Round trips are bit-exact. Against compressed-tensors itself: it unpacks to bf16 by default and
dequantizes as `code * (scale / global_scale)` (a division by the encode scale), where fp4stack
computes `code * scale * (amax * (1/2688))`. In bf16, compressed-tensors' output dtype, the two
agree bit for bit on every tensor here; in fp32 they differ by one ulp on some elements (both are
within about one ulp of the exact product), which the fp32 test pins down exactly.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch
from safetensors import safe_open
from torch import nn

import fp4stack
from fp4stack import QuantLinear, QuantSpec
from fp4stack.compressed_tensors import load_quantized, save_quantized
from fp4stack.formats import e2m1
from fp4stack.nn.fused import FUSED_GROUPS

os.environ.setdefault("HF_HUB_OFFLINE", "1")

W4A4 = fp4stack.recipe("w4a4")
QUANTIZED = ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale")


class Tiny(nn.Module):
    """Embedding, norm, three linears (one with a bias, one K=48) and a head left unquantized."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(32, 64)
        self.norm = nn.LayerNorm(64)
        self.up = nn.Linear(64, 96)
        self.mid = nn.Linear(96, 48, bias=False)
        self.down = nn.Linear(48, 64)
        self.head = nn.Linear(64, 32)
        with torch.no_grad():  # a wide dynamic range: some E4M3 block scales are subnormal
            self.mid.weight.mul_(torch.logspace(-6, 1, 48)[:, None])

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.embed(idx))
        return self.head(self.down(torch.relu(self.mid(torch.relu(self.up(h))))))


def convert(model: nn.Module, recipe, names=None, skip=("head", "lm_head")) -> nn.Module:
    """Replace linears by QuantLinear (by hand, as quantize_model does), sharing the global amax
    of q/k/v and gate/up as inference engines need, then pack for packed recipes."""
    recipe = fp4stack.recipe(recipe)
    master = recipe.with_(weight_storage="master")
    for name, mod in list(model.named_modules()):
        if isinstance(mod, nn.Linear) and not isinstance(mod, QuantLinear) \
                and not name.endswith(skip) and (names is None or name in names):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, QuantLinear.from_linear(mod, master))
    with torch.no_grad():
        for parent in model.modules():
            for group in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
                layers = [getattr(parent, g, None) for g in group]
                if all(isinstance(m, QuantLinear) for m in layers):
                    amax = torch.stack([m.weight.abs().amax() for m in layers]).amax().float()
                    for m in layers:
                        m.weight_amax = amax
    for m in model.modules():
        if isinstance(m, QuantLinear) and m.recipe is master:
            m.recipe = recipe
            if recipe.weight_storage == "packed":
                m.pack()
    return model


def calibrate(model: nn.Module, *inputs) -> None:
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    for m in layers:
        m.start_calibration()
    with torch.no_grad():
        for x in inputs:
            model(x)
    for m in layers:
        m.finish_calibration()


def quant_layers(model: nn.Module) -> dict[str, QuantLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}


def tiny_w4a4(seed: int = 0) -> nn.Module:
    model = convert(Tiny(seed), W4A4)
    calibrate(model, torch.randint(0, 32, (4, 8)))
    return model


def read(path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()  # noqa: SIM118


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def assert_same_layers(a: nn.Module, b: nn.Module) -> None:
    for (name, la), lb in zip(quant_layers(a).items(), quant_layers(b).values(), strict=True):
        ta, tb = la.packed_weight, lb.packed_weight
        assert torch.equal(ta.data, tb.data), name
        assert torch.equal(bits(ta.scales), bits(tb.scales)), name
        assert torch.equal(bits(ta.amax), bits(tb.amax)), name
        assert torch.equal(bits(la.x_amax), bits(lb.x_amax)), name


# ---- (a) round trips ---------------------------------------------------------------------------
def test_round_trip_tiny_module_is_bit_exact(tmp_path):
    model = tiny_w4a4(0)
    path = save_quantized(model, tmp_path / "ckpt")
    assert sorted(os.listdir(path)) == ["config.json", "model.safetensors"]
    fresh = convert(Tiny(seed=1), W4A4)
    load_quantized(fresh, path)
    assert_same_layers(model, fresh)
    for (k, v), w in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(bits(v), bits(w)), k
    x = torch.randint(0, 32, (3, 8))
    with torch.no_grad():
        assert torch.equal(model(x), fresh(x))


def test_layout_is_compressed_tensors_nvfp4(tmp_path):
    model = tiny_w4a4()
    tensors, meta = read(save_quantized(model, tmp_path))
    assert meta["format"] == "pt"
    up = model.up.packed_weight
    assert tensors["up.weight_packed"].dtype == torch.uint8
    assert torch.equal(tensors["up.weight_packed"], up.data)
    assert tensors["up.weight_scale"].dtype == torch.float8_e4m3fn
    assert tensors["up.weight_scale"].shape == (96, 4)
    gs = tensors["up.weight_global_scale"]
    assert gs.dtype == torch.float32 and gs.shape == (1,)
    assert gs.item() == (torch.tensor(2688.0) / up.amax).item()  # the ENCODE scale
    igs = tensors["up.input_global_scale"]
    assert igs.shape == (1,) and igs.item() == (torch.tensor(2688.0) / model.up.x_amax).item()
    assert torch.equal(tensors["up.bias"], model.up.bias)
    assert torch.equal(tensors["head.weight"], model.head.weight)  # unquantized, as it is
    assert "up.weight" not in tensors and "up.x_amax" not in tensors
    assert not any(k.endswith(("weight_data", "weight_scales", "weight_amax")) for k in tensors)


def test_master_weight_export_matches_its_forward_and_loads_packed(tmp_path):
    model = convert(Tiny(), "qat-w")
    save_quantized(model, tmp_path)
    tensors, _ = read(tmp_path)
    assert not any(k.endswith("input_global_scale") for k in tensors)  # W4A16: x unquantized
    packed = convert(Tiny(seed=3), W4A4)
    load_quantized(packed, tmp_path)
    for name, layer in quant_layers(model).items():
        want = fp4stack.quantize(layer.weight.detach(), spec=layer.recipe.w)
        assert torch.equal(tensors[f"{name}.weight_packed"], want.data)
        got = quant_layers(packed)[name].quantized_weight(torch.float32)
        assert torch.equal(bits(got), bits(layer.quantized_weight(torch.float32))), name


def test_load_into_master_layers(tmp_path):
    model = tiny_w4a4()
    save_quantized(model, tmp_path)
    master = convert(Tiny(seed=2), "qat-w")
    for m in quant_layers(master).values():
        m.weight_amax = torch.zeros(())  # a pinned amax is set to the checkpoint's
    load_quantized(master, tmp_path)
    for name, layer in quant_layers(model).items():
        m = quant_layers(master)[name]
        want = layer.quantized_weight(torch.float32)
        assert torch.equal(bits(m.weight.detach()), bits(want)), name
        # The master layer's forward re-quantizes Q(W) with the pinned amax: the same numbers
        # (a -0 may become +0), except in blocks whose E4M3 scale is subnormal, where the coarse
        # scale need not map the block max back to 6 and re-quantization can move values.
        normal = (layer.packed_weight.scales.float() >= 2.0**-6).repeat_interleave(16, -1)
        got = m.quantized_weight(torch.float32)
        assert torch.equal(got[normal], want[normal]), name
        if name == "mid":
            assert not torch.equal(got, want), "precondition: subnormal scales shift values"


def test_tied_weights_are_saved_once(tmp_path):
    def tied(seed):
        model = tiny_w4a4(seed)
        model.head.weight = model.embed.weight  # as tie_word_embeddings does
        return model

    model = tied(0)
    tensors, _ = read(save_quantized(model, tmp_path))
    assert "embed.weight" in tensors and "head.weight" not in tensors
    fresh = tied(1)
    load_quantized(fresh, tmp_path)
    assert torch.equal(fresh.head.weight, model.embed.weight)
    assert fresh.head.weight is fresh.embed.weight


@pytest.fixture(scope="module")
def llama():
    transformers = pytest.importorskip("transformers")

    def make(seed: int):
        torch.manual_seed(seed)
        cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, max_position_embeddings=64)
        return convert(transformers.LlamaForCausalLM(cfg), W4A4)

    model = make(0)
    calibrate(model, torch.randint(0, 128, (2, 16)))
    return make, model


@pytest.fixture(scope="module")
def llama_ckpt(llama, tmp_path_factory):
    _, model = llama
    path = tmp_path_factory.mktemp("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # shared q/k/v and gate/up amax: no fused-scale warning
        save_quantized(model, path)
    return path


def test_round_trip_llama(llama, llama_ckpt):
    make, model = llama
    fresh = make(1)
    load_quantized(fresh, llama_ckpt)
    assert_same_layers(model, fresh)
    idx = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        assert torch.equal(model(idx).logits, fresh(idx).logits)


# ---- (b) compressed-tensors reads the same numbers -----------------------------------------
@pytest.fixture(scope="module")
def ct():
    """compressed-tensors' modules (the tests that need it are skipped without it)."""
    pytest.importorskip("compressed_tensors")
    from types import SimpleNamespace

    import compressed_tensors.compressors.nvfp4 as nvfp4
    import compressed_tensors.quantization as quant
    import compressed_tensors.quantization.lifecycle.forward as forward
    import compressed_tensors.quantization.quant_scheme as scheme

    return SimpleNamespace(nvfp4=nvfp4, forward=forward, quant=quant, scheme=scheme)


def varied_model() -> nn.Module:
    """Tiny with 1x16 RNE, 16x16 tiles and Four Over Six weights, one layer each."""
    model = Tiny()
    convert(model, W4A4, names=("up",))
    convert(model, W4A4.with_(name="tiles", w=QuantSpec(block=(16, 16))), names=("mid",))
    convert(model, W4A4.with_(name="4/6", w=QuantSpec(four_over_six=True)), names=("down",))
    calibrate(model, torch.randint(0, 32, (4, 8)))
    return model


def test_compressed_tensors_decompressor_is_bit_exact_in_bf16(ct, tmp_path):
    model = varied_model()
    tensors, _ = read(save_quantized(model, tmp_path))
    scheme = ct.quant.QuantizationScheme(targets=["Linear"], **ct.scheme.NVFP4)
    mid = tensors["mid.weight_scale"].float()
    assert ((mid > 0) & (mid < 2.0**-6)).any(), "precondition: subnormal E4M3 block scales"
    for name, layer in quant_layers(model).items():
        sd = {k: tensors[f"{name}.{k}"] for k in QUANTIZED[:3]}
        theirs = ct.nvfp4.NVFP4PackedCompressor.decompress(sd, scheme)["weight"]
        assert theirs.dtype == torch.bfloat16  # compressed-tensors' unpack default
        ours = layer.quantized_weight(torch.float32)
        assert torch.equal(bits(theirs), bits(ours.bfloat16())), name


def test_compressed_tensors_fp32_dequantize_relation(ct, tmp_path):
    # In fp32 compressed-tensors divides by the encode scale, fp4stack multiplies by the decode
    # scale: equal up to one ulp, each exactly its own formula.
    model = varied_model()
    tensors, _ = read(save_quantized(model, tmp_path))
    args = ct.scheme.NVFP4["weights"]
    differ = 0
    for name, layer in quant_layers(model).items():
        packed, scale, gs = (tensors[f"{name}.{k}"] for k in QUANTIZED[:3])
        codes = ct.nvfp4.unpack_fp4_from_uint8(packed, *layer.packed_weight.shape,
                                              dtype=torch.float32)
        assert torch.equal(codes, e2m1.code_to_value(e2m1.unpack(packed)))
        theirs = ct.forward.dequantize(x_q=codes, scale=scale.float(), args=args,
                                       global_scale=gs, dtype=torch.float32)
        s = scale.float().repeat_interleave(16, -1)
        assert torch.equal(bits(theirs), bits(codes * (s / gs)))
        ours = layer.quantized_weight(torch.float32)
        assert torch.equal(bits(ours), bits(codes * s * layer.packed_weight.decode_scale))
        ulps = (bits(theirs).long() - bits(ours).long()).abs()
        assert ulps.max() <= 1, name
        differ += int((ulps > 0).sum())
    assert differ > 0  # the difference is real; if it vanished, tighten this test


def test_transformers_loads_it_through_compressed_tensors(ct, llama, llama_ckpt):
    transformers = pytest.importorskip("transformers")
    _, model = llama
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(llama_ckpt,
                                                                 output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    q = hf.model.layers[0].self_attn.q_proj
    assert {n for n, _ in q.named_parameters()} == set(QUANTIZED)
    hf.hf_quantizer.compressor.decompress_model(hf)
    for name, layer in quant_layers(model).items():
        got = hf.get_submodule(name).weight
        assert torch.equal(bits(got), bits(layer.quantized_weight(torch.float32).bfloat16()))
    assert torch.equal(hf.lm_head.weight, model.lm_head.weight)


# ---- (c) config.json -----------------------------------------------------------------------
def test_config_is_valid_compressed_tensors(ct, llama, llama_ckpt):
    _, model = llama
    cfg = json.loads((llama_ckpt / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["hidden_size"] == 64 and cfg["model_type"] == "llama"
    qc = ct.quant.QuantizationConfig.model_validate(cfg["quantization_config"])
    assert qc.quant_method == "compressed-tensors" and qc.format == "nvfp4-pack-quantized"
    assert qc.quantization_status == "compressed"
    assert qc.ignore == ["lm_head"]
    (group,) = qc.config_groups.values()
    assert group.targets == ["Linear"]
    preset = ct.scheme.NVFP4
    for part in ("weights", "input_activations"):
        got, want = getattr(group, part), preset[part]
        for field in ("num_bits", "type", "strategy", "group_size", "symmetric", "dynamic"):
            assert getattr(got, field) == getattr(want, field), (part, field)


def test_weight_only_and_mixed_schemes(ct, tmp_path):
    model = varied_model()
    save_quantized(model, tmp_path / "w4a16", weight_only=True)
    tensors, _ = read(tmp_path / "w4a16")
    assert not any(k.endswith("input_global_scale") for k in tensors)
    cfg = json.loads((tmp_path / "w4a16" / "config.json").read_text())["quantization_config"]
    (group,) = ct.quant.QuantizationConfig.model_validate(cfg).config_groups.values()
    assert group.input_activations is None and group.weights.strategy == "tensor_group"
    assert "architectures" not in json.loads((tmp_path / "w4a16" / "config.json").read_text())

    mixed = convert(Tiny(), W4A4, names=("up",))
    convert(mixed, "qat-w", names=("mid", "down"))
    calibrate(mixed, torch.randint(0, 32, (2, 8)))
    save_quantized(mixed, tmp_path / "mixed", config={"model_type": "tiny"})
    cfg = json.loads((tmp_path / "mixed" / "config.json").read_text())
    assert cfg["model_type"] == "tiny"
    qc = ct.quant.QuantizationConfig.model_validate(cfg["quantization_config"])
    groups = {tuple(g.targets): g.input_activations for g in qc.config_groups.values()}
    assert groups[("up",)].dynamic == "local" and groups[("mid", "down")] is None


# ---- (d) atomic writes ---------------------------------------------------------------------
def test_failed_save_leaves_nothing(tmp_path, monkeypatch):
    import safetensors.torch

    def broken(tensors, path, metadata=None):
        with open(path, "wb") as f:
            f.write(b"half a checkpoint")
        raise OSError("disk full")

    model = tiny_w4a4()
    good = save_quantized(model, tmp_path / "old")
    before = {p.name: p.read_bytes() for p in good.iterdir()}
    monkeypatch.setattr(safetensors.torch, "save_file", broken)
    with pytest.raises(OSError, match="disk full"):
        save_quantized(model, tmp_path / "new")
    assert not (tmp_path / "new").exists()
    with pytest.raises(OSError, match="disk full"):
        save_quantized(model, good)
    assert {p.name: p.read_bytes() for p in good.iterdir()} == before  # old one intact
    monkeypatch.undo()
    with pytest.raises(TypeError):  # config.json fails: no weights file appears either
        save_quantized(model, tmp_path / "cfg", config={"bad": object()})
    assert not (tmp_path / "cfg").exists()


@pytest.mark.parametrize("mask,mode", [(0o022, 0o644), (0o027, 0o640)])
def test_saved_files_follow_the_umask(tmp_path, mask, mode):
    old = os.umask(mask)
    try:
        path = save_quantized(tiny_w4a4(), tmp_path / "ckpt")
    finally:
        os.umask(old)
    assert {p.name: p.stat().st_mode & 0o777 for p in path.iterdir()} == {
        "config.json": mode, "model.safetensors": mode}


KILLED_MID_SAVE = """
import os, signal, sys
import safetensors.torch
sys.path.insert(0, os.path.dirname(sys.argv[2]))
from test_checkpoint import tiny_w4a4
from fp4stack.compressed_tensors import save_quantized

def dies(tensors, path, metadata=None):
    with open(path, "wb") as f:
        f.write(b"half a checkpoint")
    os.kill(os.getpid(), signal.SIGKILL)

safetensors.torch.save_file = dies
save_quantized(tiny_w4a4(), sys.argv[1])
"""


def test_a_save_killed_midway_leaves_temporary_files_the_next_save_removes(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    killed = subprocess.run([sys.executable, "-c", KILLED_MID_SAVE, str(ckpt), __file__],
                            capture_output=True, text=True)
    assert killed.returncode == -9, killed.stderr
    assert all(p.name.startswith(".") for p in ckpt.iterdir()) and any(ckpt.iterdir())
    save_quantized(tiny_w4a4(), ckpt)
    assert sorted(os.listdir(ckpt)) == ["config.json", "model.safetensors"]


# ---- (e) errors ----------------------------------------------------------------------------
def test_errors_on_save(tmp_path):
    with pytest.raises(ValueError, match="no QuantLinear"):
        save_quantized(Tiny(), tmp_path / "a")
    with pytest.raises(ValueError, match=r"calibrate.*weight_only"):
        save_quantized(convert(Tiny(), W4A4), tmp_path / "b")
    with pytest.raises(ValueError, match="'up': FP8 weights"):
        save_quantized(convert(Tiny(), "fp8", names=("up",)), tmp_path / "c")
    odd = convert(nn.Sequential(nn.Linear(40, 16)), "qat-w")
    with pytest.raises(ValueError, match="'0': in_features=40"):
        save_quantized(odd, tmp_path / "d")
    with pytest.raises(ValueError, match="low-rank"):
        save_quantized(convert(Tiny(), "lowrank", names=("up",)), tmp_path / "e")
    assert not any((tmp_path / d).exists() for d in "abcde")
    (tmp_path / "f").mkdir()
    (tmp_path / "f" / "model-00001-of-00002.safetensors").write_bytes(b"")
    with pytest.raises(FileExistsError, match="other weights files"):
        save_quantized(convert(Tiny(), "qat-w"), tmp_path / "f")


def test_unfused_sibling_scales_warn(tmp_path):
    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj = (nn.Linear(32, 32) for _ in range(3))

    model = nn.Sequential(Attn())
    with torch.no_grad():
        model[0].k_proj.weight.mul_(3)
    for n in ("q_proj", "k_proj", "v_proj"):  # converted one by one: no shared amax
        setattr(model[0], n, QuantLinear.from_linear(getattr(model[0], n), "qat-w"))
    with pytest.warns(UserWarning, match="different weight global scales"):
        save_quantized(model, tmp_path)


@pytest.mark.parametrize("group", FUSED_GROUPS)
def test_every_fused_group_is_shared_by_conversion_and_checked_by_the_export(tmp_path, group):
    def block():
        torch.manual_seed(0)
        parent = nn.Module()
        for i, n in enumerate(group):
            setattr(parent, n, nn.Linear(32, 32))
            with torch.no_grad():
                getattr(parent, n).weight.mul_(i + 1)
        return nn.Sequential(parent)

    unfused = block()
    for n in group:  # converted one by one: no shared amax
        setattr(unfused[0], n, QuantLinear.from_linear(getattr(unfused[0], n), "w4a4"))
    with pytest.warns(UserWarning, match="different weight global scales"):
        save_quantized(unfused, tmp_path / "unfused", weight_only=True)
    fused = block()
    fp4stack.quantize_model(fused, "w4a4")
    assert len({getattr(fused[0], n).packed_weight.amax.item() for n in group}) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        save_quantized(fused, tmp_path / "fused", weight_only=True)


def test_errors_on_load(tmp_path):
    path = save_quantized(tiny_w4a4(), tmp_path / "ckpt")
    with pytest.raises(ValueError, match="no QuantLinear"):
        load_quantized(Tiny(), path)
    partial = convert(Tiny(), W4A4, names=("up", "mid"))
    with pytest.raises(ValueError, match=r"missing keys \['down.weight'\].*unexpected keys "
                                         r"\['down.input_global_scale'"):
        load_quantized(partial, path)
    wider = convert(Tiny(), W4A4)
    wider.up = QuantLinear.from_linear(nn.Linear(64, 80), W4A4)
    before = [t.clone() for t in wider.state_dict().values()]
    with pytest.raises(ValueError, match=r"up.bias: the checkpoint has shape \(96,\), the model "
                                         r"\(80,\)"):
        load_quantized(wider, path)
    assert all(torch.equal(a, b) for a, b in zip(before, wider.state_dict().values(), strict=True))
    narrower = convert(Tiny(), W4A4)
    narrower.mid = QuantLinear.from_linear(nn.Linear(96, 32, bias=False), W4A4)
    with pytest.raises(ValueError, match=r"mid.weight_packed: the checkpoint has torch.uint8 "
                                         r"\(48, 48\), the model expects torch.uint8 \(32, 48\)"):
        load_quantized(narrower, path)
    four_six = convert(Tiny(), W4A4.with_(w=QuantSpec(four_over_six=True)))
    with pytest.raises(ValueError, match="'up'.*four_over_six"):
        load_quantized(four_six, path)
    with pytest.raises(FileNotFoundError):
        load_quantized(wider, tmp_path / "nothing")


def test_foreign_checkpoint_without_metadata(tmp_path):
    # A checkpoint of another tool (no fp4stack header): the amax comes from the global scale.
    from safetensors.torch import save_file

    model = tiny_w4a4()
    tensors, _ = read(save_quantized(model, tmp_path / "ours"))
    (tmp_path / "theirs").mkdir()
    save_file(tensors, str(tmp_path / "theirs" / "model.safetensors"), metadata={"format": "pt"})
    fresh = convert(Tiny(seed=5), W4A4)
    load_quantized(fresh, tmp_path / "theirs")
    for name, layer in quant_layers(model).items():
        got = quant_layers(fresh)[name]
        assert torch.equal(got.weight_data, layer.weight_data)
        gs = tensors[f"{name}.weight_global_scale"]
        assert got.weight_global_amax.item() == (torch.tensor(2688.0) / gs).item()
        # Within one fp32 ulp of the saved amax, so the values within an ulp or two as well.
        torch.testing.assert_close(got.quantized_weight(), layer.quantized_weight(),
                                   rtol=3e-7, atol=0)


# ---- (e) nothing read is trusted ---------------------------------------------------------------
META = "fp4stack.nvfp4"


def rewrite(path, change=None, meta=None) -> None:
    """Rewrite path/model.safetensors with the first element of some tensors (a raw byte for
    E4M3) or some of fp4stack's metadata fields changed."""
    from safetensors.torch import save_file

    tensors, header = read(path)
    for key, value in (change or {}).items():
        t = tensors[key] = tensors[key].clone()
        (t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t).view(-1)[0] = value
    if meta == "not JSON":
        header[META] = "{x"
    else:
        layers = json.loads(header[META])
        for name, fields in (meta or {}).items():
            layers[name].update(fields)
        header[META] = json.dumps(layers)
    save_file(tensors, str(path / "model.safetensors"), metadata=header)


def assert_refused(path, match: str) -> None:
    """load_quantized refuses the checkpoint with an error naming the file and the field, and
    leaves the model as it was."""
    fresh = convert(Tiny(seed=5), W4A4)
    before = {k: bits(v).clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        load_quantized(fresh, path)
    after = fresh.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(v, bits(after[k])) for k, v in before.items())


FILE = r"ckpt/model.safetensors: "
BAD_VALUES = {
    "nan amax": ({}, {"up": {"amax": float("nan").hex()}},
                 FILE + r"metadata field 'fp4stack.nvfp4'\['up'\].amax must be finite"),
    "negative amax": ({}, {"mid": {"amax": (-1.5).hex()}},
                      FILE + r"metadata field .*\['mid'\].amax must be finite and >= 0, got -1.5"),
    "nan x_amax": ({}, {"down": {"x_amax": float("nan").hex()}}, r"\['down'\].x_amax must be"),
    "amax not hex": ({}, {"up": {"amax": "big"}}, r"\['up'\].amax is not a float.hex\(\) string"),
    "spec not an object": ({}, {"up": {"spec": 1}}, FILE + r".*\['up'\].spec must be an object"),
    "metadata not JSON": ({}, "not JSON",
                          FILE + r"metadata field 'fp4stack.nvfp4' is not valid JSON"),
    "nan scale": ({"up.weight_scale": 0x7F}, None,
                  FILE + r"up.weight_scale must be finite and >= 0, got nan at index \(0, 0\)"),
    "negative scale": ({"mid.weight_scale": 0xB8}, None,
                       FILE + r"mid.weight_scale must be finite and >= 0, got -1.0"),
    "zero global scale": ({"up.weight_global_scale": 0.0}, None,
                          FILE + r"up.weight_global_scale must be finite and > 0, got 0.0"),
    "nan input scale": ({"down.input_global_scale": float("nan")}, None,
                        FILE + r"down.input_global_scale must be finite and > 0, got nan"),
}


@pytest.mark.parametrize("case", list(BAD_VALUES))
def test_load_refuses_bad_values_naming_file_and_field(tmp_path, case):
    change, meta, match = BAD_VALUES[case]
    path = save_quantized(tiny_w4a4(), tmp_path / "ckpt")
    rewrite(path, change, meta)
    assert_refused(path, match)


def test_load_refuses_a_foreign_scale_whose_amax_overflows(tmp_path):
    from safetensors.torch import save_file

    tensors, _ = read(save_quantized(tiny_w4a4(), tmp_path / "ours"))
    tensors["up.weight_global_scale"] = torch.full((1,), 1e-45)  # 2688 / 1e-45 = inf
    (tmp_path / "theirs").mkdir()
    save_file(tensors, str(tmp_path / "theirs" / "model.safetensors"), metadata={"format": "pt"})
    assert_refused(tmp_path / "theirs", r"theirs/model.safetensors: up.weight_global_scale "
                                        r"\(as an amax\) must be finite")


def write_index(path, keys, entry: str) -> None:
    index = {"metadata": {}, "weight_map": dict.fromkeys(keys, entry)}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


def test_index_entries_are_read_only_inside_the_checkpoint_directory(tmp_path):
    path = save_quantized(tiny_w4a4(), tmp_path / "ckpt")
    keys = list(read(path)[0])
    (path / "shards").mkdir()
    os.replace(path / "model.safetensors", path / "shards" / "a.safetensors")
    write_index(path, keys, "shards/../shards/a.safetensors")  # inside: loads
    fresh = convert(Tiny(seed=5), W4A4)
    load_quantized(fresh, path)
    assert_same_layers(tiny_w4a4(), fresh)
    os.replace(path / "shards" / "a.safetensors", tmp_path / "outside.safetensors")
    for entry in ("../outside.safetensors", str(tmp_path / "outside.safetensors"), "."):
        write_index(path, keys, entry)
        assert_refused(path, rf"ckpt/model.safetensors.index.json: 'weight_map' entry "
                             rf"'{re.escape(entry)}' is not a file inside")
    (path / "model.safetensors.index.json").write_text("{")
    assert_refused(path, r"ckpt/model.safetensors.index.json: not a safetensors index")


def test_truncated_or_foreign_files_are_named(tmp_path):
    path = save_quantized(tiny_w4a4(), tmp_path / "ckpt")
    data = (path / "model.safetensors").read_bytes()
    for cut in (data[:-100], data[:4], b"not safetensors at all"):
        (path / "model.safetensors").write_bytes(cut)
        assert_refused(path, r"not a safetensors file or truncated: .*ckpt/model.safetensors")
    (path / "model.safetensors").unlink()
    (path / "model.safetensors").mkdir()  # a reader's OSError, not a bare one
    assert_refused(path, r"not a safetensors file or truncated: .*ckpt/model.safetensors")
