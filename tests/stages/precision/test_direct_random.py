"""`kiln precision FILE`: without --calibration the warning and the summary say what random inputs are used for, and
name INT8 ranges only where a variant takes ranges (FP16 takes none)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.pipeline.test_faults import invoke, tiny_onnx


@pytest.mark.parametrize(("variants", "said"), [("fp16", "checked"), ("int8", "calibrated")])
def test_random_inputs_are_said_for_what_they_do(tmp_path: Path, variants: str, said: str) -> None:
    out = invoke("precision", tiny_onnx(tmp_path / "m.onnx"), "-o", tmp_path / "v", "--variants", variants)
    assert out.exit_code == 0, out.output
    text = " ".join(out.output.split())
    assert f"{said} on RANDOM inputs; wrote" in text
    assert ("INT8 ranges will not match real data" in text) == (variants == "int8")


def test_an_fp32_model_with_a_float16_input_gets_its_fp16_variant(tmp_path: Path) -> None:
    """Features stored in half precision (the model casts them to FP32 first): the converter took the float16 input
    for a graph converted already and refused, and the error spanned two lines."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32), "w")
    graph = helper.make_graph(
        [
            helper.make_node("Cast", ["x"], ["xf"], to=TensorProto.FLOAT),
            helper.make_node("MatMul", ["xf", "w"], ["logits"]),
        ],
        "half_in",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["batch", 8])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 4])],
        [w],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), tmp_path / "m.onnx")
    out = invoke("precision", tmp_path / "m.onnx", "-o", tmp_path / "v", "--variants", "fp16")
    assert out.exit_code == 0, out.output
    assert (tmp_path / "v" / "fp16" / "model.onnx").is_file()


def test_a_dynamic_axis_without_sizes_is_told_by_the_graphs_own_name(tmp_path: Path) -> None:
    """Random inputs cannot size an axis without signature.shapes: the fix names the graph's axis ('frames'), not a
    made-up 'seq' with sizes the graph may refuse."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.ones((4, 16, 3), np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"])],
        "mel",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16, "frames"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [w],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), tmp_path / "m.onnx")
    out = invoke("precision", tmp_path / "m.onnx", "-o", tmp_path / "v", "--variants", "int8")
    assert out.exit_code == 2, out.output
    text = " ".join(out.output.split())
    assert "--set 'signature.shapes={frames: [MIN, MAX]}' to size the dynamic axes" in text, text
    assert "seq" not in text
