"""A partial ``signature.dynamic_axes`` on a run from an ONNX file keeps the names the file gives its other axes."""

from pathlib import Path
from types import SimpleNamespace

import onnx
import torch
from onnx import TensorProto, helper

from kiln.core.data import DatasetSplits
from kiln.models.config import ModelConfig
from kiln.stages.precision.stage import _axis_sizes, validated_axes


def _three_inputs(path: Path) -> list[str]:
    """x[N, seq, 8], y[N, len, 8], z[N, ?, 8] (z's axis 1 unnamed), summed to one [N, 8] output."""
    dims = {"x": ["N", "seq", 8], "y": ["N", "len", 8], "z": ["N", None, 8]}
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, d) for n, d in dims.items()]
    nodes = [helper.make_node("ReduceSum", [n], [f"{n}_s"], keepdims=0, axes=[1]) for n in dims]
    nodes += [helper.make_node("Sum", [f"{n}_s" for n in dims], ["out"])]
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, ["N", 8])
    model = helper.make_model(helper.make_graph(nodes, "g", inputs, [out]), opset_imports=[helper.make_opsetid("", 11)])
    onnx.save(model, path)
    return list(dims)


def test_partial_dynamic_axes_keep_the_files_own_names(tmp_path: Path) -> None:
    names = _three_inputs(tmp_path / "model.onnx")
    x = {"x": torch.zeros(4, 6, 8), "y": torch.zeros(4, 4, 8), "z": torch.zeros(4, 5, 8)}
    data = DatasetSplits(x, torch.zeros(4, dtype=torch.long), x, torch.zeros(4, dtype=torch.long), num_classes=2)
    sig = SimpleNamespace(dynamic_axes={"z": {1: "zlen"}}, shapes={})
    ctx = SimpleNamespace(
        config=SimpleNamespace(signature=sig, model=ModelConfig(onnx="dyn.onnx")),
        inputs={"optimize": tmp_path},
    )
    assert _axis_sizes(data, names, ctx) == {"seq": [3, 6], "len": [2, 4], "zlen": [2, 5]}
    inputs = [SimpleNamespace(name=n, shape=["N", a, 8]) for n, a in zip(names, ["seq", "len", 5], strict=True)]
    assert validated_axes(ctx, inputs) == {"x": {1: "seq"}, "y": {1: "len"}, "z": {1: "zlen"}}
