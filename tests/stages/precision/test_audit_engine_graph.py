"""The audit of an ONNX Runtime engine's graph: ONNX Runtime fuses the Q/DQ pairs it computes in integers into
integer ops (QLinearConv, MatMulIntegerToFloat), so a float op it leaves behind a DequantizeLinear (a
ConvTranspose, which its CPU provider has no integer kernel for) computes in float, where the graph before the
build (TensorRT's input, whose Q/DQ pairs TensorRT fuses itself) counts it in the precision it was quantized to."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.core.onnx_io import ort_session, session_options
from kiln.stages.engines.config import BuildConfig
from kiln.stages.engines.stage import MislabelledEngine, build_direct
from kiln.stages.precision.audit import Audit, _floated, audit_graph, engine_audit, label_problem

C = 4  # channels


def _qdq(name: str, out: str, scale: str = "as", zero: str = "az") -> list[onnx.NodeProto]:
    """A uint8 Q/DQ pair on the activation ``name``, as ONNX Runtime's quantizer writes one."""
    return [
        helper.make_node("QuantizeLinear", [name, scale, zero], [f"{out}_q"]),
        helper.make_node("DequantizeLinear", [f"{out}_q", scale, zero], [out]),
    ]


def vocoder(conv: bool = True) -> onnx.ModelProto:
    """x [batch, 4, frames] -> (``conv``: a Q/DQ Conv, which ONNX Runtime fuses into QLinearConv) -> a Q/DQ
    ConvTranspose upsampling x2 (left a float op behind its DequantizeLinear) -> y."""
    inits = [
        numpy_helper.from_array(np.array(0.05, np.float32), "as"),
        numpy_helper.from_array(np.array(128, np.uint8), "az"),
        numpy_helper.from_array(np.array(0.01, np.float32), "ws"),
        numpy_helper.from_array(np.array(0, np.int8), "wz"),
        numpy_helper.from_array(np.ones((C, C, 2), np.int8), "up_w"),  # [in, out, k]
    ]
    nodes = _qdq("x", "x_dq")
    last = "x_dq"
    if conv:
        inits.append(numpy_helper.from_array(np.ones((C, C, 3), np.int8), "conv_w"))
        nodes += [
            helper.make_node("DequantizeLinear", ["conv_w", "ws", "wz"], ["conv_wf"]),
            helper.make_node("Conv", ["x_dq", "conv_wf"], ["c"], name="conv", pads=[1, 1]),
            *_qdq("c", "c_dq"),
        ]
        last = "c_dq"
    nodes += [
        helper.make_node("DequantizeLinear", ["up_w", "ws", "wz"], ["up_wf"]),
        helper.make_node("ConvTranspose", [last, "up_wf"], ["y"], name="up", strides=[2], kernel_shape=[2]),
    ]
    g = helper.make_graph(
        nodes,
        "vocoder",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", C, "frames"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", C, None])],
        inits,
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def ort_optimized(src: Path, dst: Path) -> Path:
    """``src`` as an ONNX Runtime CPU engine holds it: optimized offline at the extended level."""
    ort_session(src, options=session_options(optimization="extended", optimized_path=dst))
    return dst


def test_a_float_op_left_behind_a_dequantize_linear_by_onnx_runtime_counts_in_fp32(tmp_path: Path) -> None:
    src = tmp_path / "voc.onnx"
    onnx.save(vocoder(), str(src))
    engine = ort_optimized(src, tmp_path / "engine.onnx")
    ops = Counter(n.op_type for n in onnx.load(str(engine)).graph.node)
    assert ops["QLinearConv"] == 1 and ops["ConvTranspose"] == 1  # what ONNX Runtime fused, what it left in float
    frames = 16
    conv, up = 2 * C * frames * C * 3, 2 * C * frames * C * 2  # FLOPs per sample: 384 each way
    audit = engine_audit(src, engine, {"frames": frames})
    assert audit["share"] == {"int8": round(conv / (conv + up), 4), "fp32": round(up / (conv + up), 4)}
    assert audit["compute_nodes"] == {"int8": 1, "fp32": 1} and audit["float_behind_dq"] == {"ConvTranspose": 1}
    # the graph before a build (TensorRT's input) still counts both in int8: TensorRT fuses Q/DQ deconvolutions
    assert audit_graph(src, {"frames": frames}).share() == {"int8": 1.0}


def test_an_engine_of_float_ops_behind_dequantize_linear_is_not_int8(tmp_path: Path) -> None:
    """A Q/DQ ConvTranspose graph built as an INT8 ONNX Runtime CPU engine holds no integer op: refused, naming the
    op left in float (it was labelled int8 100 %)."""
    src = tmp_path / "up.onnx"
    onnx.save(vocoder(conv=False), str(src))
    with pytest.raises(MislabelledEngine, match="computes 0% in int8") as err:
        build_direct(src, tmp_path / "e", "onnxruntime", "cpu", "int8", BuildConfig(), {"frames": [8, 16]})
    assert "ConvTranspose x1 runs in float on the dequantized values" in err.value.message
    assert not (tmp_path / "e").exists()


def test_an_unfused_graph_is_audited_as_onnx_runtime_fuses_it(tmp_path: Path) -> None:
    """An engine graph ONNX Runtime saved unoptimized (a load fallback's, a CUDA engine built without the CUDA
    provider) still holds the Q/DQ Conv it fuses at load: int8, not float behind a DequantizeLinear."""
    src = tmp_path / "voc.onnx"
    onnx.save(vocoder(), str(src))
    audit = engine_audit(src, src, {"frames": 16})
    assert audit["compute_nodes"] == {"int8": 1, "fp32": 1} and audit["float_behind_dq"] == {"ConvTranspose": 1}


def test_the_source_count_moves_the_nodes_the_engine_runs_in_float() -> None:
    """Where the engine graph's FLOPs fall short (fused ops of unknown shapes), the shares are the source graph's:
    its nodes the engine left in float behind a DequantizeLinear move to fp32 there."""
    src = Audit(flops=Counter(int8=300), nodes=Counter(int8=2))
    src.by_node = {"conv": ("Conv", "int8", 200), "up": ("ConvTranspose", "int8", 100)}
    _floated(src, {"up": "ConvTranspose"})
    assert src.share() == {"int8": 0.6667, "fp32": 0.3333} and src.nodes == {"int8": 1, "fp32": 1}
    record = src.record()
    assert record["float_behind_dq"] == {"ConvTranspose": 1}
    assert "ConvTranspose x1 runs in float" not in (label_problem(record, "int8") or "")  # 67 %: the label holds
    record["share"] = record["share_floor"] = {"int8": 0.3, "fp32": 0.7}
    assert "ConvTranspose x1 runs in float" in (label_problem(record, "int8") or "")
