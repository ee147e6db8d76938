"""INT8 graphs of models ORT's quantizers handle partly: embedding tables (Gather) in the dynamic ONNX Runtime CPU
graph where calibration.op_types lists Gather, and graphs whose If bodies read outer tensors, which must come out
in an order the ONNX checker takes."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.calibration.config import DEFAULT_OP_TYPES, CalibrationConfig
from kiln.calibration.quantize import (
    UNREACHED,
    dynamic_op_types,
    int8_tables,
    quantize_int8,
    quantize_int8_dynamic,
    unbounded_nodes,
)
from kiln.calibration.ranges import calibrate
from kiln.core.onnx_io import ort_session
from tests.calibration.calib_graphs import routed_batches, routed_onnx

WITH_GATHER = CalibrationConfig(op_types=[*DEFAULT_OP_TYPES, "Gather"])


def _weights(*shape: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * 0.5).astype(np.float32)


def _saved(path: Path, nodes: list[onnx.NodeProto], x: onnx.ValueInfoProto, inits: dict[str, np.ndarray]) -> Path:
    graph = helper.make_graph(
        nodes,
        "g",
        [x],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.save(model, path)
    return path


def _recommender(path: Path) -> Path:
    """ids [N, 3] -> rows of a 64 x 16 table -> their mean -> a 16 x 4 MatMul."""
    nodes = [
        helper.make_node("Gather", ["table", "ids"], ["rows"], name="lookup"),
        helper.make_node("ReduceMean", ["rows"], ["mean"], name="pool", axes=[1], keepdims=0),
        helper.make_node("MatMul", ["mean", "w"], ["y"], name="head"),
    ]
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, ["n", 3])
    return _saved(path, nodes, ids, {"table": _weights(64, 16), "w": _weights(16, 4, seed=1)})


def _run(path: Path, feed: dict[str, np.ndarray]) -> np.ndarray:
    return ort_session(path).run(None, feed)[0]


def test_gather_in_op_types_stores_the_dynamic_graphs_embedding_table_in_int8(tmp_path: Path) -> None:
    """The ONNX Runtime CPU graph follows calibration.op_types for Gather: its table stored in 8 bits (a quarter of
    its size) and its answers still the float graph's, and left float where Gather is not listed."""
    src = _recommender(tmp_path / "m.onnx")
    assert "Gather" in dynamic_op_types(WITH_GATHER) and "Gather" not in dynamic_op_types(CalibrationConfig())
    info = quantize_int8_dynamic(src, tmp_path / "q.onnx", WITH_GATHER)
    quantized = onnx.load(tmp_path / "q.onnx")
    assert info["int8_tables"] == 1 and int8_tables(quantized) == ["lookup"]
    assert (tmp_path / "q.onnx").stat().st_size < src.stat().st_size / 2
    ids = np.random.default_rng(2).integers(0, 64, (8, 3))
    ref, got = _run(src, {"ids": ids}), _run(tmp_path / "q.onnx", {"ids": ids})
    assert np.abs(got - ref).max() < 0.05 * np.abs(ref).max()
    assert quantize_int8_dynamic(src, tmp_path / "f.onnx", CalibrationConfig())["int8_tables"] == 0
    excluded = WITH_GATHER.model_copy(update={"exclude_op_types": ["Gather"]})
    assert quantize_int8_dynamic(src, tmp_path / "e.onnx", excluded)["int8_tables"] == 0


def _branching(path: Path) -> Path:
    """y = If(sum(x) > 0, 2 relu(x w), -2 relu(x w)), whose branches read ``a`` from the outer graph: ORT's quantizer
    sorts by listed inputs alone, and the If lists only its condition, which is ready before ``a``."""
    then = helper.make_graph(
        [helper.make_node("Identity", ["a"], ["t"])], "then", [], [helper.make_tensor_value_info("t", 1, None)]
    )
    other = helper.make_graph(
        [helper.make_node("Neg", ["a"], ["e"])], "else", [], [helper.make_tensor_value_info("e", 1, None)]
    )
    nodes = [
        helper.make_node("ReduceSum", ["x"], ["s"], name="sum", keepdims=0),
        helper.make_node("MatMul", ["x", "w"], ["h"], name="matmul"),
        helper.make_node("Greater", ["s", "zero"], ["cond"], name="positive"),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("Mul", ["r", "two"], ["a"], name="double"),
        helper.make_node("If", ["cond"], ["y"], name="branch", then_branch=then, else_branch=other),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8])
    inits = {"w": _weights(8, 4), "zero": np.zeros((), np.float32), "two": np.full((), 2, np.float32)}
    return _saved(path, nodes, x, inits)


@pytest.mark.parametrize("scheme", ["static", "dynamic"])
def test_quantized_graphs_whose_if_bodies_read_outer_tensors_pass_the_checker(tmp_path: Path, scheme: str) -> None:
    src = _branching(tmp_path / "m.onnx")
    x = np.random.default_rng(3).random((16, 8), dtype=np.float32)
    out = tmp_path / "q.onnx"
    if scheme == "static":
        quantize_int8(src, out, calibrate(src, [x], "x", "minmax", cache_dir=None), CalibrationConfig())
    else:
        quantize_int8_dynamic(src, out, CalibrationConfig())
    quantized = onnx.load(out)
    onnx.checker.check_model(quantized)
    assert any(n.op_type in ("QuantizeLinear", "MatMulInteger") for n in quantized.graph.node)
    assert np.abs(_run(out, {"x": x}) - _run(src, {"x": x})).max() < 0.1


@pytest.mark.parametrize("scheme", ["static", "dynamic"])
def test_quantizing_leaves_the_root_loggers_handlers_as_they_were(
    tmp_path: Path, scheme: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ORT's quantizers log with the module-level ``logging.warning()``, which gives a root logger without handlers
    a handler of its own (``logging.basicConfig``); Kiln takes it away again, so the process's logging is as it
    was (no raw ``WARNING:name:...`` lines in a notebook from then on)."""
    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # a plain Python process's root logger
    src = _branching(tmp_path / "m.onnx")
    x = np.random.default_rng(3).random((16, 8), dtype=np.float32)
    if scheme == "static":
        quantize_int8(src, tmp_path / "q.onnx", calibrate(src, [x], "x", "minmax", cache_dir=None), CalibrationConfig())
    else:
        quantize_int8_dynamic(src, tmp_path / "q.onnx", CalibrationConfig())
    assert logging.getLogger().handlers == []


def test_unreached_nodes_are_kept_in_float_for_their_own_reason(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A routed branch no calibration sample takes is not "not finite": its nodes stay in float with their own reason,
    said in one warning naming them; an infinite tensor's nodes keep theirs."""
    path = routed_onnx(tmp_path / "m.onnx")
    ranges = calibrate(path, routed_batches(), "x", "minmax", cache_dir=None)
    model = onnx.load(str(path))
    with caplog.at_level(logging.INFO, logger="kiln.calibration"):
        kept = unbounded_nodes(model, ranges)
        quantize_int8(path, tmp_path / "q.onnx", ranges, CalibrationConfig(), kept)
    assert kept["mask"] == "'y' is not finite on calibration data (no INT8/FP8 scale holds it)", kept
    assert kept["gather_rows"] == kept["expert"] == kept["expert_act"] == UNREACHED, kept
    assert "no calibration sample reached it" in UNREACHED and "matmul" not in kept
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "reached 3 nodes (gather_rows, expert, expert_act)" in warned[0], warned
    assert "fix: calibrate on data that takes every branch" in warned[0]
    graph = onnx.load(str(tmp_path / "q.onnx")).graph
    quantized = {n.input[0] for n in graph.node if n.op_type == "DequantizeLinear"}
    assert not any(t.startswith(("routed", "expert")) for t in quantized), quantized  # the branch stays float
    assert any(n.op_type == "DequantizeLinear" for n in graph.node)  # the reached MatMul is INT8
