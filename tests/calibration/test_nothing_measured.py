"""Issue 31 rule 2: a calibration that measured nothing (all-zero data, NaN or infinite inputs or every range so, a
float input whose range is 0) is an error, never INT8 scales and never a run that says it passed. A tensor inside
the graph that is not finite on purpose (T5's log of 0, a -inf mask) is no error: the nodes that make and read it
stay in float."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from kiln.calibration.ranges import check_ranges
from kiln.cli import main
from kiln.core.errors import InputError
from tests.pipeline.test_faults import assert_clean, tiny_onnx


class _Range:
    def __init__(self, lo: float, hi: float) -> None:
        self.range_value = (np.float32(lo), np.float32(hi))


@pytest.mark.parametrize(
    "ranges, needle",
    [
        ({"input": (0, 0), "logits": (0, 0)}, "measured nothing"),
        ({"logits": (np.nan, np.inf)}, "NaN or infinite ranges for 1 tensors"),  # every one there is
        ({"input": (-np.inf, 1), "logits": (0, 1)}, r"NaN or infinite ranges for 1 inputs \(input\)"),
        ({"input": (0, 0), "logits": (-1, 2)}, "calibration input 'input' is 0 in every sample"),
    ],
)
def test_ranges_that_cannot_be_right(tmp_path: Path, ranges: dict, needle: str) -> None:
    model = tiny_onnx(tmp_path / "m.onnx")
    with pytest.raises(InputError, match=needle):
        check_ranges({k: _Range(*v) for k, v in ranges.items()}, model)


def test_ranges_of_real_data_pass(tmp_path: Path) -> None:
    check_ranges({"input": _Range(0, 1), "logits": _Range(-3, 4)}, tiny_onnx(tmp_path / "m.onnx"))
    check_ranges({"input": _Range(0, 1), "logits": _Range(-np.inf, 4)}, tiny_onnx(tmp_path / "m.onnx"))


def log_of_zero_onnx(path: Path) -> Path:
    """input [batch, 4] -> Relu -> Log (-inf where the input is not positive) -> Max(-8) -> MatMul -> logits [batch, 3]:
    an infinity inside the graph on purpose, as T5's relative position buckets take the log of 0."""
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [
            helper.make_node("Relu", ["input"], ["r"], name="relu"),
            helper.make_node("Log", ["r"], ["l"], name="log"),
            helper.make_node("Max", ["l", "floor"], ["m"], name="floor"),
            helper.make_node("MatMul", ["m", "w"], ["logits"], name="matmul"),
        ],
        "log_of_zero",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 3])],
        [
            numpy_helper.from_array(np.array(-8.0, np.float32), "floor"),
            numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "w"),
        ],
    )
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(path))
    return path


def test_a_tensor_that_is_infinite_on_purpose_stays_in_float_and_int8_is_built(tmp_path: Path) -> None:
    model = log_of_zero_onnx(tmp_path / "m.onnx")
    feed = tmp_path / "x.npz"
    np.savez(feed, input=np.random.default_rng(1).standard_normal((64, 4)).astype(np.float32))  # half <= 0
    args = ["precision", str(model), "-o", str(tmp_path / "v"), "--variants", "int8", "--calibration", str(feed)]
    with warnings.catch_warnings():  # ORT's scale of the infinite tensor (unused) warned of a NaN, bare
        warnings.simplefilter("error", RuntimeWarning)
        result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "RuntimeWarning" not in result.output, result.output
    int8 = json.loads((tmp_path / "v" / "variants.json").read_text())["variants"]["int8"]
    assert int8["fallback_passed"], int8
    # the Log that makes the infinity and the Max that reads it stay in float, each saying why; the MatMul is INT8
    assert {"log", "floor"} <= set(int8["kept_fp32"]) and "not finite" in int8["reasons"]["log"], int8
    graph = onnx.load(str(tmp_path / "v" / "int8" / "model.onnx")).graph
    assert any(n.op_type == "DequantizeLinear" for n in graph.node)
    assert not any(n.op_type == "QuantizeLinear" and n.input[0] in ("l", "r") for n in graph.node)


@pytest.mark.parametrize("twice", [False, True])  # the second run reads the cached ranges: checked the same
def test_all_zero_calibration_data_is_an_error(tmp_path: Path, twice: bool) -> None:
    model = tiny_onnx(tmp_path / "m.onnx")
    feed = tmp_path / "zeros.npz"
    np.savez(feed, input=np.zeros((8, 4), np.float32))
    args = ["precision", str(model), "-o", str(tmp_path / "v"), "--variants", "int8", "--calibration", str(feed)]
    for _ in range(2 if twice else 1):
        result = CliRunner().invoke(main, args)
    assert_clean(result, 2, "calibration measured nothing")
    assert "fix:" not in next(ln for ln in result.output.splitlines() if ln.startswith("error:")), result.output


def test_a_range_that_is_not_finite_has_an_infinite_amax_whichever_bound_it_is() -> None:
    from kiln.calibration.ranges import Ranges

    tensors = {"a": _Range(0, np.nan), "b": _Range(-2, 3), "c": _Range(-np.inf, 1)}
    ranges = Ranges(tensors, None, "key", False, "minmax")
    assert ranges.amax() == {"a": np.inf, "b": 3.0, "c": np.inf} and ranges.unbounded() == ["a", "c"]
