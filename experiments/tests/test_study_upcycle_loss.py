"""study_upcycle_loss on the tiny random Llama: exact copies keep the dense loss, and a split
with every expert routed is the dense MLP again."""

import pytest

pytest.importorskip("transformers")

from study_upcycle_loss import study  # noqa: E402

from fp4stack.models import hf  # noqa: E402
from fp4stack.models.hf_import import gpt_from_hf  # noqa: E402


def test_rows_of_the_upcyclings():
    model = gpt_from_hf(hf.load("tiny-dense").model).eval()
    ids = [[1, 5, 9, 200, 17, 3], [7, 7, 8, 100, 2]]
    rows = study(model, ids, experts=4, top_ks=[4, 2], noises=[0.0, 0.05])
    by = {(r["how"], r["top_k"], r["noise"]): r["loss"] for r in rows}
    dense = by[("dense", None, None)]
    assert by[("copies", 2, 0.0)] == pytest.approx(dense, rel=1e-5)
    assert by[("copies", 4, 0.0)] == pytest.approx(dense, rel=1e-5)
    assert by[("split", 4, None)] == pytest.approx(dense, rel=1e-3)
    assert by[("copies", 2, 0.05)] != by[("copies", 2, 0.0)]
    assert len(rows) == 1 + 2 * 3
