"""A graph output the graph also reads (a seq2seq encoder's last hidden state feeding cross-attention, a KV cache's
new keys, a backbone's features beside its head's logits) is served in float from a quantized graph, while its
readers inside the graph keep reading its Q/DQ copy."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from kiln.calibration.config import CalibrationConfig
from kiln.calibration.quantize import quantize_fp8, quantize_int8
from kiln.calibration.ranges import calibrate
from kiln.core.onnx_io import ort_session


class FeaturesAndLogits(torch.nn.Module):
    """``h = relu(x @ w1)`` returned beside ``y = h @ w2``, which reads it."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w1 = torch.nn.Parameter(torch.randn(16, 32, generator=g) * 0.3)
        self.w2 = torch.nn.Parameter(torch.randn(32, 8, generator=g) * 0.3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(x @ self.w1)
        return h @ self.w2, h


def _exported(tmp: Path) -> Path:
    path = tmp / "m.onnx"
    axes = {name: {0: "n"} for name in ("x", "y", "h")}
    with torch.no_grad():
        torch.onnx.export(
            FeaturesAndLogits().eval(),
            (torch.zeros(2, 16),),
            str(path),
            input_names=["x"],
            output_names=["y", "h"],
            dynamic_axes=axes,
            dynamo=False,
        )
    return path


def _data(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((16, 16)).astype(np.float32) for _ in range(4)]


def _run(path: Path, x: np.ndarray) -> dict[str, np.ndarray]:
    session = ort_session(onnx.load(str(path)))  # an FP8 graph at ORT's basic level, as the gates run it
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, {"x": x})))


def _first_matmul(path: Path) -> str:
    return next(n.name for n in onnx.load(str(path)).graph.node if n.op_type == "MatMul" and "x" in n.input)


def _quantized(tmp: Path, quantize: Callable[..., dict[str, Any]] = quantize_int8) -> tuple[Path, Path]:
    """The FP32 graph and its quantized one, the first MatMul kept in float: ``h`` is then computed in float,
    exactly as FP32 computes it, and only its own rounding could make it differ."""
    path = _exported(tmp)
    ranges = calibrate(path, _data(), "x", "minmax", cache_dir=tmp / "cache")
    cfg = CalibrationConfig(exclude_nodes=[_first_matmul(path)], exclude_first_last=False, keep_output_layers="off")
    quantize(path, tmp / "q.onnx", ranges, cfg)
    return path, tmp / "q.onnx"


def test_an_output_the_graph_reads_is_served_in_float_and_its_reader_stays_int8(tmp_path: Path) -> None:
    """Before: ORT's quantizer served ``h`` from the DequantizeLinear that feeds the second MatMul, rounded to 8
    bits and clipped to its calibrated range, an error no node kept in float could remove."""
    fp32, q = _quantized(tmp_path)
    x = _data(seed=1)[0]
    ref, got = _run(fp32, x), _run(q, x)
    graph = onnx.load(str(q))
    assert [o.name for o in graph.graph.output] == ["y", "h"] and [i.name for i in graph.graph.input] == ["x"]
    np.testing.assert_allclose(got["h"], ref["h"], rtol=1e-6, atol=1e-6)  # an INT8 step is 1/127 of its range
    # y still comes from an INT8 MatMul: both its inputs dequantized, its activation from a Q/DQ pair of h
    producer = {o: n for n in graph.graph.node for o in n.output}
    matmul = next(n for n in graph.graph.node if n.op_type == "MatMul" and n.name != _first_matmul(fp32))
    dqs = [producer[i] for i in matmul.input]
    assert [n.op_type for n in dqs] == ["DequantizeLinear", "DequantizeLinear"]
    q_of_h = producer[dqs[0].input[0]]
    assert q_of_h.op_type == "QuantizeLinear" and q_of_h.input[0] == "h" and producer["h"].op_type == "Relu"
    assert np.abs(got["y"] - ref["y"]).max() < 0.05 * np.abs(ref["y"]).max()
    onnx.checker.check_model(graph, full_check=True)


def test_fp8_serves_the_read_output_in_float_too(tmp_path: Path) -> None:
    """Before: the FP8 graph served ``h`` rounded to E4M3 (3 mantissa bits)."""
    fp32, q = _quantized(tmp_path, quantize_fp8)
    x = _data(seed=1)[0]
    np.testing.assert_allclose(_run(q, x)["h"], _run(fp32, x)["h"], rtol=1e-6, atol=1e-6)
    assert [o.name for o in onnx.load(str(q)).graph.output] == ["y", "h"]


def test_an_output_whose_activation_the_quantizer_removed_keeps_its_qdq(tmp_path: Path) -> None:
    """With asymmetric activations ORT's quantizer removes the Relu before a Q (the Q's zero point clips at 0) and
    the Conv writes the Q's input: that tensor is not the output's value (its negatives are still in it), so the
    output keeps being served from the DequantizeLinear, whose values are all >= 0."""
    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array((rng.standard_normal(s) * 0.5).astype(np.float32), k) for k, s in
               (("w1", (4, 1, 3, 3)), ("w2", (4, 4, 3, 3)))]  # fmt: skip
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["h"], name="relu"),
        helper.make_node("Conv", ["h", "w2"], ["y"], name="conv2", pads=[1, 1, 1, 1]),
    ]
    io = lambda name, c: helper.make_tensor_value_info(name, TensorProto.FLOAT, ["n", c, 8, 8])  # noqa: E731
    graph = helper.make_graph(nodes, "g", [io("x", 1)], [io("y", 4), io("h", 4)], weights)
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    data = [rng.standard_normal((8, 1, 8, 8)).astype(np.float32) for _ in range(4)]
    cfg = CalibrationConfig(activation_type="uint8", symmetric_activations=False, exclude_first_last=False)
    ranges = calibrate(path, data, "x", "minmax", cache_dir=tmp_path / "cache", symmetric=False)
    quantize_int8(path, tmp_path / "q.onnx", ranges, cfg)
    got = _run(tmp_path / "q.onnx", data[0])
    assert got["h"].min() >= 0 and [o.name for o in onnx.load(str(tmp_path / "q.onnx")).graph.output] == ["y", "h"]


def test_a_copy_of_an_output_served_in_float_is_served_in_float_too(tmp_path: Path) -> None:
    """A model that returns one tensor twice (``last_hidden_state`` and ``hidden_states[-1]``) exports the second as
    an Identity of the first: both must come out alike, not one in float and its copy from the Q/DQ pair."""
    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array((rng.standard_normal(s) * 0.3).astype(np.float32), k) for k, s in
               (("w1", (16, 32)), ("w2", (32, 8)))]  # fmt: skip
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["a"], name="mm1"),
        helper.make_node("Relu", ["a"], ["h"], name="relu"),
        helper.make_node("MatMul", ["h", "w2"], ["y"], name="mm2"),
        helper.make_node("Identity", ["h"], ["h2"], name="copy"),
    ]
    io = lambda name, c: helper.make_tensor_value_info(name, TensorProto.FLOAT, ["n", c])  # noqa: E731
    graph = helper.make_graph(nodes, "g", [io("x", 16)], [io("y", 8), io("h", 32), io("h2", 32)], weights)
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    ranges = calibrate(path, _data(), "x", "minmax", cache_dir=tmp_path / "cache")
    cfg = CalibrationConfig(exclude_nodes=["mm1"], exclude_first_last=False, keep_output_layers="off")
    quantize_int8(path, tmp_path / "q.onnx", ranges, cfg)
    x = _data(seed=1)[0]
    ref, got = _run(path, x), _run(tmp_path / "q.onnx", x)
    np.testing.assert_allclose(got["h"], ref["h"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got["h2"], ref["h2"], rtol=1e-6, atol=1e-6)
