"""FP16 emulation for accuracy checks on a CPU.

ONNX Runtime's CPU provider has FP16 kernels for few ops; for the rest it inserts casts and computes in FP32,
and drops the casts between neighbouring FP16 nodes, so an FP16 graph run on a CPU never rounds most of its
intermediate tensors — overflow and rounding errors a GPU would show stay hidden. This builds the FP32 graph
with explicit FP32->FP16->FP32 Cast pairs (which ORT keeps: they are not no-ops) on every tensor an FP16
engine stores in FP16: weights, activations and inputs of the FP16 nodes. It models FP16 storage with FP32
accumulation, which is what TensorRT and cuBLAS do with FP16 tensor cores.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def emulate_fp16(model: onnx.ModelProto, fp32_nodes: set[str]) -> onnx.ModelProto:
    """``model`` (FP32, shape-inferred) with every FP16 node's float inputs and outputs rounded to FP16."""
    from onnxconverter_common import float16

    fp32_nodes = fp32_nodes | {n.name for n in model.graph.node if n.op_type in float16.DEFAULT_OP_BLOCK_LIST}
    src = model.graph
    floats = {
        v.name for v in [*src.value_info, *src.input, *src.output] if v.type.tensor_type.elem_type == TensorProto.FLOAT
    }
    inits = {i.name: i for i in src.initializer}
    floats |= {n for n, i in inits.items() if i.data_type == TensorProto.FLOAT}
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.node[:]
    rounded: dict[str, str] = {}  # tensor -> name of its FP16-rounded value

    def round_of(name: str) -> str:
        if name not in rounded:
            if name in inits:  # weights: round once, offline
                r = numpy_helper.from_array(
                    numpy_helper.to_array(inits[name]).astype(np.float16).astype(np.float32), f"{name}__r16"
                )
                out.graph.initializer.append(r)
            else:
                out.graph.node.extend(_round_nodes(name, f"{name}__r16"))
            rounded[name] = f"{name}__r16"
        return rounded[name]

    for node in src.node:
        n = onnx.NodeProto()
        n.CopyFrom(node)
        if node.name in fp32_nodes:
            out.graph.node.append(n)
            continue
        for i, name in enumerate(node.input):
            if name in floats:
                n.input[i] = round_of(name)
        rounding: list[onnx.NodeProto] = []
        for i, name in enumerate(node.output):
            if name in floats:  # compute, then store in FP16: the consumer-visible tensor keeps its name
                n.output[i] = f"{name}__f32"
                rounding += _round_nodes(n.output[i], name)
                rounded[name] = name
        out.graph.node.append(n)
        out.graph.node.extend(rounding)
    return out


def _round_nodes(src: str, dst: str) -> list[onnx.NodeProto]:
    mid = f"{dst}__h"
    return [
        helper.make_node("Cast", [src], [mid], to=TensorProto.FLOAT16, name=f"{dst}__to16"),
        helper.make_node("Cast", [mid], [dst], to=TensorProto.FLOAT, name=f"{dst}__to32"),
    ]
