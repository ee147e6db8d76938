"""Where task accuracy is measured: labels per pixel ``[N, H, W]`` fit only the data's own sizes, so where the
validated sizes (``signature.shapes``) leave those out, they are validated too if they lie within the range the
engines are built for; outside it, accuracy and its gate are said not to apply, in the log and the report."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from kiln.core.data import DatasetSplits, as_feed
from kiln.core.labels import accuracy
from kiln.core.records import Baseline, EngineValidation, ValidationResult
from kiln.stages.accuracy.check import (
    compare_on,
    held_out,
    held_out_reference,
)
from kiln.stages.accuracy.config import CheckConfig
from tests.stages.accuracy.judging import judged

AXES = {"input": {2: "height", 3: "width"}}
W = np.random.default_rng(0).standard_normal((3, 3)).astype(np.float32)


def _data() -> DatasetSplits:
    """Images [3, 8, 8] with a class per pixel (the channel of the largest value, 3 classes)."""
    x = torch.randn(48, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    y = x.argmax(1)
    return DatasetSplits(x[:16], y[:16], x[16:], y[16:], num_classes=3)


def _run(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A per-pixel head: class maps [N, 3, H, W] at any size."""
    return {"out": np.einsum("kc,nchw->nkhw", W, feed["input"]) + feed["input"]}


def _swapped(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """An engine whose first two class maps are swapped: its answer is wrong on most pixels of those classes."""
    out = _run(feed)["out"]
    return {"out": out[:, [1, 0, 2]]}


def _reference(shapes: dict[str, list[int]]) -> Any:
    data = _data()
    feeds = held_out(data, lambda v: as_feed(v, ["input"]), AXES, shapes, None)
    return data, held_out_reference(_run, feeds, data, "out", CheckConfig(), [1, 8], AXES)


def _judged(ref: Any, engine: Any) -> tuple[EngineValidation, list[str]]:
    return judged(ref, engine, [1, 8], "fp32")


def test_pixel_labels_are_scored_at_the_datas_own_sizes_within_the_validated_range() -> None:
    """``signature.shapes: {height: [6, 10], width: [6, 12]}`` on 8x8 data: no configured shape is the data's, which
    lies within them; it is validated beside them and accuracy measured there, so its gate holds. Before: accuracy
    None for the reference and every engine, and ``max_accuracy_drop`` never applied."""
    data, ref = _reference({"height": [6, 10], "width": [6, 12]})
    assert [p for p, _ in ref.feeds] == [
        {"height": 6, "width": 6},
        {"height": 8, "width": 8},
        {"height": 6, "width": 12},  # the ranges' corners
        {"height": 10, "width": 6},
        {"height": 10, "width": 12},
    ]
    own = _run({"input": data.val_x.numpy()})["out"]
    assert ref.score == 1 and ref.accuracy == pytest.approx(accuracy(own, data.val_y.numpy()))
    entry, failures = _judged(ref, _run)
    assert entry.accuracy == pytest.approx(ref.accuracy) and failures == []
    entry, failures = _judged(ref, _swapped)
    assert entry.accuracy is not None and any(f.startswith("accuracy drop") for f in failures)


def test_the_datas_own_sizes_among_the_validated_ones_are_scored_where_they_are() -> None:
    """The data's 8x8 is the smallest validated shape: accuracy is measured there, not at the largest (where the
    pixel labels fit no image), and no shape is added."""
    _, ref = _reference({"height": [8, 10], "width": [8, 12]})
    assert [p for p, _ in ref.feeds] == [
        {"height": 8, "width": 8},
        {"height": 8, "width": 12},
        {"height": 10, "width": 8},
        {"height": 10, "width": 12},
    ]
    assert ref.score == 0 and ref.accuracy is not None


def test_own_sizes_outside_the_validated_range_are_said_not_scored(caplog: pytest.LogCaptureFixture) -> None:
    """8x8 data validated at 10..12: the engines are not built for 8x8, and labels of 8x8 label no pixel of a
    padded image; accuracy is measured nowhere, and the log says so with the sizes and the fix."""
    with caplog.at_level("WARNING", logger="kiln.validate"):
        _, ref = _reference({"height": [10, 12], "width": [10, 12]})
    assert ref.score is None and ref.accuracy is None
    assert len(ref.feeds) == 4 and _judged(ref, _swapped)[0].accuracy is None  # 10x10, two corners, 12x12
    said = caplog.text
    assert "task accuracy is not measured and max_accuracy_drop is not applied" in said
    assert "(height=8, width=8), outside the validated sizes (height 10..12, width 10..12)" in said
    assert "add the data's sizes to signature.shapes" in said


def test_the_report_says_the_accuracy_gate_was_not_applied() -> None:
    """validation.json's baseline records 0 labelled positions scored: the report says accuracy was not measured
    and its gate not applied, and claims no accuracy on the class-logit output."""
    from kiln.stages.validate.report import report_section

    base = Baseline(accuracy=None, samples=16, latency_ms={}, logits_output="out", compared=["out"])
    base.shapes, base.labelled_positions = [{"height": 10, "width": 10}], 0
    v = ValidationResult(passed=True, baseline=base, engines=[], failures=[])
    compared = next(line for line in report_section(v) if line.startswith("Compared outputs"))
    assert "accuracy on 'out'" not in compared and "top-1 agreement on 'out' (every position)" in compared
    assert "task accuracy not measured, and `max_accuracy_drop` (and `max_metric_drop`) not applied" in compared
    base.labelled_positions, base.accuracy = 1024, 0.9
    v.engines = [
        EngineValidation(
            name="e", backend="onnxruntime", precision="fp32", device="cpu", status="validated", top1_agreement=1.0
        )
    ]
    compared = next(line for line in report_section(v) if line.startswith("Compared outputs"))
    assert "top-1 agreement and accuracy on 'out', counted over the 1,024 labelled positions" in compared


SIGNAL = {"input": {1: "samples"}}


def _signals() -> DatasetSplits:
    """Clips [N, 16] labelled by their mean's sign: padding them with silence dilutes what decides the label."""
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(1)) + 0.2
    y = (x.mean(1) > 0.3).long()
    return DatasetSplits(x[:32], y[:32], x[32:], y[32:], num_classes=2)


def _thresholds(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Class logits of a clip: [0.3, mean], whatever its length (the model the labels came from at length 16)."""
    mean = feed["input"].mean(1)
    return {"logits": np.stack([np.full_like(mean, 0.3), mean], 1)}


def _signal_reference(shapes: dict[str, list[int]], caplog: pytest.LogCaptureFixture) -> Any:
    data = _signals()
    feeds = held_out(data, lambda v: as_feed(v, ["input"]), SIGNAL, shapes, None)
    with caplog.at_level("INFO", logger="kiln.validate"):
        return held_out_reference(_thresholds, feeds, data, "logits", CheckConfig(), [1, 8], SIGNAL)


def test_labels_per_row_are_scored_at_the_datas_own_sizes_not_at_a_padded_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Clips of 16 samples validated at 4 and 64: at 64 each is three quarters silence, another input than the one
    labelled (its accuracy falls to chance). The data's own 16 is validated beside them and accuracy measured
    there, the model's real accuracy (1.0 here)."""
    ref = _signal_reference({"samples": [4, 64]}, caplog)
    assert [p for p, _ in ref.feeds] == [{"samples": 4}, {"samples": 16}, {"samples": 64}]
    assert ref.score == 1 and ref.accuracy == 1.0
    assert "measured at the data's own sizes (samples=16)" in caplog.text
    longer = ref.feeds[-1][1]["input"]  # past the data's 16 samples a float clip repeats itself, not silence
    assert np.allclose(longer[:, 16:32], longer[:, :16], atol=1e-2)  # each copy shifted a little
    zeros = np.pad(longer[:, :16], ((0, 0), (0, 48)))  # what validation fed before: three quarters silence
    assert accuracy(_thresholds({"input": zeros})["logits"], _signals().val_y.numpy()) < 0.9


def test_labels_per_row_outside_the_validated_range_are_scored_at_the_last_shape_and_said(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ref = _signal_reference({"samples": [32, 64]}, caplog)
    assert len(ref.feeds) == 2 and ref.score == 1 and ref.accuracy is not None
    said = "measured at samples=64, the held-out inputs lengthened along samples by repeating their values from the "
    assert said + "data's own sizes (samples=16)" in caplog.text
    assert "cut" not in caplog.text  # lengthened only: no end of a window is lost


def test_the_report_names_the_sizes_accuracy_was_measured_at() -> None:
    from kiln.stages.validate.report import report_section

    base = Baseline(accuracy=1.0, samples=32, latency_ms={}, logits_output="logits", compared=["logits"])
    base.shapes, base.scored_at = [{"samples": 4}, {"samples": 16}, {"samples": 64}], {"samples": 16}
    v = ValidationResult(passed=True, baseline=base, engines=[], failures=[])
    lines = report_section(v)
    assert any("accuracy 1.0000 on 32 held-out samples at samples=16." in line for line in lines)
    padded = "(at samples=64 the held-out inputs are lengthened past the data's own samples=16: their values repeated"
    assert any(padded in line for line in lines), lines


def test_answers_at_padded_positions_are_not_compared() -> None:
    """A causal LM padded on the left: an engine whose answers differ from the model's only where the attention
    mask is 0 (positions that attend to nothing, computed differently per runtime) compares equal; one that differs
    at a real position does not."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 9, (16, 6), generator=g)
    mask = torch.ones(16, 6, dtype=torch.int64)
    mask[::2, :2] = 0  # every other row padded on the left
    x = {"input_ids": ids * mask, "attention_mask": mask}
    data = DatasetSplits(x, None, x, None)
    table = np.random.default_rng(1).standard_normal((10, 4)).astype(np.float32)

    def model(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"logits": table[feed["input_ids"]]}

    def garbage_at_padding(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = model(feed)["logits"].copy()
        out[feed["attention_mask"] == 0] = 7.0
        return {"logits": out}

    def wrong_at_a_token(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = model(feed)["logits"].copy()
        out[:, -1] += 3.0
        return {"logits": out}

    axes = {"input_ids": {1: "seq"}, "attention_mask": {1: "seq"}}
    feeds = held_out(data, lambda v: as_feed(v, ["input_ids", "attention_mask"]), axes, {}, None)
    ref = held_out_reference(model, feeds, data, None, CheckConfig(), [1, 8], axes)
    assert compare_on(ref, garbage_at_padding, [1, 8]).stats["logits"].cosine == pytest.approx(1.0)
    assert compare_on(ref, wrong_at_a_token, [1, 8]).stats["logits"].cosine < 0.99


LM_AXES = {"input_ids": {1: "seq"}, "attention_mask": {1: "seq"}}
VOCAB = 10


class _CausalLM(torch.nn.Module):
    """A tiny causal LM: each position's next-token logits from the mean of the real tokens' embeddings up to it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = torch.nn.Embedding(VOCAB, 8), torch.nn.Linear(8, VOCAB)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        m = mask[..., None].float()
        h = (self.emb(ids) * m).cumsum(1) / m.cumsum(1).clamp(min=1)
        return self.head(h)


def _lm_data() -> DatasetSplits:
    """Token rows of length 16, the last 4 positions of every other row padding; next-token labels, -100 where
    nothing follows (the last real token, padding)."""
    g = torch.Generator().manual_seed(0)
    seqs = torch.randint(0, VOCAB, (48, 1), generator=g) + torch.arange(17) * torch.randint(1, 3, (48, 1), generator=g)
    seqs %= VOCAB
    ids, y = seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()
    mask = torch.ones_like(ids)
    mask[::2, 12:] = 0
    ids, y = ids * mask, y.masked_fill(mask == 0, -100)
    y[::2, 11] = -100
    x = {"input_ids": ids, "attention_mask": mask}
    return DatasetSplits(
        {k: v[:16] for k, v in x.items()}, y[:16], {k: v[16:] for k, v in x.items()}, y[16:], num_classes=VOCAB
    )


def _lm_run(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    model = _CausalLM().eval()
    with torch.no_grad():
        ids, mask = torch.from_numpy(feed["input_ids"]), torch.from_numpy(feed["attention_mask"])
        return {"logits": model(ids, mask).numpy()}


def _lm_reference(shapes: dict[str, list[int]], caplog: pytest.LogCaptureFixture) -> Any:
    data = _lm_data()
    feeds = held_out(data, lambda v: as_feed(v, ["input_ids", "attention_mask"]), LM_AXES, shapes, None)
    with caplog.at_level("INFO", logger="kiln.validate"):
        return held_out_reference(_lm_run, feeds, data, "logits", CheckConfig(), [1, 8], LM_AXES)


def test_next_token_labels_are_scored_at_the_datas_own_length_within_the_validated_range(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A causal LM's rows of 16 tokens validated at ``signature.shapes: {seq: [4, 32]}``: at 32 each row and its
    labels are tiled twice, a context that repeats itself, which is not the text labelled. The data's own 16 is
    validated beside them and accuracy measured there, the model's accuracy on the real text."""
    data = _lm_data()
    ref = _lm_reference({"seq": [4, 32]}, caplog)
    assert [p for p, _ in ref.feeds] == [{"seq": 4}, {"seq": 16}, {"seq": 32}]
    assert ref.score == 1 and ref.feeds[ref.score][0] == {"seq": 16}
    own = _lm_run({k: v.numpy() for k, v in data.val_x.items()})["logits"]
    assert ref.accuracy == pytest.approx(accuracy(own, data.val_y.numpy()))
    tiled = ref.feeds[-1][1]
    assert accuracy(_lm_run(tiled)["logits"], ref.point_labels[-1]) != pytest.approx(ref.accuracy)
    assert "measured at the data's own sizes (seq=16)" in caplog.text


def test_next_token_labels_outside_the_validated_range_are_scored_at_the_last_fitting_length_and_said(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Rows of 16 tokens validated at 24 and 32 only: the engines are not built for 16, so accuracy is measured at
    32 (labels tiled with their input), and the log says the inputs there are not the data's own."""
    ref = _lm_reference({"seq": [24, 32]}, caplog)
    assert [p for p, _ in ref.feeds] == [{"seq": 24}, {"seq": 32}]
    assert ref.score == 1 and ref.accuracy is not None
    said = [
        r for r in caplog.records if "by repeating their values from the data's own sizes (seq=16)" in r.getMessage()
    ]
    assert len(said) == 1 and said[0].levelname == "WARNING" and "measured at seq=32" in said[0].getMessage()


def test_tags_past_the_datas_length_repeat_each_rows_real_tokens_as_its_ids_do() -> None:
    """Rows padded at their end, lengthened: the ids repeat each row's real tokens (no padding mid-row), and the
    tags per token repeat with them, so each tag stays on its token."""
    from kiln.core.shapes import resize
    from kiln.stages.accuracy.check import labels_at_points

    mask = np.array([[1, 1, 1, 0], [1, 1, 1, 1]], np.int64)
    ids = np.where(mask == 1, np.arange(8).reshape(2, 4) + 10, 0)
    tags = np.where(mask == 1, np.arange(8).reshape(2, 4) + 100, -100)
    own = {"input_ids": ids, "attention_mask": mask}
    axes = {"input_ids": {1: "seq"}, "attention_mask": {1: "seq"}}
    feeds = [({"seq": 4}, own), ({"seq": 9}, resize(own, axes, {"seq": 9}))]
    _, longer = labels_at_points(tags, own, feeds, axes)
    assert (longer - 90 == feeds[1][1]["input_ids"]).all()  # tag = id + 90 on every position, real throughout
    assert longer[0].tolist() == [100, 101, 102] * 3


def test_tags_of_rows_whose_lengths_an_input_holds_repeat_as_their_ids_do() -> None:
    """Rows padded at their end whose lengths an input holds (`pack_padded_sequence`'s), no mask: lengthened, the
    tags repeat each row's real tokens as the ids do, each tag on its token."""
    from kiln.core.shapes import resize
    from kiln.stages.accuracy.check import labels_at_points

    real = np.array([[1, 1, 1, 0], [1, 1, 1, 1]], bool)
    ids = np.where(real, np.arange(8).reshape(2, 4) + 10, 0)
    tags = np.where(real, np.arange(8).reshape(2, 4) + 100, -100)
    own = {"ids": ids, "lengths": real.sum(1)}
    axes = {"ids": {1: "seq"}}
    feeds = [({"seq": 4}, own), ({"seq": 9}, resize(own, axes, {"seq": 9}))]
    _, longer = labels_at_points(tags, own, feeds, axes)
    assert (longer - 90 == feeds[1][1]["ids"]).all() and longer[0].tolist() == [100, 101, 102] * 3
