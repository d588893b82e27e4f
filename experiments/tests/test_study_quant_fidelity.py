"""study_quant_fidelity on the tiny random Llama: the float32 engine is the model itself, an
NVFP4 one moves the log-probs, and padding rows leave each text's scores as they were alone."""

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from study_quant_fidelity import fidelity, padded_batch  # noqa: E402

from fp4stack.models import hf  # noqa: E402
from fp4stack.models.hf_import import gpt_from_hf  # noqa: E402


def test_rows_per_precision():
    model = gpt_from_hf(hf.load("tiny-dense").model).eval()
    tokens, mask = padded_batch([[1, 5, 9, 200, 17, 3], [7, 7, 8, 100]], pad=0)
    assert mask.tolist()[1] == [False, False, True, True, True, True]
    rows = {r["precision"]: r for r in fidelity(model, ["bf16", "nvfp4"], tokens, mask, None)}
    assert rows["bf16"]["dlogp_max"] == 0.0 and rows["bf16"]["nll"] == rows["float32"]["nll"]
    assert rows["nvfp4"]["dlogp_max"] > 0.0 and rows["nvfp4"]["dlogp_mean"] > 0.0
    alone = fidelity(model, [], tokens[1:, 2:], mask[1:, 2:], None)[0]["nll"]
    first = fidelity(model, [], tokens[:1], mask[:1], None)[0]["nll"]
    assert rows["float32"]["nll"] == pytest.approx((5 * first + 3 * alone) / 8, rel=1e-5)
    assert torch.equal(tokens[1, 2:], torch.tensor([7, 7, 8, 100]))


def test_file_chunks_are_consecutive_windows(tmp_path):
    from study_quant_fidelity import file_chunks

    text = tmp_path / "t.txt"
    text.write_text("one  two\nthree four five six seven")
    encode = lambda s: s.split()  # noqa: E731  (one token a word)
    assert file_chunks(encode, str(text), 3, 2) == [["one", "two"], ["three", "four"],
                                                    ["five", "six"]]
    with pytest.raises(ValueError, match="7 tokens, fewer than"):
        file_chunks(encode, str(text), 4, 2)


def test_quads_shares_and_static_channels_against_the_qat_w_trainer():
    model = gpt_from_hf(hf.load("tiny-dense").model).eval()
    tokens, mask = padded_batch([[1, 5, 9, 200, 17, 3], [7, 7, 8, 100]], pad=0)
    rows = {r["precision"]: r for r in fidelity(
        model, ["quads@1.0", "quads@0.25:static", "quads@0.25"], tokens, mask, None,
        trainer="qat-w", calibration=[[4, 8, 15, 16, 23, 42]])}
    assert rows["qat-w"]["nll"] != fidelity(model, [], tokens, mask, None)[0]["nll"]
    assert rows["quads@1.0"]["dlogp_max"] < 1e-5  # every channel back: the trainer's function
    assert rows["quads@0.25:static"]["dlogp_max"] > 0 and rows["quads@0.25"]["dlogp_max"] > 0
    with pytest.raises(ValueError, match="calibration"):
        fidelity(model, ["quads@0.25:static"], tokens, mask, None, trainer="qat-w")


def test_four_over_six_engines_against_the_four_over_six_trainer():
    model = gpt_from_hf(hf.load("tiny-dense").model).eval()
    tokens, mask = padded_batch([[1, 5, 9, 200, 17, 3], [7, 7, 8, 100]], pad=0)
    rows = {r["precision"]: r for r in fidelity(
        model, ["w4a16", "quads@1.0", "nvfp4"], tokens, mask, None, trainer="qat-w",
        four_over_six=True)}
    assert set(rows) == {"qat-w+4over6", "w4a16+4over6", "quads@1.0+4over6", "nvfp4+4over6"}
    assert rows["w4a16+4over6"]["dlogp_max"] == 0.0  # the same weights, unquantized x
    assert rows["quads@1.0+4over6"]["dlogp_max"] < 1e-5
    plain = {r["precision"]: r for r in fidelity(model, ["w4a16"], tokens, mask, None,
                                                 trainer="qat-w")}
    assert plain["qat-w"]["nll"] != rows["qat-w+4over6"]["nll"]  # other weights
