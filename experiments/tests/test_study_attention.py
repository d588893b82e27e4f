"""experiments/study_attention_quantization.py: its yardsticks and the kernels' table."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import study_attention_induction as induction
import study_attention_quantization as study
import study_attention_step as step
import torch

from fp4stack.nn.attention import AttentionQuant
from fp4stack.nn.attention_ablation import AttentionAblation
from fp4stack.nn.attention_quant import NVFP4_SR

ROOT = Path(__file__).resolve().parents[2]


def sample(seed: int = 0, shape=(1, 2, 24, 16)):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(4))


def test_own_forward_is_what_reuse_differentiates():
    """With reuse and dS, dP unquantized the backward is the exact gradient of the forward's
    function (own-forward errors 0); without reuse, or on the unquantized tensors, it is not."""
    s = sample()
    refs = (study.exact(*s), study.own_forward(*s))
    reuse = study.errors(AttentionQuant(ds=None), s, refs)
    assert len(reuse) == 7 and reuse[4:] == [0.0, 0.0, 0.0]
    assert 0.02 < reuse[1] < 1  # but not exact attention's gradient
    for cfg in (AttentionQuant(ds=None, reuse=False),
                AttentionAblation.quant(ds=None, reuse=False, requantize=False)):
        assert min(study.errors(cfg, s, refs)[4:6]) > 0.02, cfg
    assert len(study.errors(AttentionQuant.only("q"), s, refs)) == 4  # no own forward
    # 16x16 tiles: the own forward is attention on the tiled Q̂, K̂, V̂, which any reuse
    # differentiates exactly (the default's own forward is another function)
    for reuse in (True, False):
        tiled = study.errors(AttentionQuant.tiled(ds=None, reuse=reuse), s, refs)
        assert tiled[4:] == [0.0, 0.0, 0.0]
    got = study.run(AttentionQuant.tiled(ds=None), *s)
    assert min((a - b).norm() / b.norm() for a, b in zip(got[1:3], refs[1][1:3], strict=True)
               ) > 0.02
    # a stochastic forward has no one own forward to compare with
    sr = AttentionQuant(q=NVFP4_SR, k=NVFP4_SR, v=NVFP4_SR, ds=None)
    assert len(study.errors(sr, s, refs)) == 4


def test_kernel_table_adds_little_to_the_reference(capsys):
    """The kernels' rows: one per kernel config, errors against the reference of the same config
    far below those against exact attention (bf16 rounding only)."""
    pytest.importorskip("triton")
    from fp4stack.nn.attention_kernels import triton_unsupported

    s = sample(1, (1, 2, 64, 32))
    if triton_unsupported(s[0].float(), AttentionQuant(), None):
        pytest.skip("the Triton kernels do not run here")
    study.kernel_table([s])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| Q, K")]
    assert [r.split(" | ")[0][2:] for r in rows] == list(study.KERNEL_CONFIGS)
    for row in rows:
        cells = [float(c) for c in re.findall(r"\d\.\d+e[+-]\d+", row)]
        vs_exact, vs_reference = cells[:4], cells[4:]
        # measured at this shape: at most 0.13 of the error against exact attention (bf16
        # rounding flips some dŜ elements); the settings differ from one another by about half
        assert all(r < 0.3 * e for r, e in zip(vs_reference, vs_exact, strict=True)), row


def test_capture_hf_records_every_layer_after_rope():
    """--model: one (q, k, v, dO) per attention layer of a Hugging Face Llama, K/V heads
    repeated to the query heads, dO the LM loss's gradient (nonzero), all float64."""
    pytest.importorskip("transformers")
    from fp4stack.models.hf import tiny_dense

    config = tiny_dense().model.config
    got = study.capture_hf("tiny-dense", tokens=40)
    assert len(got) == config.num_hidden_layers
    head_dim = config.hidden_size // config.num_attention_heads
    for q, k, v, do in got:
        assert q.shape == k.shape == v.shape == do.shape == (1, config.num_attention_heads, 40,
                                                             head_dim)
        assert q.dtype == torch.float64 and do.abs().sum() > 0
    q, k, v, _ = got[0]
    assert torch.equal(k[:, 0], k[:, 1]) and torch.equal(v[:, 2], v[:, 3])  # GQA repeats
    assert not torch.equal(q[:, 0], q[:, 1])


def tiny_checkpoint(tmp_path):
    """(checkpoint dir, config path, state) of a 3-block GPT on 32 random tokens, trained with
    nothing but quantized onto fullstack-nvidia (so it carries low-rank factors)."""
    import json

    import numpy as np
    import yaml
    from safetensors.torch import save_file

    from fp4stack import quantize_model
    from fp4stack.data import write_shard
    from fp4stack.models import GPT

    data = tmp_path / "data"
    data.mkdir()
    tokens = np.random.default_rng(0).integers(0, 32, 4000)
    write_shard(data / "train.bin", tokens[:3000], 32)
    write_shard(data / "val.bin", tokens[3000:], 32)
    (data / "manifest.json").write_text(json.dumps({"vocab_size": 32}))
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(dict(
        model={"preset": "tiny", "dim": 32, "n_layers": 3, "n_heads": 2, "n_kv_heads": 1,
               "ffn_hidden": 64}, data=str(data), seq_len=16, global_batch_size=2,
        micro_batch_size=2, device="cpu")))
    cfg = study.load_config(str(config))
    trained = GPT(cfg.model_config(32))
    quantize_model(trained, "fullstack-nvidia")
    state = trained.state_dict()
    assert any(k.endswith("lowrank_a") for k in state)
    ckpt = tmp_path / "step_00000001"
    ckpt.mkdir()
    save_file({k: t.contiguous() for k, t in state.items()}, str(ckpt / "model.safetensors"))
    return ckpt, config, state


def test_a_quantized_recipes_checkpoint_loads_as_its_master_weights(tmp_path):
    """--checkpoint of a low-rank recipe: the master weights in a plain GPT (the recipe's
    low-rank factors dropped), and capture runs on it."""
    ckpt, config, state = tiny_checkpoint(tmp_path)
    *_, model = study.load_model(ckpt, str(config), "cpu")
    loaded = model.state_dict()
    assert loaded.keys() == {k for k in state if k.rpartition(".")[2] not in study.RECIPE_STATE}
    assert all(torch.equal(loaded[k], state[k]) for k in loaded)
    got = study.capture(ckpt, str(config), 1)
    assert len(got) == 3 and all(t.dtype == torch.float64 for t in got[0])


def test_adam_normalised_divides_the_sum_by_the_per_batch_rms():
    grads = [{"w": torch.tensor([3.0, 0.0, 1.0])}, {"w": torch.tensor([-1.0, 0.0, 1.0])}]
    (got,) = study.adam_normalised(grads, ["w"])
    assert torch.allclose(got, torch.tensor([2 / 5**0.5, 0.0, 2.0]))  # rms 0 -> 0, no NaN


def test_adam_direction_of_one_batch_is_the_gradients_sign():
    grads = [{"w": torch.tensor([3.0, -0.5, 0.0])}]
    assert torch.equal(step.adam_direction(grads)["w"], torch.tensor([1.0, -1.0, 0.0]))
    two = [{"w": torch.tensor([2.0])}, {"w": torch.tensor([-2.0])}]
    assert step.adam_direction(two)["w"].item() == 0.0  # disagreeing batches: no step


def test_step_table_starts_every_setting_from_the_same_weights(tmp_path, capsys):
    """Every setting's step starts from the checkpoint: exact attention's row has norm ratio 1,
    a zero step (lr 0) changes no loss, and the settings' rows differ once lr > 0."""
    ckpt, config, _ = tiny_checkpoint(tmp_path)
    rows = step.step_table(ckpt, str(config), 1, [0.0, 1e-2])
    assert len(rows) == len(step.SETTINGS) and rows[0][0] == 1.0
    assert all(r[1] == r[2] == 0.0 for r in rows)  # lr 0: both forwards unchanged
    assert len({r[4] for r in rows}) > 1  # lr 1e-2, exact forward: the gradients differ
    assert "| exact attention | 1.0000 |" in capsys.readouterr().out


def test_induction_study_selects_settings_by_text_or_full_name():
    assert len(induction.select([])) == len(induction.SETTINGS)
    by_text = induction.select(["no reuse"])
    assert "no reuse; delta from dP" in by_text and "no reuse, stochastic rounding" in by_text
    assert list(induction.select(["no reuse", "exact attention"], exact=True)) == [
        "exact attention", "no reuse"]
    assert induction.select(["exact"], exact=True) == {}


def test_induction_study_settings_share_the_forward_and_differ_in_the_backward():
    """Every setting starts from the same weights on the same batch: the first loss is the
    same wherever the forward is (round-to-nearest Q, K, V), and the second differs once the
    backwards (reuse or not) have taken one step."""
    reuse, _ = induction.train(induction.SETTINGS["reuse (default)"], seed=0, steps=2)
    noreuse, final = induction.train(induction.SETTINGS["no reuse"], seed=0, steps=2)
    assert reuse[0] == noreuse[0] and reuse[1] != noreuse[1]
    x, y = induction.Task().batch_of(torch.Generator().manual_seed(0))
    assert torch.equal(x[:, 32:], x[:, :31]) and torch.equal(y[:, :-1], x[:, 1:])
    assert 0 < final < 10
    # delta from dP: without reuse the same forward, a backward unlike flash attention's delta
    delta, _ = induction.train(induction.SETTINGS["no reuse; delta from dP"], seed=0, steps=2)
    assert delta[0] == noreuse[0] and delta[1] != noreuse[1]
    # another size: a longer copy of a wider model
    task = induction.Task(dim=32, heads=2, seq=32, batch=4)
    x, _ = task.batch_of(torch.Generator().manual_seed(0))
    assert x.shape == (4, 31) and torch.equal(x[:, 16:], x[:, :15])
    losses, final = induction.train(induction.SETTINGS["reuse (default)"], 0, 2, task)
    assert len(losses) == 2 and 0 < final < 10
