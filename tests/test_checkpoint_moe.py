"""MoE experts in compressed-tensors NVFP4 checkpoints (save_quantized / load_quantized), checked
against compressed-tensors' decompressor and transformers' loader, and QUADS compensation channels
in the checkpoint.

Models: fp4stack's GPT-MoE and tiny random transformers Qwen3-MoE, OLMoE and Mixtral (fused 3-D
experts in transformers 5.x), built offline from configs.
"""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import fp4stack
from fp4stack import QuantLinear, QuantSpec, ResidualCompensation, restore_expert_weights
from fp4stack.compressed_tensors import load_quantized, save_quantized
from fp4stack.compressed_tensors_moe import TransformersMoEWarning, expert_modules
from fp4stack.convert import calibrate
from fp4stack.models.gpt import GPT, GPTConfig
from fp4stack.nn.quant_experts import ExpertQuantization, QuantHFExperts

transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Every transformers MoE export warns that transformers loads its experts wrongly: checked once,
# by test_moe_exports_warn_once_about_transformers_expert_loading.
pytestmark = pytest.mark.filterwarnings(
    "ignore::fp4stack.compressed_tensors_moe.TransformersMoEWarning")

VOCAB = 128
HF_ARCHS = ("qwen3_moe", "olmoe", "mixtral")
# Per architecture: the checkpoint name of layer 0's expert e projection (gate, up, down), and of
# its router, as the architecture's published checkpoints (and vLLM) name them.
NAMES = {
    "qwen3_moe": ("model.layers.0.mlp.experts.{e}.{p}", ("gate_proj", "up_proj", "down_proj"),
                  "model.layers.0.mlp.gate"),
    "olmoe": ("model.layers.0.mlp.experts.{e}.{p}", ("gate_proj", "up_proj", "down_proj"),
              "model.layers.0.mlp.gate"),
    "mixtral": ("model.layers.0.block_sparse_moe.experts.{e}.{p}", ("w1", "w3", "w2"),
                "model.layers.0.block_sparse_moe.gate"),
    "gpt": ("model.layers.0.mlp.experts.{e}.{p}", ("gate_proj", "up_proj", "down_proj"), None),
}
# An amax of 2688 * 2^-14: the decode scale is a power of two, so every dequantized value is
# exact in bf16 (compressed-tensors' output dtype) and logits can be compared at fp32 rounding.
EXACT_AMAX = 2688 * 2.0**-14


def hf_config(arch: str):
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=64)
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, head_dim=16, num_experts=4,
                                           moe_intermediate_size=32, intermediate_size=64)
    if arch == "olmoe":
        return transformers.OlmoeConfig(**common, num_experts=4, intermediate_size=32)
    if arch == "mixtral":
        return transformers.MixtralConfig(**common, num_local_experts=4, intermediate_size=32)
    assert arch == "llama"
    return transformers.LlamaConfig(**{k: v for k, v in common.items()
                                       if k != "num_experts_per_tok"}, intermediate_size=64)


def make(arch: str, seed: int, recipe, exact: bool = False):
    """A converted tiny model; exact=True pins every quantized weight's amax to EXACT_AMAX."""
    torch.manual_seed(seed)
    if arch == "gpt":
        model = GPT(GPTConfig.tiny_moe(vocab_size=VOCAB))
    else:
        model = transformers.AutoModelForCausalLM.from_config(hf_config(arch)).eval()
    if exact:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() < 2 or any(s in name for s in ("embed", "lm_head", "gate.weight")):
                    continue
                p.clamp_(-EXACT_AMAX, EXACT_AMAX)
                for w in p.reshape(-1, *p.shape[-2:]):  # each expert on its own
                    w.view(-1)[0] = EXACT_AMAX
    fp4stack.quantize_model(model, recipe)
    return model


def logits(model, idx: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(idx)
    return out[0] if isinstance(out, tuple) else out.logits


def tokens(seed: int, shape=(2, 12)) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def read(path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()  # noqa: SIM118


def experts_of(model) -> dict[str, ExpertQuantization]:
    return {n: m for n, m in expert_modules(model).items() if isinstance(m, ExpertQuantization)}


def expert_weights(module: ExpertQuantization, e: int) -> tuple:
    """(gate_up, down) NVFP4Tensors of expert e, packed or quantized from the master stack as
    the forward does (fp4stack's public quantize)."""
    out = []
    for proj in ("gate_up", "down"):
        w = getattr(module, f"{proj}_proj")
        out.append(module.packed_expert(proj, e) if w is None
                   else fp4stack.quantize(w[e].detach(), spec=module.recipe.w))
    return tuple(out)


def calibrated(arch: str, seed: int, recipe="w4a4", **kw):
    model = make(arch, seed, recipe, **kw)
    calibrate(model, [tokens(100 + seed, (4, 16))])
    return model


# ---- round trips -------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ("gpt", *HF_ARCHS))
def test_w4a4_round_trip_is_bit_exact(tmp_path, arch):
    model = calibrated(arch, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # gate/up share their scale: no fused-scale warning
        warnings.simplefilter("ignore", TransformersMoEWarning)  # checked on its own below
        save_quantized(model, tmp_path)
    fresh = make(arch, 1, "w4a4")
    load_quantized(fresh, tmp_path)
    for name, m in experts_of(model).items():
        f = experts_of(fresh)[name]
        for key, t in m.state_dict().items():
            assert torch.equal(bits(t), bits(f.state_dict()[key])), (name, key)
    for (k, v), w in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(bits(v), bits(w)), k
    idx = tokens(7)
    assert torch.equal(bits(logits(model, idx)), bits(logits(fresh, idx)))


@pytest.mark.parametrize("arch", ("gpt", *HF_ARCHS))
def test_layout_is_per_expert_with_shared_gate_up_scales(tmp_path, arch):
    model = make(arch, 0, "w4a4")
    seen: dict[str, torch.Tensor] = {}

    def record(name):
        def hook(module, args):
            x, idx = (args[0], args[1]) if isinstance(module, QuantHFExperts) else (args[0],
                                                                                    args[2])
            for e in range(4):
                rows = x[(idx == e).any(-1)]
                if rows.numel():
                    seen[name] = torch.maximum(seen.get(name, torch.zeros(4)),
                                               F.one_hot(torch.tensor(e), 4) * rows.abs().max())
        return hook

    for name, m in experts_of(model).items():
        m.register_forward_pre_hook(record(name))
    calibrate(model, [tokens(100, (4, 16))])
    tensors, meta = read(save_quantized(model, tmp_path))
    pattern, parts, router = NAMES[arch]
    first = next(iter(experts_of(model).values()))
    master = next(iter(expert_modules(make(arch, 0, "bf16")).values()))  # unconverted
    assert not any(k.endswith(("gate_up_proj", "down_proj", "_data", "x_amax")) for k in tensors)
    for e in range(4):
        gate, up, down = (pattern.format(e=e, p=p) for p in parts)
        gate_up_t, down_t = expert_weights(first, e)
        gu = torch.cat([tensors[f"{gate}.weight_packed"], tensors[f"{up}.weight_packed"]])
        assert torch.equal(gu, gate_up_t.data)
        assert torch.equal(tensors[f"{down}.weight_packed"], down_t.data)
        assert tensors[f"{gate}.weight_scale"].dtype == torch.float8_e4m3fn
        assert tensors[f"{gate}.weight_scale"].shape == (32, 4)
        # One global scale for gate and up: the ENCODE scale of the expert's whole gate_up.
        want = (torch.tensor(2688.0) / master.gate_up_proj[e].detach().abs().amax()).reshape(1)
        assert torch.equal(tensors[f"{gate}.weight_global_scale"], want)
        assert torch.equal(tensors[f"{up}.weight_global_scale"], want)
        # Input scales: gate and up see the same tokens, the expert's own calibrated amax.
        x_want = (torch.tensor(2688.0) / seen[next(iter(experts_of(model)))][e]).reshape(1)
        assert torch.equal(tensors[f"{gate}.input_global_scale"], x_want)
        assert torch.equal(tensors[f"{up}.input_global_scale"], x_want)
        assert tensors[f"{down}.input_global_scale"].shape == (1,)
    cfg = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert "lm_head" in cfg["ignore"]
    if router is not None:
        assert f"{router}.weight" in tensors and router in cfg["ignore"]
    assert "fp4stack.nvfp4" in meta


def test_unconverted_experts_are_written_per_expert_and_ignored(tmp_path):
    # The recipe keeps block 0 in high precision: its experts stay stacked, unquantized.
    recipe = fp4stack.recipe("w4a4").with_(keep_first_blocks=1)
    model = make("mixtral", 0, recipe)
    calibrate(model, [tokens(100, (4, 16))])
    tensors, _ = read(save_quantized(model, tmp_path))
    stack = model.model.layers[0].mlp.experts
    pattern, parts, _ = NAMES["mixtral"]
    w1 = tensors[pattern.format(e=2, p=parts[0]) + ".weight"]
    assert torch.equal(w1, stack.gate_up_proj[2, :32].detach())
    cfg = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert pattern.format(e=2, p="w2") in cfg["ignore"]
    fresh = make("mixtral", 1, recipe)
    load_quantized(fresh, tmp_path)
    idx = tokens(3)
    assert torch.equal(bits(logits(model, idx)), bits(logits(fresh, idx)))


def test_master_experts_export_their_forward_and_load_packed(tmp_path):
    model = make("qwen3_moe", 0, "qat-w")
    tensors, _ = read(save_quantized(model, tmp_path))
    assert not any(k.endswith("input_global_scale") for k in tensors)  # W4A16
    packed = make("qwen3_moe", 1, "w4a4")
    load_quantized(packed, tmp_path)
    for name, m in experts_of(model).items():
        p = experts_of(packed)[name]
        for e in range(4):
            for want, got in zip(expert_weights(m, e), expert_weights(p, e), strict=True):
                assert torch.equal(want.data, got.data) and torch.equal(want.scales, got.scales)
                assert torch.equal(bits(want.amax), bits(got.amax))
    master = make("qwen3_moe", 2, "qat-w")
    load_quantized(master, tmp_path)  # master stacks get the dequantized values
    m0, g0 = experts_of(model), experts_of(master)
    for name in m0:
        want = fp4stack.dequantize(expert_weights(m0[name], 1)[0])
        assert torch.equal(bits(g0[name].gate_up_proj[1].detach()), bits(want))


# ---- calibration of experts --------------------------------------------------------------------
def hf_experts(recipe) -> QuantHFExperts:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config("qwen3_moe"))
    return QuantHFExperts(model.model.layers[0].mlp.experts, fp4stack.recipe(recipe))


def test_expert_calibration_and_unseen_experts():
    experts = hf_experts("w4a4")
    h = torch.randn(6, 64)
    idx = torch.tensor([[0, 1]] * 3 + [[1, 0]] * 3)  # experts 2 and 3 see no token
    experts.start_calibration()
    with torch.no_grad():
        experts(h, idx, torch.full((6, 2), 0.5))
    experts.finish_calibration()
    assert experts.x_amax[0, 0] == experts.x_amax[0, 1] == h.abs().max()
    for row in (0, 1):
        seen = experts.x_amax[row, :2].amax()
        assert (experts.x_amax[row, 2:] == seen).all()
    assert experts.x_amax[1, 0] > 0


def test_static_activation_amax_is_used_by_the_experts():
    experts = hf_experts(fp4stack.recipe("w4a4").with_(activation_amax="static"))
    experts.x_amax = torch.tensor([[0.5, 1.0, 1.0, 1.0], [0.25, 1.0, 1.0, 1.0]])
    h = torch.randn(5, 64)
    idx, w = torch.zeros(5, 1, dtype=torch.long), torch.ones(5, 1)
    with torch.no_grad():
        got = experts(h, idx, w)
    gate_up, down = expert_weights(experts, 0)
    spec = experts.recipe.x
    qx = fp4stack.fake_quantize(h, spec=spec, amax=torch.tensor(0.5))
    gate, up = (qx @ fp4stack.dequantize(gate_up).t()).chunk(2, -1)
    mid = F.silu(gate) * up
    want = fp4stack.fake_quantize(mid, spec=spec, amax=torch.tensor(0.25)) @ \
        fp4stack.dequantize(down).t()
    assert torch.equal(got, want)
    experts.recipe = fp4stack.recipe("w4a4")  # dynamic: each call's own amax
    with torch.no_grad():
        assert not torch.equal(experts(h, idx, w), got)


# ---- (2) the real readers ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def ct():
    pytest.importorskip("compressed_tensors")
    import compressed_tensors.compressors.nvfp4 as nvfp4
    import compressed_tensors.quantization as quant
    import compressed_tensors.quantization.quant_scheme as scheme

    return nvfp4, quant, scheme


def decompress(ct, tensors, prefix: str, global_scale: bool = True) -> torch.Tensor:
    nvfp4, quant, scheme = ct
    sd = {k: tensors[f"{prefix}.{k}"] for k in ("weight_packed", "weight_scale",
                                                 "weight_global_scale")}
    if not global_scale:
        del sd["weight_global_scale"]
    sch = quant.QuantizationScheme(targets=["Linear"], **scheme.NVFP4A16)
    return nvfp4.NVFP4PackedCompressor.decompress(sd, sch)["weight"]


@pytest.mark.parametrize("arch", ("gpt", "mixtral"))
@pytest.mark.parametrize("w", [QuantSpec(), QuantSpec(block=(16, 16))], ids=["1x16", "16x16"])
def test_compressed_tensors_decompresses_every_tensor_bit_exactly(ct, tmp_path, arch, w):
    model = calibrated(arch, 0, fp4stack.recipe("w4a4").with_(name="w", w=w))
    tensors, _ = read(save_quantized(model, tmp_path))
    pattern, parts, _ = NAMES[arch]
    for e in range(4):
        gate_up, down = expert_weights(experts_of(model)["model.layers.0.mlp.experts"], e)
        ours = fp4stack.dequantize(gate_up).bfloat16()
        theirs = torch.cat([decompress(ct, tensors, pattern.format(e=e, p=p)) for p in parts[:2]])
        assert torch.equal(bits(theirs), bits(ours)), e
        theirs = decompress(ct, tensors, pattern.format(e=e, p=parts[2]))
        assert torch.equal(bits(theirs), bits(fp4stack.dequantize(down).bfloat16())), e
    for name, layer in model.named_modules():
        if isinstance(layer, QuantLinear):
            ours = layer.quantized_weight(torch.float32).bfloat16()
            assert torch.equal(bits(decompress(ct, tensors, name)), bits(ours)), name


def hf_logits_with_decompressed_weights(hf, idx) -> torch.Tensor:
    """transformers' logits after compressed-tensors decompressed the dense layers, in fp32."""
    hf.hf_quantizer.compressor.decompress_model(hf)
    for p in hf.parameters():
        if p.dtype == torch.bfloat16:  # compressed-tensors decompresses to bf16 (exact here)
            p.data = p.data.float()
    return logits(hf, idx)


@pytest.mark.parametrize("arch", ("llama", *HF_ARCHS))
def test_transformers_loads_it(ct, tmp_path, arch):
    model = make(arch, 0, "qat-w", exact=True)
    save_quantized(model, tmp_path)
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path,
                                                                 output_loading_info=True)
    assert not any(info.values()), info
    tensors = load_file(tmp_path / "model.safetensors")
    stacks = expert_modules(hf)
    for name, stack in stacks.items():
        # transformers 5.24/5.25 dequantize MoE experts at load without their
        # weight_global_scale (CompressedTensorsDequantize builds each expert from weight_packed
        # and weight_scale only): the experts it holds are compressed-tensors' decompression
        # without it. When this fails, transformers was fixed: drop this check, and the warning
        # (TransformersMoEWarning) save_quantized gives.
        pattern = name.replace(".mlp.", ".block_sparse_moe.") if arch == "mixtral" else name
        parts = NAMES[arch][1]
        wrong = [torch.cat([decompress(ct, tensors, f"{pattern}.{e}.{p}", False)
                            for p in parts[:2]]) for e in range(4)]
        assert torch.equal(bits(stack.gate_up_proj.detach().bfloat16()),
                           bits(torch.stack(wrong)))
    # fp4stack.restore_expert_weights decompresses them again, global scales included.
    assert restore_expert_weights(hf, tmp_path) == 3 * 4 * len(stacks)
    assert restore_expert_weights(hf, tmp_path) == 0  # all right now: nothing rewritten
    idx = tokens(5)
    want = logits(model, idx)
    got = hf_logits_with_decompressed_weights(hf, idx)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if arch == "llama":
        assert torch.equal(got, want)


def test_restoring_experts_refuses_another_checkpoint(ct, tmp_path):
    save_quantized(make("qwen3_moe", 0, "qat-w"), tmp_path / "a")
    save_quantized(make("qwen3_moe", 1, "qat-w"), tmp_path / "b")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "a")
    before = [p.detach().clone() for p in hf.parameters()]
    with pytest.raises(ValueError, match="expert 0 gate_proj .*neither the checkpoint's"):
        restore_expert_weights(hf, tmp_path / "b")
    assert all(torch.equal(a, b) for a, b in zip(before, hf.parameters(), strict=True))
    dense = make("llama", 0, "qat-w")
    assert restore_expert_weights(dense, tmp_path / "a") == 0  # no experts: nothing to do


def test_moe_exports_warn_once_about_transformers_expert_loading(tmp_path):
    with pytest.warns(TransformersMoEWarning) as record:
        save_quantized(make("qwen3_moe", 0, "qat-w"), tmp_path / "moe")
    said = [str(w.message) for w in record if w.category is TransformersMoEWarning]
    assert len(said) == 1  # once per save, not once per expert
    assert "without its weight_global_scale" in said[0] and "load_quantized" in said[0]
    assert "restore_expert_weights" in said[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error", TransformersMoEWarning)
        save_quantized(make("llama", 0, "qat-w"), tmp_path / "dense")  # no experts
        # A GPT-MoE without a transformers config: no config.json transformers could load.
        save_quantized(make("gpt", 0, "qat-w"), tmp_path / "gpt")
    with pytest.warns(TransformersMoEWarning):  # the same GPT-MoE given a transformers config
        save_quantized(make("gpt", 0, "qat-w"), tmp_path / "gpt-hf", config=hf_config("qwen3_moe"))


def test_transformers_loads_w4a4_experts_without_their_input_scales(ct, tmp_path):
    # transformers dequantizes experts at load (weights only): their activation scales are the
    # only keys it does not take; the dense layers keep theirs.
    save_quantized(calibrated("qwen3_moe", 0), tmp_path)
    _, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path,
                                                                output_loading_info=True)
    want = {f"model.layers.{i}.mlp.experts.{e}.{p}.input_global_scale"
            for i in range(2) for e in range(4) for p in ("gate_proj", "up_proj", "down_proj")}
    assert set(info["unexpected_keys"]) == want
    assert not info["missing_keys"] and not info["mismatched_keys"]


# ---- (3) QUADS compensation channels -----------------------------------------------------------
STATIC_RC = fp4stack.recipe("w4a4-rc").with_(name="rc-static",
                                             compensation=ResidualCompensation(k=4, mode="static"))


def test_compensation_channels_round_trip_and_other_readers_ignore_them(ct, tmp_path):
    model = calibrated("llama", 0, STATIC_RC)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert all(m.rc_channels is not None for m in layers.values())
    tensors, meta = read(save_quantized(model, tmp_path))
    assert not any("compensation" in k or "rc_channels" in k for k in tensors)
    stored = json.loads(meta["fp4stack.nvfp4"])
    for name, m in layers.items():
        assert stored[name]["rc_channels"] == m.rc_channels.tolist()
    fresh = make("llama", 1, STATIC_RC)
    load_quantized(fresh, tmp_path)
    for name, m in fresh.named_modules():
        if isinstance(m, QuantLinear):
            assert torch.equal(m.rc_channels, layers[name].rc_channels), name
    idx = tokens(9)
    assert torch.equal(bits(logits(model, idx)), bits(logits(fresh, idx)))
    dynamic = make("llama", 1, fp4stack.recipe("w4a4-rc"))
    load_quantized(dynamic, tmp_path)
    assert not torch.equal(logits(dynamic, idx), logits(fresh, idx)), "precondition"
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path,
                                                                 output_loading_info=True)
    assert not any(info.values()), info


def test_bad_compensation_channels_are_refused(tmp_path):
    model = calibrated("llama", 0, STATIC_RC)
    save_quantized(model, tmp_path)
    path = tmp_path / "model.safetensors"
    tensors, meta = read(tmp_path)
    info = json.loads(meta["fp4stack.nvfp4"])
    name = "model.layers.0.self_attn.q_proj"
    info[name]["rc_channels"] = [0, 64]
    save_file(tensors, str(path), metadata={**meta, "fp4stack.nvfp4": json.dumps(info)})
    fresh = make("llama", 1, STATIC_RC)
    with pytest.raises(ValueError, match=r"q_proj.*rc_channels must hold distinct channel"):
        load_quantized(fresh, tmp_path)
    assert fresh.model.layers[0].self_attn.q_proj.rc_channels is None  # nothing copied


# ---- errors ------------------------------------------------------------------------------------
def test_uncalibrated_or_fp8_experts_are_refused(tmp_path):
    with pytest.raises(ValueError, match="calibrate"):
        save_quantized(make("qwen3_moe", 0, "w4a4"), tmp_path / "a")
    save_quantized(make("qwen3_moe", 0, "w4a4"), tmp_path / "b", weight_only=True)
    model = make("qwen3_moe", 0, "bf16")
    fp4stack.quantize_model(model, "w8a8", skip=("lm_head", "embed", "self_attn"))
    with pytest.raises(ValueError, match="experts 'model.layers.0.mlp.experts': FP8 weights"):
        save_quantized(model, tmp_path / "c")


def test_foreign_gate_up_with_different_scales_is_refused(tmp_path):
    save_quantized(make("olmoe", 0, "qat-w"), tmp_path)
    tensors, meta = read(tmp_path)
    key = "model.layers.1.mlp.experts.2.up_proj.weight_global_scale"
    tensors[key] = tensors[key] * 2
    save_file(tensors, str(tmp_path / "model.safetensors"))  # no metadata: another tool's file
    with pytest.raises(ValueError, match=r"experts\.2\.up_proj\.weight_global_scale.*different "
                                         "global scales"):
        load_quantized(make("olmoe", 1, "qat-w"), tmp_path)
