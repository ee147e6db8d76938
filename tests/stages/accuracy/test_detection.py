"""A dense detector head (class logits ``[N, A, C]`` and pixel boxes ``[N, A, 4]``, before NMS) through the accuracy
check: ``detection_recall`` reads the right outputs and counts confident predictions only, a reference that
scores 0 is said, box errors fail the relative-error gate though the cosine passes, and top-1 agreement counts the
anchors the reference is confident at, not background near-ties."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kiln.core.data import DatasetSplits, as_feed
from kiln.core.errors import ConfigError
from kiln.core.records import EngineValidation
from kiln.stages.accuracy.check import (
    accuracy_failures,
    derived_rel_err,
    gates_for,
    held_out,
    held_out_reference,
)
from kiln.stages.accuracy.config import CheckConfig
from kiln.stages.accuracy.metrics import resolve_metric
from tests.stages.accuracy.judging import judged

CELLS, STRIDE, CLASSES = 4, 8, 4  # a 32 x 32 image: 4 x 4 anchors of stride 8, 4 classes


class TinyDetector(nn.Module):
    """Scores first, then boxes: ``scores [N, 16, 4]`` (logits: a class's own input channel over a cell lifts its
    logit from -5 to 5) and ``boxes [N, 16, 4]`` (x1, y1, x2, y2 in pixels about each anchor's centre).
    ``shrink`` scales every box about its centre; ``jitter`` perturbs the class weights (flips background
    near-ties, whose logits all lie near -5); ``scale`` multiplies the logits (no class changes)."""

    def __init__(self, shrink: float = 1.0, jitter: float = 0.0, scale: float = 1.0) -> None:
        super().__init__()
        self.shrink = shrink
        self.cls, self.reg = nn.Conv2d(CLASSES, CLASSES, 1), nn.Conv2d(CLASSES, 4, 1)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            noise = jitter * torch.randn(CLASSES, CLASSES, 1, 1, generator=g)
            self.cls.weight.copy_(scale * (10 * torch.eye(CLASSES)[:, :, None, None] + noise))
            self.cls.bias.fill_(-5.0 * scale)
            self.reg.weight.copy_(torch.rand(4, CLASSES, 1, 1, generator=g))
            self.reg.bias.fill_(0.5)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        p = F.avg_pool2d(x, STRIDE)
        scores = self.cls(p).flatten(2).transpose(1, 2)
        ltrb = F.relu(self.reg(p)).flatten(2).transpose(1, 2) * STRIDE * self.shrink
        centres = (torch.arange(CELLS, dtype=x.dtype) + 0.5) * STRIDE
        cy, cx = torch.meshgrid(centres, centres, indexing="ij")
        cx, cy = cx.reshape(1, -1), cy.reshape(1, -1)
        boxes = torch.stack([cx - ltrb[..., 0], cy - ltrb[..., 1], cx + ltrb[..., 2], cy + ltrb[..., 3]], -1)
        return {"scores": scores, "boxes": boxes}


def _images(n: int, seed: int) -> tuple[torch.Tensor, np.ndarray]:
    """Faint noise with one object per image: one cell filled in its class's channel; and that object's label
    ``[class, -1]`` (its box comes from the reference: :func:`_labels`)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, CLASSES, CELLS * STRIDE, CELLS * STRIDE, generator=g) * 0.05
    cells = torch.randint(0, CELLS * CELLS, (n,), generator=g).numpy()
    classes = torch.randint(0, CLASSES, (n,), generator=g).numpy()
    for i, (cell, c) in enumerate(zip(cells, classes)):
        r, col = divmod(int(cell), CELLS)
        x[i, c, r * STRIDE : (r + 1) * STRIDE, col * STRIDE : (col + 1) * STRIDE] = 1.0
    return x, np.stack([cells, classes], 1)


def _labels(x: torch.Tensor, objects: np.ndarray) -> torch.Tensor:
    """``[N, 2, 5]`` rows of (class, x1, y1, x2, y2): each image's object with the reference's box at its cell, and
    a padding row."""
    with torch.no_grad():
        boxes = TinyDetector()(x)["boxes"].numpy()
    y = np.full((len(x), 2, 5), -1.0, np.float32)
    for i, (cell, c) in enumerate(objects):
        y[i, 0] = [c, *boxes[i, cell]]
    return torch.from_numpy(y)


def _data() -> DatasetSplits:
    tx, to = _images(16, 0)
    vx, vo = _images(48, 1)
    return DatasetSplits(tx, _labels(tx, to), vx, _labels(vx, vo), num_classes=CLASSES)


def _torch_run(model: nn.Module) -> Any:
    def run(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        with torch.no_grad():
            return {k: v.numpy() for k, v in model(torch.from_numpy(feed["input"])).items()}

    return run


def _engine(model: nn.Module, tmp_path: Path, name: str) -> Any:
    """``model`` exported to ONNX and run in an ONNX Runtime session: an engine of it."""
    path = tmp_path / f"{name}.onnx"
    example = torch.zeros(2, CLASSES, CELLS * STRIDE, CELLS * STRIDE)
    torch.onnx.export(
        model,
        (example,),
        str(path),
        input_names=["input"],
        output_names=["scores", "boxes"],
        dynamic_axes={"input": {0: "batch"}},
        dynamo=False,
    )
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])

    def run(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(["scores", "boxes"], session.run(None, {"input": feed["input"]})))

    return run


def _judge(engine: Any, precision: str, metric: str | None = None) -> tuple[EngineValidation, list[str], Any]:
    """``engine`` against the PyTorch detector as validation and the precision stage judge it (scores named as the
    class logits, as ``signature.logits_output: scores`` does), with the gates of ``precision``."""
    data, cfg = _data(), CheckConfig(metric=metric)
    feeds = held_out(data, lambda v: as_feed(v, ["input"]), {}, {}, None)
    ref = held_out_reference(_torch_run(TinyDetector()), feeds, data, "scores", cfg, [1, 8], {}, named=True)
    return (*judged(ref, engine, [1, 8], precision, cfg), ref)


def _outputs(x: torch.Tensor, model: nn.Module | None = None) -> dict[str, np.ndarray]:
    return _torch_run(model or TinyDetector())({"input": x.numpy()})


# detection_recall: which output is which


@pytest.mark.parametrize("order", ["scores first", "boxes first"])
@pytest.mark.parametrize("logits", [None, "scores"])
def test_detection_recall_tells_boxes_from_scores_of_four_classes(order: str, logits: str | None) -> None:
    """Four classes make both outputs ``[N, A, 4]``: the boxes are the one named like boxes, or the one
    ``signature.logits_output`` does not name, whichever comes first."""
    data = _data()
    out = _outputs(data.val_x)
    if order == "boxes first":
        out = {"boxes": out["boxes"], "scores": out["scores"]}
    assert resolve_metric("detection_recall", logits)(out, data.val_y.numpy()) == pytest.approx(1.0)


def test_two_box_shaped_outputs_named_alike_are_an_error_until_one_is_named() -> None:
    """Outputs whose names say nothing (``output_0``, ``output_1``), both ``[N, A, 4]``: a guess is as likely wrong,
    so the metric asks for the class-score output; once named, the other is the boxes."""
    data = _data()
    out = _outputs(data.val_x)
    unnamed = {"output_0": out["scores"], "output_1": out["boxes"]}
    with pytest.raises(ConfigError, match="signature.logits_output") as err:
        resolve_metric("detection_recall", None)(unnamed, data.val_y.numpy())
    assert "output_0" in str(err.value) and "output_1" in str(err.value)
    assert resolve_metric("detection_recall", "output_0")(unnamed, data.val_y.numpy()) == pytest.approx(1.0)


def test_detection_recall_counts_confident_predictions_only() -> None:
    """A head whose every score lies below the decision threshold detects nothing: recall 0, though each box is
    still where it was."""
    data = _data()
    out = _outputs(data.val_x)
    quiet = {"boxes": out["boxes"], "scores": out["scores"] - 20.0}
    assert resolve_metric("detection_recall", "scores")({**quiet, "scores": out["scores"]}, data.val_y.numpy()) == 1.0
    assert resolve_metric("detection_recall", "scores")(quiet, data.val_y.numpy()) == 0.0


def test_a_reference_metric_of_zero_is_said(caplog: pytest.LogCaptureFixture) -> None:
    """Labels no prediction overlaps: the reference's recall is 0, and every engine's drop from it is 0 or less, so
    max_metric_drop can fail none: said as a warning."""
    data = _data()
    far = data.val_y.clone()
    far[:, 0, 1:] = torch.tensor([1000.0, 1000.0, 1010.0, 1010.0])
    data = DatasetSplits(data.train_x, data.train_y, data.val_x, far, num_classes=CLASSES)
    feeds = held_out(data, lambda v: as_feed(v, ["input"]), {}, {}, None)
    cfg = CheckConfig(metric="detection_recall")
    with caplog.at_level("WARNING", logger="kiln.validate"):
        ref = held_out_reference(_torch_run(TinyDetector()), feeds, data, "scores", cfg, [8], {}, named=True)
    assert ref.metric_value == 0.0
    assert "detection_recall" in caplog.text and "max_metric_drop" in caplog.text


# the relative-error gate on the outputs beside the class logits


def test_boxes_shrunk_by_30_percent_fail_int8_and_a_faithful_engine_passes_fp32(tmp_path: Path) -> None:
    """Boxes in pixels share the anchor grid, so a 30 % shrink keeps their cosine over 0.99 (INT8's gate) and their
    error relative to their norm under 0.1; relative to how the boxes vary between images it is far over INT8's
    sqrt(2 (1 - 0.99)). The exported, unchanged detector in ONNX Runtime passes FP32's gates."""
    entry, failures, _ = _judge(_engine(TinyDetector(shrink=0.7), tmp_path, "shrunk"), "int8")
    assert entry.outputs["boxes"]["cosine"] > 0.99
    assert [f for f in failures if "boxes" in f] == [
        f"output 'boxes' relative error {entry.outputs['boxes']['rel_err']:.4g} > max_rel_err 0.1414"
    ]
    entry, failures, _ = _judge(_engine(TinyDetector(), tmp_path, "same"), "fp32", "detection_recall")
    assert failures == [] and entry.metric == pytest.approx(1.0)


def test_the_class_logits_are_free_of_a_relative_error_no_one_set_only_in_an_8_bit_engine(tmp_path: Path) -> None:
    """Logits scaled by 1.5 decide every class as before: in an INT8 engine, whose calibrated ranges may move a
    whole output's scale, top-1 agreement guards them; an FP32 or FP16 engine keeps the softmax's confidence, so
    there they fail the relative error cosine derives. Setting max_rel_err holds them to it in any engine."""
    engine = _engine(TinyDetector(scale=1.5), tmp_path, "scaled")
    entry, failures, _ = _judge(engine, "int8")
    assert entry.top1_agreement == 1.0 and failures == []
    for precision in ("fp32", "fp16"):
        entry, failures, _ = _judge(engine, precision)
        assert entry.cosine > 0.9999 and len(failures) == 1
        limit = derived_rel_err(gates_for(CheckConfig(), precision))
        assert failures[0].startswith("output 'scores' relative error") and failures[0].endswith(f"{limit:.4g}")
    entry.outputs["boxes"]["rel_err"] = 0.0
    held = accuracy_failures(entry, gates_for(CheckConfig(gates={"max_rel_err": 0.1}), "int8"), None)
    assert held and held[0].startswith("output 'scores' relative error")


# top-1 agreement over a dense head's anchors


def test_top1_agreement_counts_the_anchors_the_reference_is_confident_at(tmp_path: Path) -> None:
    """Perturbed class weights flip the argmax of many background anchors, whose four logits all lie near -5 (no
    class the reference picks at half the probability or more): INT8 passes on its foreground anchors, which
    all agree. An engine that swaps the classes of confident anchors fails."""
    entry, failures, ref = _judge(_engine(TinyDetector(jitter=0.1), tmp_path, "jittered"), "int8", "detection_recall")
    scores = ref.outputs[-1]["scores"].reshape(-1, CLASSES)
    with torch.no_grad():
        got = TinyDetector(jitter=0.1)(torch.from_numpy(ref.feeds[-1][1]["input"]))["scores"].numpy()
    assert np.mean(scores.argmax(1) == got.reshape(-1, CLASSES).argmax(1)) < 0.9  # over every anchor
    assert entry.top1_agreement == 1.0 and failures == []

    def swapped(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = _torch_run(TinyDetector())(feed)
        return {"scores": out["scores"][..., ::-1].copy(), "boxes": out["boxes"]}

    entry, failures, _ = _judge(swapped, "int8")
    assert entry.top1_agreement == 0.0 and any(f.startswith("top1_agreement 0.0000") for f in failures)


@pytest.mark.parametrize("num_classes, recall", [(CLASSES, 1.0), (0, 0.0)])
def test_a_detr_head_is_scored_by_its_softmax_where_the_data_declares_its_classes(
    num_classes: int, recall: float
) -> None:
    """A DETR/YOLOS head: logits over the data's classes and a no-object class last, read through their softmax.
    Every query says class 2 at 64 % with logits all below 0, which a sigmoid's reading takes for no class; the
    validation's reference reads it through the classes the data declares."""
    data = _data()
    data.num_classes = num_classes
    feeds = held_out(data, lambda v: as_feed(v, ["input"]), {}, {}, None)

    def run(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One query per image: the detector's box at its object's cell, that object's class at -1 beside -3s."""
        out, rows = _torch_run(TinyDetector())(feed), np.arange(len(feed["input"]))
        cell = out["scores"].max(-1).argmax(-1)
        logits = np.full((len(rows), 1, CLASSES + 1), -3.0, np.float32)
        logits[rows, 0, out["scores"][rows, cell].argmax(-1)] = -1.0  # p = 0.64 against 4 others at -3
        return {"logits": logits, "pred_boxes": out["boxes"][rows, cell][:, None]}

    cfg = CheckConfig(metric="detection_recall")
    ref = held_out_reference(run, feeds, data, "logits", cfg, [1, 8], {}, named=True)
    assert ref.metric_value == recall
