"""INT8 of a graph whose compute nodes sit inside a Loop body, which ONNX Runtime's quantizers (as Kiln calls them)
never reach: all of them there is an INT8 variant not made, said as such before any calibration; some of them
there leaves those nodes in float, counted among the nodes kept FP32."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.core.errors import ModelError
from kiln.pipeline.config import config_from_dict
from kiln.pipeline.runner import settings_for
from kiln.pipeline.stage_list import stage_named
from kiln.stages.precision.direct import precision_direct

FEATURES = 8


def _loop_graph(path: Path, head: bool) -> Path:
    """``h = tanh(h @ W + x @ U)`` three times in a Loop body (``x`` read from the outer scope), then, with ``head``,
    one MatMul in the main graph; input ``x [batch, 8]``, output ``logits``."""
    rng = np.random.default_rng(0)
    body = helper.make_graph(
        [
            helper.make_node("MatMul", ["h_in", "W"], ["hw"], name="recur"),
            helper.make_node("MatMul", ["x", "U"], ["xu"], name="feed"),
            helper.make_node("Add", ["hw", "xu"], ["pre"]),
            helper.make_node("Tanh", ["pre"], ["h_out"]),
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
        ],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("h_in", TensorProto.FLOAT, ["batch", FEATURES]),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("h_out", TensorProto.FLOAT, ["batch", FEATURES]),
        ],
    )
    last = "logits" if not head else "h"
    nodes = [
        helper.make_node("Mul", ["x", "zero"], ["h0"], name="start"),
        helper.make_node("Loop", ["trips", "go", "h0"], [last], name="steps", body=body),
    ]
    if head:
        nodes.append(helper.make_node("MatMul", ["h", "V"], ["logits"], name="head"))
    weights = {n: (rng.standard_normal((FEATURES, FEATURES)) * 0.4).astype(np.float32) for n in ("W", "U", "V")}
    consts = {"zero": np.zeros((), np.float32), "trips": np.array(3, np.int64), "go": np.array(True)}
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", FEATURES])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", FEATURES])],
        [numpy_helper.from_array(v, k) for k, v in {**weights, **consts}.items() if head or k != "V"],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


def _data(path: Path) -> Path:
    np.savez(path, x=np.random.default_rng(1).standard_normal((64, FEATURES)).astype(np.float32))
    return path


def _settings() -> object:
    return settings_for(stage_named("precision"), config_from_dict({}))


def test_int8_of_a_graph_whose_compute_is_all_inside_a_loop_body_says_so(tmp_path: Path) -> None:
    model, feed = _loop_graph(tmp_path / "loop.onnx", head=False), _data(tmp_path / "d.npz")
    with pytest.raises(ModelError) as raised:
        precision_direct(model, tmp_path / "v", ["int8"], feed, _settings())
    said = raised.value.message
    assert "compute nodes (MatMul x2) are inside a Loop body, which INT8 quantization does not reach" in said, said
    assert "fallback" not in said and "leave int8 out of precision.variants" in (raised.value.hint or "")


def test_int8_counts_the_loop_body_nodes_it_leaves_in_float(tmp_path: Path) -> None:
    model, feed = _loop_graph(tmp_path / "loop.onnx", head=True), _data(tmp_path / "d.npz")
    summary = precision_direct(model, tmp_path / "v", ["int8"], feed, _settings())
    int8 = summary["variants"]["int8"]
    assert int8["kept_fp32"] >= 2, int8  # the Loop's two MatMuls compute in float: not "0 nodes kept FP32"
    listed = onnx.load(int8["path"])
    assert any(n.op_type == "DequantizeLinear" for n in listed.graph.node)  # the head is quantized
