"""How report.md and the validate log say outputs served unbatched: those the runtime probe saw follow the batch,
and those the graph alone flags (a selection over the batch the probe found rows unmoved by)."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.core.records import Baseline, ValidationResult
from kiln.stages.validate.report import report_section
from kiln.stages.validate.stage import _coupled


def _compared(coupled: list[str]) -> str:
    b = Baseline(accuracy=None, samples=8, latency_ms={}, compared=["logits", "aux_loss", "feats"])
    v = ValidationResult(passed=True, baseline=b, engines=[], failures=[], batch_coupled=coupled)
    return next(x for x in report_section(v) if x.startswith("Compared outputs"))


def test_the_report_says_outputs_served_unbatched_may_depend_on_the_batch_and_why() -> None:
    """A sparse-dispatch MoE (torch.nonzero, index_add_) whose rows the probe found independent read "'logits'
    depends on the whole batch (its rows are not the samples')"; two outputs read "its rows" too."""
    one = _compared(["logits"])
    assert "'logits' depends on the whole batch, or may: the runtime probe saw its rows follow the batch" in one, one
    assert "selects over the batch (NonZero, Compress or Unique on batched values)" in one and "unbatched" in one
    two = _compared(["logits", "aux_loss"])
    assert "'logits', 'aux_loss' depend on the whole batch, or may: the runtime probe saw their rows" in two, two


def _selecting_graph(path: Path) -> Path:
    """``x[x > 0]`` summed back per row: a NonZero over the batch, computing rows that keep to themselves."""
    zero = numpy_helper.from_array(np.array(0.0, np.float32), "zero")
    nodes = [
        helper.make_node("Greater", ["x", "zero"], ["mask"]),
        helper.make_node("NonZero", ["mask"], ["where"]),
        helper.make_node("Transpose", ["where"], ["idx"]),
        helper.make_node("GatherND", ["x", "idx"], ["picked"]),
        helper.make_node("ScatterND", ["x", "idx", "picked"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        [zero],
    )
    (path / "model.onnx").parent.mkdir(parents=True, exist_ok=True)
    onnx.save(helper.make_model(graph), path / "model.onnx")
    return path


def test_the_log_says_an_output_the_graph_alone_flags_is_served_unbatched_to_be_safe(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ctx = SimpleNamespace(inputs={"export": _selecting_graph(tmp_path / "export")}, log=logging.getLogger("kiln.t"))
    with caplog.at_level(logging.WARNING, logger="kiln.t"):
        assert _coupled(ctx, []) == ["y"]
    said = " ".join(caplog.messages)
    assert "outputs ['y'] may depend on the whole batch" in said and "to be safe" in said, said
    assert "runtime probe found each row it ran alone equal to that row in the batch" in said, said
