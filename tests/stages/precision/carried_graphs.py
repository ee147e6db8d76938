"""Tiny models that bring a low precision of their own into the precision stage: a fake-quant (QAT-style) network
exported with its Q/DQ pairs, one with only its small head quantized, and one with float16 weights in part. Inputs
``input [batch, 1, 8, 8]`` (the tiny config's digits), output ``logits [batch, 10]``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn
from torch.nn import functional as F


class FakeQuantNet(nn.Module):
    """A Conv + Linear network quantized by ``torch.fake_quantize_*`` in forward (a QAT model's forward once
    trained): ``whole`` fake-quantizes the convolution too (most of the FLOPs), else only the head."""

    def __init__(self, whole: bool) -> None:
        super().__init__()
        self.whole = whole
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.fc = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.conv.weight
        if self.whole:
            x = torch.fake_quantize_per_tensor_affine(x, 1 / 127, 0, -128, 127)
            w = torch.fake_quantize_per_tensor_affine(w, 0.01, 0, -128, 127)
        x = torch.relu(F.conv2d(x, w, self.conv.bias, padding=1)).mean((2, 3))
        x = torch.fake_quantize_per_tensor_affine(x, 0.05, 0, -128, 127)
        return F.linear(x, torch.fake_quantize_per_tensor_affine(self.fc.weight, 0.01, 0, -128, 127), self.fc.bias)


def fake_quant_graph(folder: Path, whole: bool) -> Path:
    """:class:`FakeQuantNet` exported to ``folder/model.onnx`` (TorchScript exporter: QuantizeLinear /
    DequantizeLinear pairs), as the optimize stage hands it on."""
    torch.manual_seed(0)
    folder.mkdir(parents=True, exist_ok=True)
    torch.onnx.export(
        FakeQuantNet(whole).eval(),
        (torch.rand(2, 1, 8, 8),),
        str(folder / "model.onnx"),
        input_names=["input"],
        output_names=["logits"],
        dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}},
        opset_version=17,
        dynamo=False,
    )
    return folder


def half_head_graph(path: Path) -> Path:
    """``input [batch, 16] -> MatMul -> Relu -> MatMul(head)``, the head's weight stored in float16 and its input
    cast to float16 (a file converted to FP16 in part), its output cast back to float32."""
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("MatMul", ["input", "w1"], ["h"], name="body"),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("Cast", ["r"], ["r16"], name="to_half", to=TensorProto.FLOAT16),
        helper.make_node("MatMul", ["r16", "w2"], ["o16"], name="head"),
        helper.make_node("Cast", ["o16"], ["logits"], name="to_float", to=TensorProto.FLOAT),
    ]
    inits = {
        "w1": (rng.standard_normal((16, 64)) * 0.3).astype(np.float32),
        "w2": (rng.standard_normal((64, 4)) * 0.3).astype(np.float16),
    }
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 4])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path
