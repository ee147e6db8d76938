"""A tensor that is infinite on purpose (a policy's logits masked with -inf) under every calibration method: the
histogram methods (entropy, percentile) calibrate the other tensors and mark it unbounded, as minmax does, so the
nodes that make and read it stay in float instead of numpy's histogram stopping the run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from kiln.calibration.ranges import calibrate
from kiln.cli import main
from tests.calibration import calib_graphs


def masked_logits_onnx(path: Path) -> Path:
    """x [batch, 4] -> MatMul -> logits; Where(mask, logits, -inf) -> y [batch, 3], mask a bool input: an
    actor-critic's logits with its illegal actions filled with -inf (torch's masked_fill)."""
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["logits"], name="matmul"),
            helper.make_node("Where", ["mask", "logits", "fill"], ["y"], name="mask"),
        ],
        "masked_logits",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4]),
            helper.make_tensor_value_info("mask", TensorProto.BOOL, ["batch", 3]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
        [
            numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "w"),
            numpy_helper.from_array(np.array(-np.inf, np.float32), "fill"),
        ],
    )
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(path))
    return path


@pytest.mark.parametrize(
    "method, symmetric",
    [("entropy", True), ("percentile", True), ("percentile", False), ("minmax", True)],
)
def test_an_infinite_tensor_is_unbounded_and_the_rest_calibrated(tmp_path: Path, method: str, symmetric: bool) -> None:
    model = masked_logits_onnx(tmp_path / "m.onnx")
    for hit in (False, True):  # the second call reads the cached ranges back: the same, infinity included
        ranges = calibrate(model, calib_graphs.routed_batches(), "x", method, cache_dir=tmp_path, symmetric=symmetric)
        assert ranges.cache_hit is hit
        assert ranges.unbounded() == ["y"], {n: td.range_value for n, td in ranges.tensors.items()}
        amax = ranges.amax()
        assert {"x", "logits"} <= set(amax) and 0 < amax["x"] < np.inf and 0 < amax["logits"] < np.inf, amax
        assert np.asarray(ranges.tensors["y"].range_value[0]).item() == -np.inf


@pytest.mark.parametrize("method", ["entropy", "percentile", "minmax"])
def test_precision_keeps_the_masked_node_in_float_under_every_method(tmp_path: Path, method: str) -> None:
    model = masked_logits_onnx(tmp_path / "m.onnx")
    feed = tmp_path / "x.npz"
    np.savez(feed, **{k: np.concatenate([b[k] for b in calib_graphs.routed_batches(16)]) for k in ("x", "mask")})
    args = ["precision", str(model), "-o", str(tmp_path / "v"), "--variants", "int8", "--calibration", str(feed)]
    result = CliRunner().invoke(main, [*args, "--set", f"calibration.method={method}"])
    assert result.exit_code == 0, result.output
    int8 = json.loads((tmp_path / "v" / "variants.json").read_text())["variants"]["int8"]
    assert "mask" in int8["kept_fp32"], int8
    assert int8["reasons"]["mask"] == "'y' is not finite on calibration data (no INT8/FP8 scale holds it)", int8
    graph = onnx.load(str(tmp_path / "v" / "int8" / "model.onnx")).graph
    assert any(n.op_type == "DequantizeLinear" for n in graph.node)  # the MatMul is INT8


@pytest.mark.parametrize("method, symmetric", [("entropy", True), ("percentile", True), ("percentile", False)])
def test_histogram_methods_take_batches_of_different_sizes(tmp_path: Path, method: str, symmetric: bool) -> None:
    """The precision stage calibrates the data's batches and others at each validated size: ORT's histogram
    collector stacked them into one array, which batches of 16 and 5 rows do not make."""
    batches = [*calib_graphs.batches(1, 16), *calib_graphs.batches(1, 5, seed=1)]
    ranges = calibrate(calib_graphs.saved(tmp_path), batches, "input", method, cache_dir=None, symmetric=symmetric)
    amax = ranges.amax()
    assert not ranges.unbounded() and {"input", "logits"} <= set(amax) and 0 < amax["logits"] < np.inf, amax
