"""Which precision each compute node of a graph runs in, read from the graph: a Q/DQ pair or an integer op around a
MatMul/Conv is INT8, a MatMul/Conv on FP16 tensors is FP16, the rest FP32. A variant labelled INT8 or FP16 with no
compute node in that precision is not a variant of it (every node had to stay in float)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import onnx

from kiln.core.onnx_io import infer_shapes, load_onnx

COMPUTE = {"MatMul", "Gemm", "Conv", "ConvTranspose", "Attention", "MultiHeadAttention"}
INTEGER = {"MatMulInteger", "ConvInteger", "QLinearMatMul", "QLinearConv", "DynamicQuantizeMatMul", "QGemm"}


def compute_precisions(model: onnx.ModelProto | Path) -> Counter[str]:
    """Compute nodes per precision (``int8``, ``fp16``, ``fp32``)."""
    m = infer_shapes(load_onnx(model, load_external_data=False) if isinstance(model, Path) else model)
    producer = {o: n for n in m.graph.node for o in n.output}
    types = {v.name: v.type.tensor_type.elem_type for v in [*m.graph.value_info, *m.graph.input, *m.graph.output]}
    types.update({t.name: t.data_type for t in m.graph.initializer})
    out: Counter[str] = Counter()
    for node in m.graph.node:
        if node.op_type in INTEGER:
            out["int8"] += 1
        elif node.op_type in COMPUTE:
            first = producer.get(node.input[0]) if node.input else None
            if first is not None and first.op_type == "DequantizeLinear":
                out["int8"] += 1
            elif types.get(node.input[0]) == onnx.TensorProto.FLOAT16:
                out["fp16"] += 1
            else:
                out["fp32"] += 1
    return out
