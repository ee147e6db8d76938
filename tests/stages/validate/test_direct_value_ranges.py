"""`kiln validate ENGINE --reference MODEL` without --inputs draws its random floats within each input's recorded
value range (kiln-engine.json's ``value_ranges``: images in [0, 1]), not from N(0, 1), which an engine calibrated on
[0, 1] never saw; an engine with no range recorded is warned of N(0, 1) and pointed to --inputs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tests.pipeline.test_faults import invoke


def sqrt_onnx(path: Path) -> Path:
    """input [batch, 4] in [0, inf) -> Sqrt -> MatMul -> logits [batch, 3]: NaN on the negative values of N(0, 1)."""
    w = numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(4, 3) - 5, "w")
    graph = helper.make_graph(
        [helper.make_node("Sqrt", ["input"], ["root"]), helper.make_node("MatMul", ["root", "w"], ["logits"])],
        "sqrt",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 3])],
        [w],
    )
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(path))
    return path


def test_random_inputs_lie_in_the_recorded_range_and_the_log_says_it(tmp_path: Path) -> None:
    """Drawn from N(0, 1), half the values were negative: the engine and the reference both gave NaN and the
    engine failed with nothing measured, though it is right on every input of its [0, 1] data."""
    model, engine = sqrt_onnx(tmp_path / "m.onnx"), tmp_path / "e"
    assert invoke("build", model, "-o", engine).exit_code == 0
    record = engine / "kiln-engine.json"
    meta = json.loads(record.read_text())
    record.write_text(json.dumps({**meta, "value_ranges": {"input": [0.0, 1.0]}}))
    out = invoke("validate", engine, "--reference", model)
    said = " ".join(out.output.split())  # the log's lines wrap at the terminal's width
    assert out.exit_code == 0, said
    assert "random inputs drawn in each input's recorded range: input [0, 1]" in said, said
    assert "N(0, 1)" not in said and "is NaN" not in said, said


def test_an_engine_without_a_recorded_range_is_warned_of_normal_inputs(tmp_path: Path) -> None:
    model, engine = sqrt_onnx(tmp_path / "m.onnx"), tmp_path / "e"
    assert invoke("build", model, "-o", engine).exit_code == 0
    said = " ".join(invoke("validate", engine, "--reference", model).output.split())
    assert "random inputs drawn from N(0, 1) for 'input': engine onnxruntime-cpu-fp32 records no value" in said, said
    assert "Give --inputs FILE.npz with real samples" in said, said
