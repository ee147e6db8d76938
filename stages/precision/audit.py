"""Which precision a graph computes in, and how much it computes: each compute node's FLOPs per sample (from ONNX
shape inference at concrete sizes) and the precision the graph gives it — a MatMul/Conv fed by a DequantizeLinear
or an integer op is INT8, one on FP16 tensors FP16, the rest FP32.

The precision stage uses it to refuse a variant with no compute node left in its precision; the build stage to
record each engine's precision shares in ``kiln-engine.json`` and to refuse a label the graph contradicts (an
"INT8" engine that computes in FP32, or a Q/DQ graph built as "fp32"); validation to put achieved TFLOP/s beside
the device's peak. onnx's shape inference does the shapes; what no library counts here is FLOPs per ONNX op.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from math import prod
from pathlib import Path
from typing import Any

import onnx

from kiln.core.onnx_io import infer_shapes, light_model, load_onnx

# ONNX's compute ops and ONNX Runtime's fused forms of them (com.microsoft; their FLOPs count where shapes are known)
COMPUTE = {"MatMul", "Gemm", "Conv", "ConvTranspose", "FusedMatMul", "FusedConv", "FusedGemm", "NhwcConv"}
COMPUTE |= {"Attention", "MultiHeadAttention", "GroupQueryAttention"}
RECURRENT = {"LSTM", "GRU", "RNN"}  # W [directions, gates x hidden, input], R [directions, gates x hidden, hidden]
COMPUTE |= RECURRENT
INTEGER = {"MatMulInteger", "ConvInteger", "QLinearMatMul", "QLinearConv", "DynamicQuantizeMatMul", "QGemm"}
INTEGER |= {"MatMulIntegerToFloat", "QAttention", "QOrderedMatMul", "MatMulNBits"}
WEIGHT_INPUT = {"QLinearMatMul": 3, "QLinearConv": 3, "QGemm": 3}  # where the second operand sits
LOW = ("int8", "fp8", "fp16")
FLOAT8 = (onnx.TensorProto.FLOAT8E4M3FN, onnx.TensorProto.FLOAT8E5M2)
MIN_SHARE = 0.5  # an engine labelled INT8/FP16 must run at least this share of its FLOPs in that precision


@dataclass
class Audit:
    """FLOPs per sample by precision; ``uncounted``: compute nodes whose shapes inference could not give."""

    flops: Counter[str] = field(default_factory=Counter)
    nodes: Counter[str] = field(default_factory=Counter)
    uncounted: int = 0
    weight_flops: int = 0  # of MatMul/Gemm nodes whose second operand is a weight (linear layers)
    sizes: dict[str, int] = field(default_factory=dict)  # the dynamic axis sizes the FLOPs are counted at

    @property
    def total(self) -> int:
        return sum(self.flops.values())

    def share(self) -> dict[str, float]:
        """Each precision's share of the FLOPs (of the node count where no FLOPs could be counted)."""
        weights = self.flops if self.total else self.nodes
        whole = sum(weights.values())
        return {p: round(weights[p] / whole, 4) for p in ("int8", "fp8", "fp16", "fp32") if whole and weights[p]}

    def label(self) -> str:
        """The precision the graph computes in: a low precision holding at least :data:`MIN_SHARE`, else fp32."""
        share = self.share()
        return next((p for p in LOW if share.get(p, 0.0) >= MIN_SHARE), "fp32")

    def record(self) -> dict[str, Any]:
        return {
            "flops_per_sample": self.total,
            "share": self.share(),
            "compute_nodes": dict(self.nodes),
            "uncounted_nodes": self.uncounted,
            "counted_at": self.sizes,
        }


def audit_graph(model: onnx.ModelProto | Path, sizes: dict[str, int] | None = None) -> Audit:
    """The graph's compute nodes by precision and FLOPs for one sample: batch 1, each other named axis at
    ``sizes`` (1 where not given)."""
    m = load_onnx(model, load_external_data=False) if isinstance(model, Path) else model
    light, _ = light_model(m)
    used = _pin(light, sizes or {})
    m = infer_shapes(light, strict=False)  # recorded symbolic shapes dropped: inferred at the pinned sizes
    shapes = _shapes(m)
    types = {v.name: v.type.tensor_type.elem_type for v in [*m.graph.value_info, *m.graph.input, *m.graph.output]}
    types.update({t.name: t.data_type for t in m.graph.initializer})
    producer = {o: n for n in m.graph.node for o in n.output}
    weights = {t.name for t in m.graph.initializer} | _transposed(m)
    out = Audit(sizes=used)
    for node in m.graph.node:
        if node.op_type not in COMPUTE | INTEGER:
            continue
        precision = _precision(node, producer, types)
        flops = _flops(node, shapes)
        out.nodes[precision] += 1
        if flops is None:
            out.uncounted += 1
        else:
            out.flops[precision] += flops
            if node.op_type in ("MatMul", "Gemm") and len(node.input) > 1 and node.input[1] in weights:
                out.weight_flops += flops
    return out


def compute_precisions(model: onnx.ModelProto | Path) -> Counter[str]:
    """Compute nodes per precision (``int8``, ``fp16``, ``fp32``)."""
    return audit_graph(model).nodes


def _precision(node: onnx.NodeProto, producer: dict[str, onnx.NodeProto], types: dict[str, int]) -> str:
    if node.op_type in INTEGER:
        return "int8"
    operands = [i for i in node.input[:2] if i]
    dequantized = [
        producer[i] for i in operands if producer.get(i) is not None and producer[i].op_type == "DequantizeLinear"
    ]
    if dequantized:  # Q/DQ: the precision of what was quantized (float8 or an 8-bit integer)
        float8 = any(types.get(dq.input[0]) in FLOAT8 for dq in dequantized)
        return "fp8" if float8 else "int8"
    # the activation's type, else (a fused op shape inference cannot see through) the weight's
    elem = types.get(node.input[0]) or (types.get(node.input[1]) if len(node.input) > 1 else None)
    return "fp16" if elem == onnx.TensorProto.FLOAT16 else "fp32"


def _flops(node: onnx.NodeProto, shapes: dict[str, list[int]]) -> int | None:
    """Multiply-adds x 2 of one compute node, from its inferred shapes; None where a shape is unknown."""
    if node.op_type in RECURRENT:
        return _recurrent_flops(node, shapes)
    a = shapes.get(node.input[0]) if node.input else None
    w = shapes.get(node.input[WEIGHT_INPUT.get(node.op_type, 1)]) if len(node.input) > 1 else None
    y = shapes.get(node.output[0])
    if a is None or w is None or y is None:
        return None
    op = node.op_type
    if op in ("Attention", "MultiHeadAttention", "GroupQueryAttention", "QAttention"):
        return None  # its FLOPs depend on heads and sequence lengths its shapes alone do not give
    if op in ("Conv", "ConvInteger", "QLinearConv", "FusedConv", "NhwcConv"):
        return 2 * prod(y) * prod(w[1:])
    if op == "ConvTranspose":
        return 2 * prod(a) * prod(w[1:])
    if op in ("Gemm", "QGemm", "FusedGemm"):
        trans_a = next((at.i for at in node.attribute if at.name == "transA"), 0)
        return 2 * prod(y) * (a[0] if trans_a else a[-1])
    return 2 * prod(y) * a[-1]  # MatMul and its integer forms: [..., M, K] x [..., K, N]


def _recurrent_flops(node: onnx.NodeProto, shapes: dict[str, list[int]]) -> int | None:
    """An LSTM, GRU or RNN: every step multiplies the input by W and the hidden state by R, for each direction."""
    x, w, r = (shapes.get(node.input[i]) for i in range(3))
    if x is None or w is None or r is None or len(x) != 3:
        return None
    batch_first = next((at.i for at in node.attribute if at.name == "layout"), 0) == 1
    steps, batch = (x[1], x[0]) if batch_first else (x[0], x[1])
    return 2 * steps * batch * (prod(w) + prod(r))


def _transposed(model: onnx.ModelProto) -> set[str]:
    """Outputs of a Transpose of an initializer (an exporter's ``x @ W.T``): weights too."""
    inits = {t.name for t in model.graph.initializer}
    return {n.output[0] for n in model.graph.node if n.op_type == "Transpose" and n.input and n.input[0] in inits}


def _pin(model: onnx.ModelProto, sizes: dict[str, int]) -> dict[str, int]:
    """Give the graph inputs' named axes concrete sizes (the first axis 1, others ``sizes`` or 1); returns them."""
    used: dict[str, int] = {}
    for inp in model.graph.input:
        for axis, dim in enumerate(inp.type.tensor_type.shape.dim):
            if dim.HasField("dim_value") and dim.dim_value > 0:
                continue
            name = dim.dim_param or f"axis{axis}"
            size = 1 if axis == 0 else int(sizes.get(name, 1))
            dim.Clear()
            dim.dim_value = size
            if axis:
                used[name] = size
    return used


def _shapes(model: onnx.ModelProto) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for v in [*model.graph.value_info, *model.graph.input, *model.graph.output]:
        # an unknown first axis is the batch, pinned to 1 at the inputs (shape inference loses it through a Reshape
        # whose target it computes from the input's shape); an unknown axis elsewhere leaves the tensor unknown
        dims = [
            d.dim_value if d.dim_value > 0 else (1 if axis == 0 else 0)
            for axis, d in enumerate(v.type.tensor_type.shape.dim)
        ]
        if dims and all(dims):
            out[v.name] = dims
    for t in model.graph.initializer:
        out[t.name] = list(t.dims)
    return out


def engine_audit(
    source: Path,
    engine_graph: Path | None,
    sizes: dict[str, int],
    declared: str | None = None,
    lowbit_share: float | None = None,
) -> dict[str, Any]:
    """An engine's audit: FLOPs per sample from its source graph, precision shares from the graph it runs (an ONNX
    Runtime engine's optimized graph; its fused ops count by node where their shapes are not inferable), or
    ``declared`` by its builder (a torch engine cast to one dtype; TensorRT's own choice per layer), said in
    ``method``. A torch FP8/INT8 engine declares ``lowbit_share``: the share of its linear layers' FLOPs that its
    swapped layers compute (:mod:`kiln.stages.engines.torch.lowbit`), applied to the source graph's FLOPs on weights."""
    src = audit_graph(source, sizes)
    record = src.record()
    if declared in ("fp8", "int8"):  # linear layers (MatMul/Gemm on a weight) as low-precision GEMMs, the rest not
        rest = "fp16"  # the torch engine runs the rest of the model in float16 (kiln.stages.engines.torch.lowbit)
        low = src.weight_flops * (1.0 if lowbit_share is None else lowbit_share) / src.total if src.total else 0.0
        share = {declared: round(low, 4), rest: round(1 - low, 4)} if src.total else {}
        method = f"declared by the builder: the linear layers it swapped in {declared.upper()}, the rest {rest}"
        return {**record, "share": share, "method": method}
    if declared is not None:
        return {**record, "share": {declared: 1.0}, "method": "declared by the builder (dtype)"}
    if engine_graph is None:
        return {**record, "method": "source graph"}
    ran = audit_graph(engine_graph, sizes)
    if ran.total >= 0.9 * src.total > 0:
        return {**record, "share": ran.share(), "method": "engine graph, by FLOPs"}
    # The runtime's fused ops hide their shapes: the source graph's FLOPs, less any precision the engine's graph
    # no longer computes in (ONNX Runtime's CPU provider runs an FP16 graph's MatMul/Conv in FP32, through casts)
    share = dict(record["share"])
    if any(ran.nodes[p] and not src.nodes[p] for p in LOW):  # converted at build: only the engine's graph knows
        whole = sum(ran.nodes.values())
        share = {p: round(ran.nodes[p] / whole, 4) for p in (*LOW, "fp32") if ran.nodes[p]}
        return {**record, "share": share, "method": "engine graph, by compute node (converted at build)"}
    for precision in [p for p in share if p != "fp32" and not ran.nodes[p]]:
        share["fp32"] = round(share.get("fp32", 0.0) + share.pop(precision), 4)
    return {**record, "share": share, "method": "source graph by FLOPs, checked against the engine graph"}


def label_problem(audit: dict[str, Any], label: str) -> str | None:
    """Why an engine labelled ``label`` is not what its audit shows: a low precision under :data:`MIN_SHARE` of the
    compute, or an FP32 label on a graph that computes mostly in a low precision. None: the label holds."""
    share = audit.get("share") or {}
    if label in LOW and share.get(label, 0.0) < MIN_SHARE:
        ran = ", ".join(f"{p} {v:.0%}" for p, v in share.items()) or "nothing counted"
        return f"labelled {label}, it computes {share.get(label, 0.0):.0%} in {label} ({ran}; {audit.get('method')})"
    low = next((p for p in LOW if share.get(p, 0.0) >= MIN_SHARE), None)
    if label == "fp32" and low is not None:
        return f"labelled fp32, its graph computes {share[low]:.0%} in {low} ({audit.get('method')})"
    return None
