"""An embedding-heavy graph (a recommender: most weight bytes in the tables its Gather nodes read) whose INT8
variant keeps those tables in float under the default calibration.op_types: the precision stage says so, with the
share of bytes and the --set that stores them in int8, in its warning and in the report."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.calibration.config import CalibrationConfig
from kiln.stages.precision.declaration import PrecisionSummary
from kiln.stages.precision.report import report_section
from kiln.stages.precision.tables import float_tables_hint
from tests.pipeline.test_faults import invoke


def embedding_onnx(path: Path | None = None) -> onnx.ModelProto:
    """ids [batch] int64 -> Gather of a 2000 x 16 table -> MatMul 16 x 4 -> y [batch, 4]."""
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [
            helper.make_node("Gather", ["table", "ids"], ["e"], name="embed"),
            helper.make_node("MatMul", ["e", "w"], ["y"], name="head"),
        ],
        "embedding",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        [
            numpy_helper.from_array(rng.standard_normal((2000, 16)).astype(np.float32), "table"),
            numpy_helper.from_array(rng.standard_normal((16, 4)).astype(np.float32), "w"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    if path is not None:
        onnx.save_model(model, str(path))
    return model


def test_hint_names_the_share_the_op_and_the_setting() -> None:
    hint = float_tables_hint(embedding_onnx(), CalibrationConfig())
    assert hint is not None and "99% of the graph's weight bytes" in hint and "Gather" in hint, hint
    assert "--set 'calibration.op_types=[" in hint and ",Gather]'" in hint, hint


@pytest.mark.parametrize("update", [{"op_types": ["MatMul", "Gather"]}, {"exclude_op_types": ["Gather"]}])
def test_no_hint_where_the_tables_are_listed_or_kept_on_purpose(update: dict[str, list[str]]) -> None:
    assert float_tables_hint(embedding_onnx(), CalibrationConfig(**update)) is None


def test_report_shows_the_hint() -> None:
    summary = PrecisionSummary(variants={"int8": {"kept_fp32": 0, "float_tables": "int8: 99% of the bytes"}})
    assert "`int8`: int8: 99% of the bytes." in report_section(summary)


def test_kiln_precision_warns(tmp_path: Path) -> None:
    embedding_onnx(tmp_path / "m.onnx")
    np.savez(tmp_path / "calib.npz", ids=np.random.default_rng(1).integers(0, 2000, 64))
    out = invoke(
        "precision",
        tmp_path / "m.onnx",
        "-o",
        tmp_path / "v",
        "--variants",
        "int8",
        "--calibration",
        tmp_path / "calib.npz",
    )
    assert out.exit_code == 0, out.output
    said = [ln for ln in out.output.splitlines() if "weight bytes" in ln]
    assert len(said) == 1 and "Gather" in said[0] and "--set 'calibration.op_types=[" in said[0], out.output
