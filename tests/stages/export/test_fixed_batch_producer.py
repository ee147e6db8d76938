"""A taken ``model.onnx`` that fixes its batch at 1 and does not run at batch 2: the fix names the way of the
exporter that wrote the file (its ``producer_name``), and the direct commands that take the file as it is."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.core.errors import ModelError
from kiln.stages.export.onnx_file import take_onnx

DIRECT = "kiln precision FILE, kiln build FILE and kiln validate ENGINE take the file as it is"


def _reshape_to_batch_one(path: Path, producer: str) -> Path:
    """A tf2onnx-like NHWC graph (``serving_default_input_1:0`` [1, 2, 2, 3]) that reshapes to a fixed [1, 12]:
    at batch 2 ONNX Runtime refuses the Reshape."""
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["serving_default_input_1:0", "to"], ["output_0"])],
        "fixed",
        [helper.make_tensor_value_info("serving_default_input_1:0", TensorProto.FLOAT, [1, 2, 2, 3])],
        [helper.make_tensor_value_info("output_0", TensorProto.FLOAT, [1, 12])],
        [numpy_helper.from_array(np.array([1, 12], np.int64), "to")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], producer_name=producer)
    onnx.save_model(model, str(path))
    return path


@pytest.mark.parametrize(
    ("producer", "way", "not_said"),
    [
        ("tf2onnx", "a None batch dimension", "dynamic_axes"),
        ("pytorch", "torch.onnx.export(..., dynamic_axes=", "None batch"),
        ("", "export it again with a dynamic batch axis", "dynamic_axes"),
    ],
)
def test_the_fix_names_the_exporters_way_and_the_direct_commands(
    tmp_path: Path, producer: str, way: str, not_said: str
) -> None:
    src = _reshape_to_batch_one(tmp_path / "m.onnx", producer)
    with pytest.raises(ModelError, match=r"fixes the batch at 1 .* does not run at batch 2") as err:
        take_onnx(src, tmp_path / "model.onnx")
    hint = err.value.hint
    assert way in hint and not_said not in hint and DIRECT in hint, hint
    assert ("model.name" in hint) == (producer == "pytorch"), hint  # Kiln exports from PyTorch alone
    assert "\n" not in hint and len(hint) < 260, hint
