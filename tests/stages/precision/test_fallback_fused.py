"""The fallback's blame on the graph ONNX Runtime CPU engines run: its quantizer fuses each Relu into the Conv before
it, and the Conv then writes the Relu's output name (holding its own, pre-ReLU, values). The Conv is blamed, on its
own output; the Relu, which has no counterpart to compare with, is not; and a tensor the variant lacks is not taken
as exact."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kiln.calibration.config import CalibrationConfig
from kiln.stages.precision.compare import matching_tensors, tensor_errors
from kiln.stages.precision.fallback import blame
from kiln.stages.precision.variants import Source, build_ort_cpu_int8

RNG = np.random.default_rng(0)


def _weights(*shape: int) -> np.ndarray:
    return (RNG.standard_normal(shape) * 0.4).astype(np.float32)


def conv_relu_graph() -> onnx.ModelProto:
    """Conv -> Relu -> Conv -> Relu -> Conv -> GlobalAveragePool -> Flatten (logits)."""
    nodes = [
        helper.make_node("Conv", ["input", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node("Conv", ["r2", "w3"], ["c3"], name="conv3"),
        helper.make_node("GlobalAveragePool", ["c3"], ["p"], name="pool"),
        helper.make_node("Flatten", ["p"], ["logits"], name="flat"),
    ]
    inits = {"w1": _weights(8, 3, 3, 3), "w2": _weights(8, 8, 3, 3), "w3": _weights(10, 8, 1, 1)}
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 3, 8, 8])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _ort_cpu_graph(tmp: Path) -> tuple[onnx.ModelProto, Path]:
    """The FP32 graph and its ORT CPU INT8 graph, quantized as the precision stage does (static, uint8)."""
    cal = [RNG.standard_normal((16, 3, 8, 8)).astype(np.float32) for _ in range(2)]
    src = Source.prepare(conv_relu_graph(), tmp / "fp32" / "model.onnx", cal, None)
    out = tmp / "int8" / "model.ort_cpu.onnx"
    out.parent.mkdir()
    assert build_ort_cpu_int8(src, out, CalibrationConfig(cache=False), set())["scheme"] == "static"
    return src.model, out


def _samples() -> np.ndarray:
    return np.random.default_rng(1).standard_normal((16, 3, 8, 8)).astype(np.float32)


def test_a_relu_fused_into_its_conv_is_blamed_on_the_conv(tmp_path: Path) -> None:
    fp32, path = _ort_cpu_graph(tmp_path)
    writers = {o: n.op_type for n in onnx.load(str(path)).graph.node for o in n.output}
    assert writers["r1"] == writers["r2"] == "Conv" and "c1" not in writers  # the quantizer fused both Relus
    ops = {n.name: n.op_type for n in fp32.graph.node}
    picks = blame(fp32, path, _samples(), set(ops), set(), 3)
    assert picks and all(ops[name] != "Relu" for name in picks), picks
    fused_conv = next(name for name in picks if ops[name] == "Conv" and name in ("conv1", "conv2"))
    assert f"relu{fused_conv[-1]} fused into it" in picks[fused_conv]


def test_a_tensor_the_variant_lacks_is_not_scored_as_exact(tmp_path: Path) -> None:
    """The Conv's own output is compared under the name it has in the variant; the fused Relu's output name holds
    another op's values there and is not compared; a node reading it carries the error measured upstream, not 0."""
    fp32, path = _ort_cpu_graph(tmp_path)
    names = matching_tensors(fp32, onnx.load(str(path)))
    assert names["c1"] == "r1" and names["c2"] == "r2" and "r1" not in names and "r2" not in names
    err = tensor_errors(fp32, path, _samples(), ["c1", "c2", "r1"], names)
    assert "r1" not in err and 0 < err["c1"] < 0.5 and 0 < err["c2"] < 0.5
    reasons = blame(fp32, path, _samples(), {n.name for n in fp32.graph.node}, set(), 10)
    carried = re.search(r"inputs' ([0-9.e-]+)", reasons["conv2"])
    assert carried is not None and float(carried.group(1)) == float(f"{err['c1']:.3g}"), reasons["conv2"]


def gemm_relu_graph() -> onnx.ModelProto:
    """Gemm -> Relu -> Gemm -> Relu -> Gemm (logits): ONNX Runtime's CPU graph of it is quantized dynamically."""
    nodes = [
        helper.make_node("Gemm", ["input", "w1", "b1"], ["g1"], name="gemm1", transB=1),
        helper.make_node("Relu", ["g1"], ["r1"], name="relu1"),
        helper.make_node("Gemm", ["r1", "w2", "b2"], ["g2"], name="gemm2", transB=1),
        helper.make_node("Relu", ["g2"], ["r2"], name="relu2"),
        helper.make_node("Gemm", ["r2", "w3", "b3"], ["logits"], name="gemm3", transB=1),
    ]
    inits = {"w1": _weights(32, 16), "w2": _weights(32, 32), "w3": _weights(10, 32)}
    inits |= {"b1": _weights(32), "b2": _weights(32), "b3": _weights(10)}
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 16])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_gemm_the_variant_computes_with_other_ops_is_still_compared(tmp_path: Path) -> None:
    """Dynamic quantization rewrites each Gemm into a quantized MatMul and an Add that writes the Gemm's output: that
    output is compared under its name, so the Relu after it is not blamed for the Gemm's error ("inputs' 0")."""
    cal = [RNG.standard_normal((16, 16)).astype(np.float32)]
    src = Source.prepare(gemm_relu_graph(), tmp_path / "fp32" / "model.onnx", cal, None)
    out = tmp_path / "int8" / "model.ort_cpu.onnx"
    out.parent.mkdir()
    assert build_ort_cpu_int8(src, out, CalibrationConfig(cache=False), set())["scheme"] == "dynamic"
    names = matching_tensors(src.model, onnx.load(str(out)))
    assert names["g1"] == "g1" and names["g2"] == "g2"
    ops = {n.name: n.op_type for n in src.model.graph.node}
    samples = np.random.default_rng(1).standard_normal((16, 16)).astype(np.float32)
    picks = blame(src.model, out, samples, set(ops), set(), 3)
    assert picks and ops[next(iter(picks))] == "Gemm", picks  # ranked first: a Gemm's own error
    # a Relu may follow with the little it adds, but never charged with its Gemm's error against inputs of 0
    assert not any(ops[n] == "Relu" and "inputs' 0 (" in why for n, why in picks.items()), picks
