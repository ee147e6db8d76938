"""ONNX Runtime's errors said by their reason: the C++ file, line and function signature its kernels put first,
often most of the first line, are dropped, so a cut at the limit keeps what failed."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from kiln.core.onnx_io import ort_session
from kiln.core.text import first_line, ort_reason, short_reason

# ONNX Runtime 1.2x's message where a GatherElements index is out of range (as the Funnel export's size check met it)
GATHER = (
    "[ONNXRuntimeError] : 1 : FAIL : Non-zero status code returned while running GatherElements node. "
    "Name:'/model/funnel/encoder/GatherElements' Status Message: /onnxruntime_src/onnxruntime/core/providers/cpu/"
    "tensor/gather_elements.cc:150 void onnxruntime::core_impl(const Tensor*, const Tensor*, Tensor*, int64_t, "
    "concurrency::ThreadPool*) [with Tin = long int; int64_t = long int] GatherElements op: Out of range value in "
    "index tensor\n"
)
RESHAPE = (
    "[ONNXRuntimeError] : 1 : FAIL : Non-zero status code returned while running Reshape node. "
    "Name:'/model/bert/encoder/layer.0/attention/self/Reshape_11' Status Message: /onnxruntime_src/onnxruntime/core/"
    "providers/cpu/tensor/reshape_helper.h:91 onnxruntime::ReshapeHelper::ReshapeHelper(const onnxruntime::"
    "TensorShape&, onnxruntime::TensorShapeVector&, bool) input_shape_size == requested_shape_size was false. The "
    "input tensor cannot be reshaped to the requested shape. Input shape:{2,3}, requested shape:{4,4}\n"
)


def test_the_reason_survives_the_cut_that_the_source_place_filled() -> None:
    assert not first_line(RuntimeError(GATHER)).endswith("index tensor")  # the kernel's signature filled the limit
    assert ort_reason(RuntimeError(GATHER)) == (
        "Non-zero status code returned while running GatherElements node. Name:'/model/funnel/encoder/GatherElements'"
        " Status Message: GatherElements op: Out of range value in index tensor"
    )
    reshape = ort_reason(RESHAPE)
    assert "onnxruntime_src" not in reshape and "ReshapeHelper(" not in reshape
    assert reshape.endswith(
        "Status Message: input_shape_size == requested_shape_size was false. The input tensor "
        "cannot be reshaped to the requested shape. Input shape:{2,3}, requested shape:{4,4}"
    )
    assert "onnxruntime_src" not in short_reason(RESHAPE, 200) and short_reason(RESHAPE, 200).endswith("{4,4}")


def test_text_without_a_source_place_is_kept() -> None:
    assert ort_reason(ValueError("shape (2, 3) vs (3,)\nmore")) == "shape (2, 3) vs (3,)"
    assert ort_reason(ValueError("")) == "ValueError"
    assert short_reason("ratio 0.5 on a::b(1) ok") == "ratio 0.5 on a::b(1) ok"


def test_an_error_onnx_runtime_raises_keeps_its_reason() -> None:
    """The message of the ONNX Runtime installed, not a copy: a GatherElements index past the axis."""
    graph = helper.make_graph(
        [helper.make_node("GatherElements", ["x", "i"], ["y"], axis=1)],
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
            helper.make_tensor_value_info("i", TensorProto.INT64, [2, 3]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    session = ort_session(model)
    with pytest.raises(Exception) as caught:
        session.run(None, {"x": np.zeros((2, 3), np.float32), "i": np.full((2, 3), 5, np.int64)})
    said = ort_reason(caught.value, 200)
    assert "Out of range value in index tensor" in said and ".cc:" not in said, said
