"""Which precision a graph computes in, and how much it computes: each compute node's FLOPs per sample (from ONNX
shape inference at concrete sizes) and the precision the graph gives it — a MatMul/Conv fed by a DequantizeLinear
or an integer op is INT8, one on FP16 tensors FP16, the rest FP32.

Where onnx's inference leaves a compute node's shapes unknown (it does not compute a Slice or Range whose bounds
come from a Shape: a transformer's position ids, then its attention heads' Reshape), ONNX Runtime's symbolic shape
inference runs at the same sizes. A node still not counted is recorded by precision, and each precision's share
then has a floor (:func:`share_floor`) that the labels are judged by: its FLOPs are not silently dropped.

The precision stage uses it to refuse a variant with no compute node left in its precision; the build stage to
record each engine's precision shares in ``kiln-engine.json`` and to refuse a label the graph contradicts (an
"INT8" engine that computes in FP32, or a Q/DQ graph built as "fp32"); validation to put achieved TFLOP/s beside
the device's peak. onnx's shape inference does the shapes; what no library counts here is FLOPs per ONNX op.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
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

log = logging.getLogger("kiln")


@dataclass
class Audit:
    """FLOPs per sample by precision; ``uncounted``: compute nodes, by precision, whose shapes inference could not
    give; ``largest``: the FLOPs of the largest node counted (what :func:`share_floor` weighs an uncounted one at)."""

    flops: Counter[str] = field(default_factory=Counter)
    nodes: Counter[str] = field(default_factory=Counter)
    uncounted: Counter[str] = field(default_factory=Counter)
    largest: int = 0
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

    def floor(self) -> dict[str, float]:
        """Each precision's least share, uncounted nodes weighed against it (:func:`share_floor`)."""
        if not self.total:  # shares by node count: the uncounted nodes are in them already
            return self.share()
        return share_floor(self.share(), self.total, self.uncounted, self.largest)

    def label(self) -> str:
        """The precision the graph computes in: a low precision whose floor holds :data:`MIN_SHARE`, else fp32."""
        return _low_label(self.floor()) or "fp32"

    def covers(self) -> float:
        """The share of the compute nodes whose FLOPs are counted (1.0: the share is of all the graph computes)."""
        whole = sum(self.nodes.values())
        return round(1 - sum(self.uncounted.values()) / whole, 4) if whole else 1.0

    def record(self) -> dict[str, Any]:
        return {
            "flops_per_sample": self.total,
            "share": self.share(),
            "share_floor": self.floor(),
            "share_covers_nodes": self.covers(),
            "compute_nodes": dict(self.nodes),
            "uncounted_nodes": dict(self.uncounted),
            "counted_at": self.sizes,
        }


def share_floor(share: dict[str, float], total: int, uncounted: Mapping[str, int], largest: int) -> dict[str, float]:
    """Each precision's least share of the FLOPs: its share of the ``total`` counted, were every uncounted compute
    node in another precision as large as the ``largest`` counted one. An FP32 attention MatMul whose sizes are not
    known then weighs against INT8 linear layers, where leaving it out would call the graph "int8 100 %"."""
    if not total:
        return dict(share)
    against = {p: sum(n for q, n in uncounted.items() if q != p) for p in share}
    return {p: round(v * total / (total + largest * against[p]), 4) for p, v in share.items()}


def audit_graph(model: onnx.ModelProto | Path, sizes: dict[str, int] | None = None) -> Audit:
    """The graph's compute nodes by precision and FLOPs for one sample: batch 1, each other named axis at
    ``sizes`` (1 where not given)."""
    m = load_onnx(model, load_external_data=False) if isinstance(model, Path) else model
    light, _ = light_model(m)
    used = _pin(light, sizes or {})
    m = infer_shapes(light, strict=False)  # recorded symbolic shapes dropped: inferred at the pinned sizes
    shapes = _shapes(m)
    compute = [n for n in m.graph.node if n.op_type in COMPUTE | INTEGER]
    if any(_flops(n, shapes) is None for n in compute):
        shapes = {**_symbolic_shapes(m), **shapes}
    types = {v.name: v.type.tensor_type.elem_type for v in [*m.graph.value_info, *m.graph.input, *m.graph.output]}
    types.update({t.name: t.data_type for t in m.graph.initializer})
    producer = {o: n for n in m.graph.node for o in n.output}
    weights = {t.name for t in m.graph.initializer} | _transposed(m)
    out = Audit(sizes=used)
    for node in compute:
        precision = _precision(node, producer, types)
        flops = _flops(node, shapes)
        out.nodes[precision] += 1
        if flops is None:
            out.uncounted[precision] += 1
        else:
            out.flops[precision] += flops
            out.largest = max(out.largest, flops)
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


def _symbolic_shapes(model: onnx.ModelProto) -> dict[str, list[int]]:
    """Concrete shapes from ONNX Runtime's symbolic shape inference on ``model`` (inputs pinned), which computes the
    shape arithmetic onnx's inference leaves unknown; {} where it fails. Its steps are run here rather than its
    ``infer_shapes``, which writes a model file into the working directory when a shape stays unknown."""
    try:
        from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

        bare = onnx.ModelProto()
        bare.CopyFrom(model)
        del bare.graph.value_info[:]
        ssi = SymbolicShapeInference(2**31 - 1, auto_merge=True, guess_output_rank=True, verbose=0)
        ssi._preprocess(bare)
        while ssi.run_:
            ssi._infer_impl()
        ssi._update_output_from_vi()
        return _shapes(ssi.out_mp_)
    except Exception as exc:  # a helper for counting: the nodes it cannot give stay uncounted, by precision
        log.debug("symbolic shape inference failed: %s", exc)
        return {}


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
    swapped layers compute (:mod:`kiln.stages.engines.torch.lowbit`), applied to the source graph's FLOPs on weights.
    ``share_floor`` beside each share: the least it may be, given the compute nodes not counted."""
    src = audit_graph(source, sizes)
    record = src.record()
    if declared in ("fp8", "int8"):  # linear layers (MatMul/Gemm on a weight) as low-precision GEMMs, the rest not
        rest = "fp16"  # the torch engine runs the rest of the model in float16 (kiln.stages.engines.torch.lowbit)
        low = src.weight_flops * (1.0 if lowbit_share is None else lowbit_share) / src.total if src.total else 0.0
        share = {declared: round(low, 4), rest: round(1 - low, 4)} if src.total else {}
        floor = share_floor(share, src.total, {rest: sum(src.uncounted.values())}, src.largest)  # none swapped
        method = f"declared by the builder: the linear layers it swapped in {declared.upper()}, the rest {rest}"
        return {**record, "share": share, "share_floor": floor, "method": method}
    if declared is not None:
        whole = {declared: 1.0}
        return {**record, "share": whole, "share_floor": whole, "method": "declared by the builder (dtype)"}
    if engine_graph is None:
        return {**record, "method": "source graph"}
    ran = audit_graph(engine_graph, sizes)
    if ran.total >= 0.9 * src.total > 0:
        counted = {k: v for k, v in ran.record().items() if k not in ("flops_per_sample", "counted_at")}
        return {**record, **counted, "method": "engine graph, by FLOPs"}
    # The runtime's fused ops hide their shapes: the source graph's FLOPs, less any precision the engine's graph
    # no longer computes in (ONNX Runtime's CPU provider runs an FP16 graph's MatMul/Conv in FP32, through casts)
    if any(ran.nodes[p] and not src.nodes[p] for p in LOW):  # converted at build: only the engine's graph knows
        whole = sum(ran.nodes.values())
        share = {p: round(ran.nodes[p] / whole, 4) for p in (*LOW, "fp32") if ran.nodes[p]}
        method = "engine graph, by compute node (converted at build)"
        return {**record, "share": share, "share_floor": share, "share_covers_nodes": 1.0, "method": method}
    gone = [p for p in LOW if not ran.nodes[p]]
    share, uncounted = _as_fp32(record["share"], gone), _as_fp32(src.uncounted, gone)
    floor = share_floor(share, src.total, uncounted, src.largest) if src.total else share
    method = "source graph by FLOPs, checked against the engine graph"
    return {**record, "share": share, "share_floor": floor, "uncounted_nodes": uncounted, "method": method}


def _as_fp32(by_precision: Mapping[str, float], gone: list[str]) -> dict[str, Any]:
    """``by_precision`` with the precisions in ``gone`` (the engine no longer computes in them) moved to fp32."""
    out = {p: v for p, v in by_precision.items() if p not in gone}
    moved = sum(v for p, v in by_precision.items() if p in gone)
    if moved:
        out["fp32"] = round(out.get("fp32", 0) + moved, 4)
    return out


def label_problem(audit: dict[str, Any], label: str) -> str | None:
    """Why an engine labelled ``label`` is not what its audit shows: a low precision under :data:`MIN_SHARE` of the
    compute, or an FP32 label on a graph that computes mostly in a low precision. None: the label holds. A share is
    judged by its floor (``share_floor``: the compute nodes not counted weighed against it) where the audit has one."""
    share = audit.get("share") or {}
    floor = audit.get("share_floor", share)
    if label in LOW and floor.get(label, 0.0) < MIN_SHARE:
        ran = ", ".join(f"{p} {v:.0%}" for p, v in share.items()) or "nothing counted"
        held = f"{share.get(label, 0.0):.0%}"
        if floor.get(label, 0.0) < share.get(label, 0.0):
            held += f" (as little as {floor.get(label, 0.0):.0%} with its uncounted compute nodes"
            held += f" {audit.get('uncounted_nodes')})"
        return f"labelled {label}, it computes {held} in {label} ({ran}; {audit.get('method')})"
    low = _low_label(floor)
    if label == "fp32" and low is not None:
        return f"labelled fp32, its graph computes {floor[low]:.0%} in {low} ({audit.get('method')})"
    return None


def _low_label(share: Mapping[str, float]) -> str | None:
    return next((p for p in LOW if share.get(p, 0.0) >= MIN_SHARE), None)
