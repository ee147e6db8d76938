"""The export's parity check on graphs that quantize (one quantization step allowed at the outputs a QuantizeLinear
feeds) and on graphs that answer NaN (a fix that follows the graph's own ops, not always attention's)."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from kiln.core.errors import ModelError
from kiln.stages.export.parity import parity, parity_error, parity_passes, quantization_steps

STEP = 0.01


def _fake_quant(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.fake_quantize_per_tensor_affine(x, scale, 0, -128, 127)


class _Quantized(torch.nn.Module):
    """A QAT model's tail, a linear layer (the identity): output 'a' its output quantized in steps of ``STEP``,
    output 'b' its output in float from its input quantized in steps of 0.1."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(1, 1)
        with torch.no_grad():
            self.fc.weight.fill_(1.0)
            self.fc.bias.zero_()

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"a": _fake_quant(self.fc(x), STEP), "b": self.fc(_fake_quant(x, 0.1))}


def _export(model: torch.nn.Module, path: Path) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model,
            (torch.zeros(2, 1),),
            str(path),
            input_names=["x"],
            output_names=["a", "b"],
            dynamic_axes={"x": {0: "batch"}},
            opset_version=17,
            dynamo=False,
        )
    return path


def _rounding_edges() -> np.ndarray:
    """Values whose ``x * (1 / STEP)`` (PyTorch's fake quantization) and ``x / STEP`` (ONNX's QuantizeLinear)
    round to neighbouring integers in float32."""
    s = np.float32(STEP)
    half = ((np.arange(-100, 100, dtype=np.float32) + np.float32(0.5)) * s).astype(np.float32)
    near = np.concatenate([np.nextafter(half, np.float32(-1e9)), half, np.nextafter(half, np.float32(1e9))])
    return near[np.rint(near * (np.float32(1) / s)) != np.rint(near / s)][:8].reshape(-1, 1)


def test_values_on_a_rounding_edge_one_quantization_step_apart_pass(tmp_path: Path) -> None:
    """PyTorch multiplies by 1/scale where QuantizeLinear divides by it: on a rounding edge the two land one step
    apart, the model's own resolution, which the check allows on top of export.parity_atol."""
    model = _Quantized().eval()
    path = _export(model, tmp_path / "q.onnx")
    x = torch.from_numpy(_rounding_edges())
    assert len(x) == 8
    check = parity(model, path, x)
    assert check["per_output"]["a"] == pytest.approx(STEP, rel=1e-3)  # one step apart, far over atol
    assert parity_passes(check, 1e-4, 1e-5)
    assert check["step"]["a"] == pytest.approx(STEP)


def test_the_step_is_the_nearest_quantization_of_each_output(tmp_path: Path) -> None:
    """'a' is quantized itself (its own step, not the input's coarser one); 'b' is computed from the input's
    quantization, the nearest on its way."""
    path = _export(_Quantized().eval(), tmp_path / "q.onnx")
    steps = quantization_steps(path)
    assert steps == pytest.approx({"a": STEP, "b": 0.1})


def test_more_than_a_step_apart_names_the_step_and_parity_atol() -> None:
    check = {"max_abs_err": 0.03, "per_output": {"a": 0.03}, "scale": {"a": 1.0}, "step": {"a": STEP}}
    assert not parity_passes(check, 1e-4, 1e-5)
    error = parity_error(check, 1e-4, "m.onnx", rtol=1e-5)
    assert "+ one quantization step 0.01" in error.message
    assert "in steps of 0.01" in error.hint and "3.0 steps" in error.hint
    assert "raise export.parity_atol (now 0.0001) above 0.03" in error.hint


class _SqrtOfAbs(torch.nn.Module):
    """A p-norm's last step: finite on every input in PyTorch; :func:`_pow_graph` writes it without the abs."""

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"y": x.abs() ** 0.5}


def _graph(path: Path, *nodes: onnx.NodeProto, inits: list[onnx.TensorProto]) -> Path:
    graph = helper.make_graph(
        list(nodes),
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        inits,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def _pow_graph(path: Path) -> Path:
    """``x ** 0.5``: NaN for a negative x."""
    half = helper.make_tensor("half", TensorProto.FLOAT, [], [0.5])
    return _graph(path, helper.make_node("Pow", ["x", "half"], ["y"]), inits=[half])


def _negatives() -> torch.Tensor:
    return -torch.arange(1, 33, dtype=torch.float32).reshape(8, 4)


def test_nan_from_a_graph_without_softmax_names_its_ops_not_attention(tmp_path: Path) -> None:
    path = _pow_graph(tmp_path / "p.onnx")
    with pytest.raises(ModelError, match="answers 8 of 8 samples with NaN") as err:
        parity(_SqrtOfAbs(), path, _negatives())
    assert "attention" not in err.value.hint and "Softmax" not in err.value.hint
    assert "Pow(x, 0.5) (NaN for a negative x)" in err.value.hint


def test_nan_from_the_fallback_graph_names_the_torchscript_exporter(tmp_path: Path) -> None:
    path = _pow_graph(tmp_path / "p.onnx")
    refused = "No ONNX function found for aten._cdist_forward (in forward() at m.py:3)"
    with pytest.raises(ModelError) as err:
        parity(_SqrtOfAbs(), path, _negatives(), refused=refused)
    assert "the TorchScript exporter's, the fallback after the dynamo exporter failed" in err.value.message
    assert "Pow(x, 0.5)" in err.value.hint and "forward() at m.py:3" in err.value.hint


def test_nan_through_a_softmax_keeps_the_attention_fix(tmp_path: Path) -> None:
    half = helper.make_tensor("half", TensorProto.FLOAT, [], [0.5])
    path = _graph(
        tmp_path / "s.onnx",
        helper.make_node("Pow", ["x", "half"], ["p"]),
        helper.make_node("Softmax", ["p"], ["y"], axis=-1),
        inits=[half],
    )
    with pytest.raises(ModelError) as err:
        parity(_SqrtOfAbs(), path, _negatives())
    assert "attention keys are all masked" in err.value.hint
