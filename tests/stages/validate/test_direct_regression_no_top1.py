"""``kiln validate ENGINE --reference`` of a regression model (a forecaster's mean and log-variance): the note that
no top-1 agreement was computed tells its user plainly that naming class logits does not apply to values, and is no
warning at all where no output has a class axis (nothing could be named)."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.core.records import EngineValidation
from kiln.stages.validate.direct import _say_no_top1
from tests.pipeline.test_faults import invoke


def _forecaster(path: Path) -> Path:
    """input [batch, 8] -> mean [batch, 1] and log_var [batch, 1]: a probabilistic forecaster's two heads."""
    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array(rng.standard_normal((8, 1)).astype(np.float32), k) for k in ("wm", "wv")]
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "wm"], ["mean"]), helper.make_node("MatMul", ["x", "wv"], ["log_var"])],
        "forecaster",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info(k, TensorProto.FLOAT, ["batch", 1]) for k in ("mean", "log_var")],
        weights,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
    return path


def test_a_forecasters_validation_says_naming_logits_does_not_apply(tmp_path: Path) -> None:
    model, engine, inputs = _forecaster(tmp_path / "m.onnx"), tmp_path / "e", tmp_path / "x.npz"
    assert invoke("build", model, "-o", engine).exit_code == 0
    np.savez(inputs, x=np.random.default_rng(1).standard_normal((64, 8)).astype(np.float32))
    out = invoke("validate", engine, "--reference", model, "--inputs", inputs)
    assert out.exit_code == 0, out.output
    said = " ".join(out.output[: out.output.index("{")].split())
    assert "no top-1 agreement: 2 outputs (mean, log_var)" in said, said
    assert "for a regression's values this does not apply: nothing to fix" in said, said


def _levels(caplog: pytest.LogCaptureFixture, ref: dict[str, np.ndarray], logits: str | None = None) -> list[str]:
    entry = EngineValidation(name="e", backend="onnxruntime", precision="fp32", device="cpu", status="validated")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kiln"):
        _say_no_top1(ref, None, logits, entry)
    return [r.levelname for r in caplog.records if "no top-1 agreement" in r.getMessage()]


def test_values_without_a_class_axis_are_no_warning(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two [N] outputs (a forecast and its spread): no output could be named for top-1 agreement, so the note is
    information; outputs that could be class scores ([N, 5] beside [N, 8]) are warned of as before, without the
    regression's note."""
    monkeypatch.setattr(logging.getLogger("kiln"), "propagate", True)  # the CLI tests turn it off
    values = {"mean": np.zeros(4, np.float32), "spread": np.ones(4, np.float32)}
    assert _levels(caplog, values) == ["INFO"]
    scores = {"scores": np.zeros((4, 5), np.float32), "hidden": np.zeros((4, 8), np.float32)}
    assert _levels(caplog, scores) == ["WARNING"]
    assert "does not apply" not in caplog.text
