"""kiln.stages.optimize.api: the safety net runs a graph whose inferred shapes mislead ONNX Runtime (one size name
for two sizes) as ORT runs the file: without them, and ships the result so."""

from __future__ import annotations

import numpy as np
import onnx

from kiln.core.onnx_io import infer_shapes, ort_run, ort_session
from kiln.stages.optimize import api
from kiln.stages.optimize.api import optimize_model
from kiln.stages.optimize.config import OptimizeConfig
from tests.core.test_onnx_io_sequences import split_weight_model


def _one_name_for_both(model: onnx.ModelProto, strict: bool = True) -> onnx.ModelProto:
    """Inference as ONNX's misled one: the [32, 32] and [64, 32] parts recorded with one size name."""
    model = infer_shapes(model, strict)
    for value in model.graph.value_info:
        if value.name in ("q", "kv"):
            value.type.tensor_type.shape.dim[0].dim_param = "rows"
    return model


def test_a_graph_ort_runs_without_its_inferred_shapes_is_verified_and_shipped_without_them(monkeypatch) -> None:
    monkeypatch.setattr(api, "infer_shapes", _one_name_for_both)
    out, summary = optimize_model(split_weight_model(), OptimizeConfig())
    assert summary["verified"]
    q, kv = ort_run(ort_session(out), {"x": np.ones((32, 2), np.float32)})
    assert q.shape == (32, 2) and kv.shape == (64, 2)


def test_a_split_weight_is_optimized_and_verified() -> None:
    out, summary = optimize_model(split_weight_model(), OptimizeConfig())
    assert summary["verified"]
    assert ort_run(ort_session(out), {"x": np.ones((32, 2), np.float32)})[1].shape == (64, 2)
