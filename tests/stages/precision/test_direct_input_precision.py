"""`kiln precision FILE` takes an FP32 graph: a file already INT8 (Q/DQ or integer ops) or FP16 is one error/fix pair
up front, naming what was found and asking for the FP32 graph, where ONNX Runtime failed inside quantization with a
wrong fix and an FP16 graph was written as the fp32 variant. An FP32 graph with a little FP16 in it still passes.
A calibration set of very few rows is warned about."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from kiln.cli import main
from kiln.stages.precision.audit import audit_graph
from tests.pipeline.test_faults import assert_clean
from tests.stages.precision.precision_graphs import OPSET, rng_weights


def _fp32_graph() -> onnx.ModelProto:
    """input [batch, 16] -> MatMul 16x64 -> Relu -> MatMul 64x10 -> logits."""
    nodes = [
        helper.make_node("MatMul", ["input", "w1"], ["h"], name="mm1"),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("MatMul", ["r", "w2"], ["logits"], name="mm2"),
    ]
    inits = [numpy_helper.from_array(rng_weights(16, 64), "w1"), numpy_helper.from_array(rng_weights(64, 10), "w2")]
    return _model(nodes, inits)


def _model(nodes: list[onnx.NodeProto], inits: list[onnx.TensorProto]) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    return model


def _qdq_graph() -> onnx.ModelProto:
    """The FP32 graph's MatMuls on Q/DQ activations and INT8 weights, as a static quantizer writes them."""
    scale, zero = numpy_helper.from_array(np.array(0.05, np.float32), "s"), numpy_helper.from_array(np.int8(0), "z")
    nodes, inits = [], [scale, zero]
    for i, (a, w, y) in enumerate([("input", (16, 64), "h"), ("r", (64, 10), "logits")]):
        inits.append(
            numpy_helper.from_array(np.clip(rng_weights(*w, seed=i) / 0.05, -127, 127).astype(np.int8), f"q{i}")
        )
        nodes += [
            helper.make_node("QuantizeLinear", [a, "s", "z"], [f"aq{i}"], name=f"quant{i}"),
            helper.make_node("DequantizeLinear", [f"aq{i}", "s", "z"], [f"a{i}"], name=f"dequant{i}"),
            helper.make_node("DequantizeLinear", [f"q{i}", "s", "z"], [f"w{i}"], name=f"dequant_w{i}"),
            helper.make_node("MatMul", [f"a{i}", f"w{i}"], [y], name=f"mm{i}"),
        ]
    nodes.insert(4, helper.make_node("Relu", ["h"], ["r"], name="relu"))
    return _model(nodes, inits)


def _dynamic_int8(tmp: Path) -> onnx.ModelProto:
    """The FP32 graph through ONNX Runtime's dynamic quantization: integer ops (MatMulInteger), no Q/DQ pairs."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    onnx.save(_fp32_graph(), tmp / "fp32.onnx")
    quantize_dynamic(tmp / "fp32.onnx", tmp / "dyn.onnx", weight_type=QuantType.QInt8)
    return onnx.load(tmp / "dyn.onnx")


def _fp16_graph(tmp: Path) -> onnx.ModelProto:
    """The FP32 graph converted to FP16 by onnxconverter-common, its inputs and outputs kept float32."""
    from onnxconverter_common.float16 import convert_float_to_float16

    return convert_float_to_float16(_fp32_graph(), keep_io_types=True)


def _a_little_fp16() -> onnx.ModelProto:
    """An FP32 graph whose small last layer runs in FP16 through casts: a few percent of its FLOPs."""
    nodes = [
        helper.make_node("MatMul", ["input", "w1"], ["h"], name="mm1"),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("MatMul", ["r", "w2"], ["h2"], name="mm2"),
        helper.make_node("Cast", ["h2"], ["h2_16"], name="to16", to=TensorProto.FLOAT16),
        helper.make_node("MatMul", ["h2_16", "w3"], ["y16"], name="mm3"),
        helper.make_node("Cast", ["y16"], ["logits"], name="to32", to=TensorProto.FLOAT),
    ]
    inits = [
        numpy_helper.from_array(rng_weights(16, 64), "w1"),
        numpy_helper.from_array(rng_weights(64, 64, seed=1), "w2"),
        numpy_helper.from_array(rng_weights(64, 10, seed=2).astype(np.float16), "w3"),
    ]
    return _model(nodes, inits)


def _quantized_input_half_weights() -> onnx.ModelProto:
    """An FP32 graph with a Q/DQ pair on its input only and its weights stored as float16, each Cast to float before
    its MatMul: every MatMul computes in float."""
    scale, zero = numpy_helper.from_array(np.array(0.05, np.float32), "s"), numpy_helper.from_array(np.int8(0), "z")
    nodes = [
        helper.make_node("QuantizeLinear", ["input", "s", "z"], ["xq"], name="quant"),
        helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"], name="dequant"),
        helper.make_node("Cast", ["w1_16"], ["w1"], name="w1_to_float", to=TensorProto.FLOAT),
        helper.make_node("Cast", ["w2_16"], ["w2"], name="w2_to_float", to=TensorProto.FLOAT),
        helper.make_node("MatMul", ["xd", "w1"], ["h"], name="mm1"),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("MatMul", ["r", "w2"], ["logits"], name="mm2"),
    ]
    halves = [
        numpy_helper.from_array(rng_weights(*w, seed=i).astype(np.float16), f"w{i + 1}_16")
        for i, w in enumerate([(16, 64), (64, 10)])
    ]
    return _model(nodes, [scale, zero, *halves])


def _precision(tmp: Path, model: onnx.ModelProto, variants: str, rows: int = 64) -> object:
    onnx.save(model, tmp / "m.onnx")
    np.savez(tmp / "d.npz", input=np.random.default_rng(0).standard_normal((rows, 16)).astype(np.float32))
    args = ["precision", tmp / "m.onnx", "-o", tmp / "v", "--variants", variants, "--calibration", tmp / "d.npz"]
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.mark.parametrize(
    ("make", "variants", "found"),
    [
        (lambda tmp: _qdq_graph(), "int8", "2 QuantizeLinear and 4 DequantizeLinear nodes"),
        (_dynamic_int8, "int8", "MatMulInteger"),
        (_fp16_graph, "fp32", "float16 weights"),
        (_fp16_graph, "fp32,int8", "float16 weights"),
    ],
    ids=["qdq", "integer-ops", "fp16-as-fp32", "fp16-to-int8"],
)
def test_an_input_already_in_a_low_precision_is_refused_up_front(
    tmp_path: Path, make, variants: str, found: str
) -> None:
    precision = "FP16" if "float16" in found else "INT8"
    result = _precision(tmp_path, make(tmp_path), variants)
    assert_clean(result, 2, f"is already {precision}", found, "fix: give the FP32 graph")
    assert "opset" not in result.output and not (tmp_path / "v").exists()


def test_an_fp32_graph_with_a_little_fp16_is_taken(tmp_path: Path) -> None:
    result = _precision(tmp_path, _a_little_fp16(), "fp32")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "v" / "fp32" / "model.onnx").is_file()


@pytest.mark.parametrize(("rows", "warned"), [(1, True), (64, False)])
def test_a_calibration_set_of_very_few_rows_is_warned_about(tmp_path: Path, rows: int, warned: bool) -> None:
    result = _precision(tmp_path, _fp32_graph(), "int8", rows)
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert (
        "holds only 1 row: INT8 scales and the variants' accuracy check come from that few samples" in text
    ) == warned, text


def test_a_run_from_a_model_onnx_already_int8_is_refused_before_it_takes_it(tmp_path: Path) -> None:
    """`kiln run` with model.onnx a Q/DQ graph: the export stage's check refuses it before anything is written."""
    from kiln.pipeline.config import config_from_dict
    from kiln.pipeline.runner import Runner
    from kiln.pipeline.stage_list import STAGES

    onnx.save(_qdq_graph(), tmp_path / "q.onnx")
    cfg = config_from_dict({"model": {"onnx": str(tmp_path / "q.onnx")}, "build": {"backends": ["onnxruntime"]}})
    result = Runner(cfg, tmp_path / "wd", STAGES).run()
    assert f"model.onnx {tmp_path / 'q.onnx'} is already INT8" in str(result.error), result.error
    assert "a run takes an FP32 graph" in str(result.error) and "give the FP32 graph" in (result.error.hint or "")
    assert not (tmp_path / "wd" / "export").exists()


def test_a_quantized_input_and_half_weights_cast_to_float_are_an_fp32_graph(tmp_path: Path) -> None:
    """A Q/DQ pair on the input only, weights stored as float16 and Cast to float: audited fp32 and taken."""
    model = _quantized_input_half_weights()
    assert audit_graph(model).label() == "fp32"
    result = _precision(tmp_path, model, "fp32")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "v" / "fp32" / "model.onnx").is_file()
