"""`kiln validate ENGINE --reference ...` at several shapes: a missed gate names the shape it was missed at, as the
precision stage's gates do (``at seq=6``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tests.pipeline.test_faults import invoke


def _seq_graph(path: Path, flips_past: int | None = None) -> Path:
    """x [batch, seq] -> Relu -> logits; with ``flips_past``, the logits negated where seq is not that size."""
    nodes = [helper.make_node("Relu", ["input"], ["r"])]
    inits = []
    if flips_past is None:
        nodes.append(helper.make_node("Identity", ["r"], ["logits"]))
    else:
        inits += [
            numpy_helper.from_array(np.array([1], np.int64), "one"),
            numpy_helper.from_array(np.array([flips_past], np.int64), "size"),
            numpy_helper.from_array(np.array(2.0, np.float32), "two"),
            numpy_helper.from_array(np.array(1.0, np.float32), "unit"),
        ]
        nodes += [
            helper.make_node("Shape", ["input"], ["shape"]),
            helper.make_node("Gather", ["shape", "one"], ["seq"], axis=0),
            helper.make_node("Equal", ["seq", "size"], ["same"]),
            helper.make_node("Cast", ["same"], ["f"], to=TensorProto.FLOAT),
            helper.make_node("Mul", ["f", "two"], ["f2"]),
            helper.make_node("Sub", ["f2", "unit"], ["sign"]),
            helper.make_node("Mul", ["r", "sign"], ["logits"]),
        ]
    graph = helper.make_graph(
        nodes,
        "seq",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", "seq"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq"])],
        inits,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
    return path


def test_a_gate_missed_at_one_of_several_shapes_names_that_shape(tmp_path: Path) -> None:
    engine, sizes = tmp_path / "e", ("--set", "signature.shapes.seq=[2,6]")
    assert invoke("build", _seq_graph(tmp_path / "m.onnx"), "-o", engine, *sizes).exit_code == 0
    np.savez(tmp_path / "x.npz", input=np.random.default_rng(0).random((8, 6), dtype=np.float32) + 0.1)
    ref = _seq_graph(tmp_path / "ref.onnx", flips_past=2)
    out = invoke("validate", engine, "--reference", ref, "--inputs", tmp_path / "x.npz", *sizes)
    said = " ".join(out.output.split())
    assert out.exit_code == 3 and "failed its gates:" in said, out.output
    gates = said.split("failed its gates:")[1].split("fix:")[0]
    assert gates.count("at seq=6") == gates.count("<") + gates.count(">") > 0 and "seq=2" not in gates, gates
