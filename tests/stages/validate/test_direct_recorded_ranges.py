"""`kiln validate ENGINE --reference` without --inputs on an engine with a dynamic axis besides the batch: random
inputs at the largest size of the range the engine records, or the refusal where it records none."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kiln.stages.engines.backend import SIDECAR, read_metadata
from tests.pipeline.test_faults import assert_clean, invoke


def _ids_graph(path: Path) -> Path:
    """input_ids [batch, seq] int64 -> a 5-row embedding table -> mean over seq -> logits [batch, 3]."""
    table = numpy_helper.from_array(np.arange(15, dtype=np.float32).reshape(5, 3), "table")
    graph = helper.make_graph(
        [
            helper.make_node("Gather", ["table", "input_ids"], ["emb"]),
            helper.make_node("ReduceMean", ["emb", "axes"], ["logits"], keepdims=0),
        ],
        "ids",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 3])],
        [table, numpy_helper.from_array(np.array([1], dtype=np.int64), "axes")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
    return path


def test_random_inputs_take_the_largest_size_of_the_engines_recorded_range(tmp_path: Path) -> None:
    model, engine = _ids_graph(tmp_path / "m.onnx"), tmp_path / "e"
    assert invoke("build", model, "-o", engine, "--set", "signature.shapes={seq: [3, 12]}").exit_code == 0
    assert read_metadata(engine).axis_ranges == {"seq": [3, 12]}
    out = invoke("validate", engine, "--reference", model, "--set", "signature.batch_sizes=[2]")
    assert out.exit_code == 0, out.output
    said = " ".join(out.output.split())  # the log's lines wrap at the terminal's width
    assert "seq=12 (of [3, 12])" in said
    report = json.loads(out.output[out.output.index("{") : out.output.rindex("}") + 1])
    assert report["passed"] and report["inputs"]["kind"] == "random", report


def test_an_axis_with_no_recorded_range_is_still_refused(tmp_path: Path) -> None:
    model, engine = _ids_graph(tmp_path / "m.onnx"), tmp_path / "e"
    assert invoke("build", model, "-o", engine, "--set", "signature.shapes={seq: [3, 12]}").exit_code == 0
    meta = read_metadata(engine)
    meta.model_copy(update={"axis_ranges": {}}).write(engine / SIDECAR)
    out = invoke("validate", engine, "--reference", model)
    assert_clean(out, 2, "input 'input_ids' has dynamic axes besides the batch axis", "--inputs")
