"""Which precision a graph computes in, and how much it computes: each compute node's FLOPs per sample (from its shapes
at concrete sizes) and the precision the graph gives it — a MatMul/Conv fed by a DequantizeLinear or an integer op
is INT8 (through layout ops and Casts to a float type: an FP16 graph's Cast after each DequantizeLinear), one on
FP16 tensors FP16, the rest FP32. An op no runtime computes in integers from Q/DQ (LSTM/GRU/RNN, DFT/STFT:
:data:`FLOAT_ONLY`) is FP32 behind a DequantizeLinear too: it runs on the dequantized values; ONNX Runtime's dynamic
quantization computes an LSTM in integers (DynamicQuantizeLSTM: INT8). In an ONNX Runtime engine's graph, whose Q/DQ
pairs ONNX Runtime has fused into integer ops where it computes in integers, a float op still behind a
DequantizeLinear (a ConvTranspose: no integer kernel on its CPU provider) is FP32.

The compute nodes, each counted by a standard formula from its shapes: MatMul, Gemm, Conv, ConvTranspose, DeformConv
and their fused and integer forms (2 x multiply-adds); LSTM, GRU and RNN (their gates' GEMMs at every step); an
Einsum (its pairwise contractions in the order numpy finds cheapest, its optimal path: 2 x the product of each one's
index sizes, for two operands a GEMM's 2 M N K); DFT and STFT (5 N log2 N per complex
transform of length N, half for a real signal: FFTW's convention, whichever algorithm the runtime runs; a length
computed from the input's shape, as ``rfft(x, n=2 * L)`` exports, folded at the sizes counted). Counted rather than
listed because their shapes give their FLOPs: an FNet whose cost is FP32 DFTs beside INT8 linear layers is then not
"int8 100 %".

Other compute nodes cannot be counted per sample, and are recorded by precision (``uncounted``) and by op
(``uncounted_ops``): attention ops (their FLOPs depend on heads, masks and cached lengths their shapes do not give),
an Einsum of more than six operands (the optimal path tries every order), any compute node inside a Loop, Scan or If
body (weighed against the other precisions once per run: a Loop's trip count, constant or from the input's shape, a
Scan's scanned length; a body of no known trip count runs as many times as the data says, and puts every other
precision's share in doubt), and one whose shapes inference cannot give (named ``"MatMul (after a Loop)"`` where it
computes on a Loop's, Scan's or If's output, whose shape is the data's). Where onnx's inference leaves a compute
node's shapes unknown (it does not compute a Slice or Range whose bounds come from a Shape: a transformer's position
ids, then its attention heads' Reshape), ONNX Runtime's symbolic shape inference runs at the same sizes first; where
both leave one unsized (an exported ``torch.stft(center=True)``: its reflect Pad, then a Reshape to a size computed
from the input's), the graph runs once on ONNX Runtime's CPU provider at those sizes, and the shapes its tensors
come out with are read (not those after a Loop, Scan or If: the data's). Each precision's share then has a floor
(:func:`share_floor`) that the labels are judged by: the uncounted nodes' FLOPs are not silently dropped.

The precision stage uses it to refuse a variant with no compute node left in its precision; the build stage to
record each engine's precision shares in ``kiln-engine.json`` and to refuse a label the graph contradicts (an
"INT8" engine that computes in FP32, or a Q/DQ graph built as "fp32"); validation to put achieved TFLOP/s beside
the device's peak. onnx's shape inference does the shapes; what no library counts here is FLOPs per ONNX op.
"""

from __future__ import annotations

import logging
import tempfile
from collections import Counter
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from math import log2, prod
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from kiln.core.cpu_int8 import ORT_CPU_STATIC_INTEGER
from kiln.core.errors import ModelError
from kiln.core.onnx_io import (
    cast_to,
    infer_shapes,
    light_model,
    load_onnx,
    ort_session,
    session_options,
    traced_back,
)

# ONNX's compute ops and ONNX Runtime's fused forms of them (com.microsoft; their FLOPs count where shapes are known)
COMPUTE = {"MatMul", "Gemm", "Conv", "ConvTranspose", "DeformConv", "FusedMatMul", "FusedConv", "FusedGemm"}
COMPUTE |= {"NhwcConv", "Einsum"}
FOURIER = {"DFT", "STFT"}
COMPUTE |= FOURIER
# attention ops of ONNX (opset 23) and ONNX Runtime: never counted (heads, masks and cached lengths decide their FLOPs)
ATTENTION = {"Attention", "MultiHeadAttention", "GroupQueryAttention", "PackedAttention", "PackedMultiHeadAttention"}
ATTENTION |= {"DecoderMaskedMultiHeadAttention", "DecoderMaskedSelfAttention", "DecoderAttention", "SparseAttention"}
ATTENTION |= {"LongformerAttention", "PagedAttention", "QAttention", "QOrderedAttention", "QOrderedLongformerAttention"}
COMPUTE |= ATTENTION
RECURRENT = {"LSTM", "GRU", "RNN", "DynamicQuantizeLSTM"}  # W and R: [directions, gates x hidden, input | hidden]
COMPUTE |= RECURRENT
# ops no runtime fuses with the DequantizeLinear before them (no QDQ kernel in ONNX Runtime or TensorRT): they run
# in float on dequantized values; only ONNX Runtime's DynamicQuantizeLSTM computes an LSTM in integers
FLOAT_ONLY = FOURIER | {"LSTM", "GRU", "RNN"}
INTEGER = {"MatMulInteger", "ConvInteger", "QLinearMatMul", "QLinearConv", "DynamicQuantizeMatMul", "QGemm"}
INTEGER |= {"MatMulIntegerToFloat", "QAttention", "QOrderedMatMul", "MatMulNBits", "QOrderedAttention"}
INTEGER |= {"QOrderedLongformerAttention", "DynamicQuantizeLSTM"}
SUBGRAPHS = ("body", "then_branch", "else_branch")  # Loop and Scan, If
WEIGHT_INPUT = {"QLinearMatMul": 3, "QLinearConv": 3, "QGemm": 3}  # where the second operand sits
LOW = ("int8", "fp8", "fp16")
FLOAT8 = (onnx.TensorProto.FLOAT8E4M3FN, onnx.TensorProto.FLOAT8E5M2)
FLOAT_TYPES = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE)
MIN_SHARE = 0.5  # an engine labelled INT8/FP16 must run at least this share of its FLOPs in that precision

log = logging.getLogger("kiln")


@dataclass
class Audit:
    """FLOPs per sample by precision; ``uncounted``: compute nodes, by precision, whose FLOPs could not be counted
    (``uncounted_ops``: the same by op, ``"MatMul (in a Loop)"`` for one in a subgraph, ``"MatMul (after a Loop)"``
    for one on its output); ``largest``: the FLOPs of the largest node counted (what :func:`share_floor` weighs an
    uncounted one at)."""

    flops: Counter[str] = field(default_factory=Counter)
    nodes: Counter[str] = field(default_factory=Counter)
    uncounted: Counter[str] = field(default_factory=Counter)
    uncounted_ops: dict[str, Counter[str]] = field(default_factory=dict)
    largest: int = 0
    weight_flops: int = 0  # of MatMul/Gemm nodes whose second operand is a weight (linear layers)
    # a runtime's fused graph (``audit_graph``'s ``fused``): the compute nodes, by name, that stay float ops behind a
    # DequantizeLinear (name -> op: the runtime fused them into no integer op, they compute on dequantized values)
    float_behind_dq: dict[str, str] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)  # the dynamic axis sizes the FLOPs are counted at
    by_node: dict[str, tuple[str, str, int]] = field(default_factory=dict)  # name -> op, precision, FLOPs (counted)
    # the uncounted nodes' runs per sample beyond one each, by precision (a node in the body of a Loop of 6 trips:
    # 5 more; none where the trip count is not known, those nodes being in ``unbounded``)
    repeats: Counter[str] = field(default_factory=Counter)
    unbounded: Counter[str] = field(default_factory=Counter)  # in a Loop's or Scan's body of no known trip count

    @property
    def total(self) -> int:
        return sum(self.flops.values())

    def share(self) -> dict[str, float]:
        """Each precision's share of the FLOPs; where none could be counted, of the compute nodes' runs per sample
        (a node in a Loop's body runs its trip count times: :attr:`repeats`)."""
        weights = self.flops if self.total else self.nodes + self.repeats
        whole = sum(weights.values())
        return {p: round(weights[p] / whole, 4) for p in ("int8", "fp8", "fp16", "fp32") if whole and weights[p]}

    def floor(self) -> dict[str, float]:
        """Each precision's least share, uncounted nodes weighed against it (:func:`share_floor`)."""
        return share_floor(self.share(), self.total, self.runs(), self.largest, set(self.unbounded))

    def runs(self) -> Counter[str]:
        """The uncounted nodes' runs per sample, by precision (each once, a Loop's or Scan's body its trips)."""
        return self.uncounted + self.repeats

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
            "uncounted_ops": {op: dict(by) for op, by in sorted(self.uncounted_ops.items())},
            "counted_at": self.sizes,
            **({"trips_unknown": dict(self.unbounded)} if self.unbounded else {}),
            **(self._behind_dq_record() if self.float_behind_dq else {}),
        }

    def _behind_dq_record(self) -> dict[str, Any]:
        """The ops left in float behind a DequantizeLinear, by op, and their share of the FLOPs counted: what the
        low precision's share would gain had the runtime integer kernels for them."""
        flops = sum(self.by_node[n][2] for n in self.float_behind_dq if n in self.by_node)
        return {
            "float_behind_dq": dict(Counter(self.float_behind_dq.values())),
            "float_behind_dq_share": round(flops / self.total, 4) if self.total else 0.0,
        }

    def elsewhere(self, precision: str, kept: Collection[str] = ()) -> tuple[int, Counter[str]]:
        """The counted FLOPs not in ``precision``: those of the ``kept`` nodes (kept in float on purpose), and the
        others' by op type (what the precision does not reach: ops it does not quantize or cannot compute)."""
        outside = [(name, op, flops) for name, (op, p, flops) in self.by_node.items() if p != precision]
        by_op: Counter[str] = Counter()
        for name, op, flops in outside:
            if name not in kept:
                by_op[op] += flops
        return sum(flops for name, _, flops in outside if name in kept), by_op

    def not_counted(self, op: str, precision: str, runs: int | None = 1) -> None:
        """Record an uncounted node that runs ``runs`` times per sample (None: a number the data decides)."""
        self.uncounted[precision] += 1
        self.uncounted_ops.setdefault(op, Counter())[precision] += 1
        self.repeats[precision] += 0 if runs is None else runs - 1
        if runs is None:
            self.unbounded[precision] += 1

    def basis(self) -> str:
        """What the shares are of, for a ``method``: the FLOPs, or (none counted) the compute nodes' runs."""
        return "by FLOPs" if self.total else "by compute node (no FLOPs counted)"


def share_floor(
    share: dict[str, float],
    total: int,
    uncounted: Mapping[str, int],
    largest: int,
    unbounded: Collection[str] = (),
) -> dict[str, float]:
    """Each precision's least share of the FLOPs: its share of the ``total`` counted, were every uncounted compute
    node in another precision as large as the ``largest`` counted one, each time it runs (``uncounted``: their runs
    per sample by precision). An FP32 attention MatMul whose sizes are not known then weighs against INT8 linear
    layers, where leaving it out would call the graph "int8 100 %". A node of another precision in a Loop's or
    Scan's body that runs as often as the data says (its precision in ``unbounded``) could outweigh any share: 0.
    No FLOPs counted (``total`` 0): ``share`` is of the nodes' runs, and holds but for those."""
    doubt = {p: any(q != p for q in unbounded) for p in share}
    if not total:
        return {p: 0.0 if doubt[p] else v for p, v in share.items()}
    against = {p: sum(n for q, n in uncounted.items() if q != p) for p in share}
    return {p: 0.0 if doubt[p] else round(v * total / (total + largest * against[p]), 4) for p, v in share.items()}


def audit_graph(
    model: onnx.ModelProto | Path, sizes: dict[str, int] | None = None, run: bool = True, fused: bool = False
) -> Audit:
    """The graph's compute nodes by precision and FLOPs for one sample: batch 1, each other named axis at
    ``sizes`` (1 where not given). ``run``: the graph may run once on ONNX Runtime for the shapes both shape
    inferences leave unknown (:func:`_run_shapes`); False where only the node counts are wanted. ``fused``: the
    graph is one a runtime has already fused its Q/DQ pairs in (ONNX Runtime's optimized graph, where what it runs in
    integers is a QLinear*/integer op): a float compute op still behind a DequantizeLinear runs in float there. Not
    fused (a graph before its build, TensorRT's input), such an op is the precision it was quantized to."""
    m = load_onnx(model, load_external_data=False) if isinstance(model, Path) else model
    light, _ = light_model(m)
    used = _pin(light, sizes or {})
    with _shaped_as_lstm(light):
        m = infer_shapes(light, strict=False)  # recorded symbolic shapes dropped: inferred at the pinned sizes
    opset = _opset(m)
    shapes, scalars = _sized(model, m, opset, run)
    compute = [n for n in m.graph.node if _is_compute(n)]
    graphs = [m.graph, *(g for _, g in _subgraphs(m.graph))]
    types = {v.name: v.type.tensor_type.elem_type for g in graphs for v in [*g.value_info, *g.input, *g.output]}
    types.update({t.name: t.data_type for g in graphs for t in g.initializer})
    producer = {o: n for g in graphs for n in g.node for o in n.output}
    inits = {t.name for g in graphs for t in g.initializer}
    weights = {t.name for t in m.graph.initializer} | _transposed(m)
    after = _after_control_flow(m.graph)
    out = Audit(sizes=used)
    # a node in a body runs as many times as its Loop or Scan says (``runs``), or in one branch of an If
    for node, owner, runs in _nested(m.graph, shapes, scalars, opset):
        precision = _precision(node, producer, types, inits, fused)
        out.nodes[precision] += 1
        out.not_counted(f"{node.op_type} (in a {owner})", precision, runs)
    for node in compute:
        precision = _precision(node, producer, types, inits, fused)
        if fused and node.op_type not in INTEGER and _quantized(node, producer, types, inits):
            out.float_behind_dq[node.name or node.output[0]] = node.op_type
        flops = _flops(node, shapes, scalars, opset)
        out.nodes[precision] += 1
        if flops is None:
            owner = next((after[i] for i in node.input if i in after), None)
            shapeless = owner is not None and node.op_type not in ATTENTION  # attention's own sizes are the cause
            out.not_counted(f"{node.op_type} (after a {owner})" if shapeless else node.op_type, precision)
        else:
            out.flops[precision] += flops
            out.largest = max(out.largest, flops)
            out.by_node[node.name or node.output[0]] = (node.op_type, precision, flops)
            if node.op_type in ("MatMul", "Gemm") and len(node.input) > 1 and node.input[1] in weights:
                out.weight_flops += flops
    return out


def flops_by_op(model: onnx.ModelProto) -> dict[str, int] | None:
    """The graph's FLOPs per sample by op type, for telling a CNN from a Transformer by where its compute is
    (:func:`kiln.calibration.quantize.ort_cpu_scheme`); None where that count would mislead: an input axis of no
    fixed size past the batch (counted at 1, where convolutions weigh as little as their weights), or a compute
    node it cannot count."""
    inputs = model.graph.input
    if not all(d.HasField("dim_value") for i in inputs for d in list(i.type.tensor_type.shape.dim)[1:]):
        return None
    audit = audit_graph(model, run=False)
    if audit.uncounted_ops:
        return None
    out: Counter[str] = Counter()
    for op, _, flops in audit.by_node.values():
        out[op] += flops
    return dict(out)


@contextmanager
def _shaped_as_lstm(model: onnx.ModelProto) -> Iterator[None]:
    """ONNX Runtime's DynamicQuantizeLSTM nodes of ``model`` shown to onnx's shape inference, which has no rule for
    them, as the LSTM each computes (its first eight inputs are an LSTM's, its outputs are shaped alike), and put
    back after: the nodes after one (a second layer's LSTM, the head) then have shapes, and their FLOPs count."""
    swapped = [(node, onnx.NodeProto()) for node in model.graph.node if node.op_type == "DynamicQuantizeLSTM"]
    for node, kept in swapped:
        kept.CopyFrom(node)
        node.op_type, node.domain = "LSTM", ""
        del node.input[8:]
    try:
        yield
    finally:
        for node, kept in swapped:
            node.CopyFrom(kept)


def compute_precisions(model: onnx.ModelProto | Path) -> Counter[str]:
    """Compute nodes per precision (``int8``, ``fp16``, ``fp32``)."""
    return audit_graph(model, run=False).nodes


def _precision(
    node: onnx.NodeProto,
    producer: dict[str, onnx.NodeProto],
    types: dict[str, int],
    inits: set[str],
    fused: bool = False,
) -> str:
    """An integer op computes in INT8; a node fed by a DequantizeLinear (:func:`_quantized`) in what was quantized
    (Q/DQ: float8 or an 8-bit integer), unless the graph is a runtime's ``fused`` one (what it did not fuse into an
    integer op runs on the dequantized values in float); any other in its operands' float type."""
    if node.op_type in INTEGER:
        return "int8"
    dequantized = _quantized(node, producer, types, inits)
    if dequantized and not fused:
        float8 = any(types.get(dq.input[0]) in FLOAT8 for dq in dequantized)
        return "fp8" if float8 else "int8"
    # the activation's type, else (a fused op shape inference cannot see through) the weight's
    elem = types.get(node.input[0]) or (types.get(node.input[1]) if len(node.input) > 1 else None)
    return "fp16" if elem == onnx.TensorProto.FLOAT16 else "fp32"


def _quantized(
    node: onnx.NodeProto, producer: dict[str, onnx.NodeProto], types: dict[str, int], inits: set[str]
) -> list[onnx.NodeProto]:
    """The DequantizeLinear nodes a float compute node computes on as a quantized layer (its first two operands:
    activation and weight); none where its weight is a plain float (:func:`_float_weight`: a layer kept in float,
    whose input the layer before quantized, runs in float) or it is an op of :data:`FLOAT_ONLY` (a DFT, an LSTM),
    which no runtime computes in integers (it runs on the dequantized values in float)."""
    operands = [i for i in node.input[:2] if i]
    if node.op_type in FLOAT_ONLY or any(_float_weight(i, producer, types, inits) for i in operands):
        return []
    return [dq for i in operands if (dq := _dequantized(i, producer)) is not None]


# Ops that move or relabel values without computing on them: a DequantizeLinear's output through them is still
# the quantized values (a weight transposed or reshaped after its DequantizeLinear)
LAYOUT_OPS = {"Transpose", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity"}


def _moves_floats(node: onnx.NodeProto) -> bool:
    """A layout op (:data:`LAYOUT_OPS`) or a Cast to a float type: on float values, it hands on the values it
    reads, at most rounded to another float type (an FP16 graph's Cast after each DequantizeLinear)."""
    return node.op_type in LAYOUT_OPS or node.op_type == "Cast" and cast_to(node) in FLOAT_TYPES


def _dequantized(name: str, producer: dict[str, onnx.NodeProto]) -> onnx.NodeProto | None:
    """The DequantizeLinear that ``name`` comes from, through layout ops and Casts to a float type only
    (:func:`_moves_floats`: a DequantizeLinear's output is float, so each Cast on the way is float to float); None
    where it does not come from one (a float initializer, a computed activation)."""
    _, node = traced_back(name, producer, _moves_floats)
    return node if node is not None and node.op_type == "DequantizeLinear" else None


def _float_weight(name: str, producer: dict[str, onnx.NodeProto], types: dict[str, int], inits: set[str]) -> bool:
    """Whether ``name`` is a float weight not quantized: a float initializer (of ``inits``) or Constant, reached
    through layout ops (:data:`LAYOUT_OPS`) and Casts to a float type only (weights stored as float16 and cast to
    float are plain float weights; from an integer one, the initializer's type says it is none), with no
    DequantizeLinear on the way."""
    name, node = traced_back(name, producer, _moves_floats)
    if node is not None:
        return node.op_type == "Constant"
    return name in inits and types.get(name) in FLOAT_TYPES


def _is_compute(node: onnx.NodeProto) -> bool:
    """A compute node; an Einsum of one operand transposes or sums, computing nothing to speak of."""
    return node.op_type in COMPUTE | INTEGER and not (node.op_type == "Einsum" and len(node.input) < 2)


def _flops(node: onnx.NodeProto, shapes: dict[str, list[int]], scalars: Mapping[str, int], opset: int) -> int | None:
    """Multiply-adds x 2 of one compute node, from its inferred shapes (and, for a DFT or STFT, the ``scalars`` its
    length, axis or frame length may be given by, at ``opset``); None where one is unknown or the op's FLOPs are
    not given by its shapes."""
    op = node.op_type
    if op in ATTENTION:
        return None  # its FLOPs depend on heads and sequence lengths its shapes alone do not give
    if op in RECURRENT:
        return _recurrent_flops(node, shapes)
    if op in FOURIER:
        return _fourier_flops(node, shapes, scalars, opset)
    if op == "Einsum":
        return _einsum_flops(node, shapes)
    a = shapes.get(node.input[0]) if node.input else None
    w = shapes.get(node.input[WEIGHT_INPUT.get(node.op_type, 1)]) if len(node.input) > 1 else None
    y = shapes.get(node.output[0])
    if a is None or w is None or y is None:
        return None
    if op in ("Conv", "ConvInteger", "QLinearConv", "FusedConv", "NhwcConv", "DeformConv"):
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


def _fourier_flops(
    node: onnx.NodeProto, shapes: dict[str, list[int]], scalars: Mapping[str, int], opset: int
) -> int | None:
    """A DFT or STFT as FFTs: 5 N log2 N per complex transform of length N, 2.5 N log2 N per real one (FFTW's
    benchmark convention). A DFT transforms every line of its signal along ``axis`` (an attribute to opset 19, an
    input from 20), padded or cut to ``dft_length`` where given; an STFT transforms each frame of its window's (or
    ``frame_length``'s) length. None where a length is not a constant or a shape is unknown."""
    x = shapes.get(node.input[0])
    given = [node.input[i] if i < len(node.input) and node.input[i] else None for i in range(4)]
    if x is None or len(x) < 3:
        return None
    per = 2.5 if x[-1] == 1 else 5.0  # the last axis holds a real value, or a real and an imaginary part

    def fft(n: int) -> float:
        return per * n * log2(n) if n > 1 else 0.0

    if node.op_type == "STFT":
        window, y = shapes.get(given[2] or ""), shapes.get(node.output[0])
        n = window[0] if window else scalars.get(given[3] or "")
        return None if n is None or y is None else round(prod(y[:2]) * fft(n))  # y: [batch, frames, bins, 2]
    attr = next((at.i for at in node.attribute if at.name == "axis"), None)
    axis = attr if attr is not None else scalars.get(given[2]) if given[2] else (1 if opset < 20 else -2)
    if axis is None:
        return None
    axis %= len(x)
    n = scalars.get(given[1]) if given[1] else x[axis]
    return None if n is None else round(prod(x[:-1]) // x[axis] * fft(n))


def _einsum_flops(node: onnx.NodeProto, shapes: dict[str, list[int]]) -> int | None:
    """An Einsum's FLOPs in the order of pairwise contractions numpy finds cheapest (its optimal path): 2 x the
    product of the sizes of every index each contraction reads, summed (two operands: a GEMM's 2 M N K). A runtime
    that contracts in another order computes about as much or more: an FP32 Einsum of four operands weighs at least
    this against INT8 layers. None where a shape is unknown or it has more than :data:`EINSUM_MAX_OPERANDS`
    operands."""
    equation = next((at.s.decode() for at in node.attribute if at.name == "equation"), "").replace(" ", "")
    given, _, out = equation.partition("->")
    terms = given.split(",")
    if not 2 <= len(terms) <= EINSUM_MAX_OPERANDS or len(node.input) != len(terms):
        return None
    operands = [shapes.get(name) for name in node.input]
    if any(shape is None for shape in operands):
        return None
    labelled = _einsum_labels(terms, out if "->" in equation else None, operands)
    if labelled is None:
        return None
    terms, out, sizes = labelled
    views = [np.broadcast_to(np.float32(0), [sizes[c] for c in term]) for term in terms]
    path, _ = np.einsum_path(f"{','.join(terms)}->{out}", *views, optimize=("optimal", 2**62))
    flops = 0
    for step in path[1:]:  # each step contracts the operands it names into one, appended last
        read = set().union(*(terms[i] for i in step))
        terms = [t for i, t in enumerate(terms) if i not in step]
        kept = set(out).union(*terms)
        flops += (2 if len(step) > 1 else 1) * prod(sizes[c] for c in read)
        terms.append("".join(sorted(read & kept)))
    return flops


EINSUM_MAX_OPERANDS = 6  # numpy's optimal path tries every order: quick up to this many operands


def _einsum_labels(
    terms: list[str], out: str | None, shapes: list[list[int]]
) -> tuple[list[str], str, dict[str, int]] | None:
    """An Einsum's terms and output with each ``...`` spelt as letters of its own (the broadcast axes, aligned from
    the right), and each letter's size (a size-1 axis broadcast to the others'); None where a term's rank is not
    its operand's. An implicit output (no ``->``) is ONNX's: the broadcast axes, then the letters seen once, sorted."""
    free = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz" if c not in "".join(terms) + (out or "")]
    rank = max([0, *(len(s) - len(t.replace("...", "")) for t, s in zip(terms, shapes) if "..." in t)])
    if rank > len(free):
        return None
    wide = "".join(free[:rank])
    spelt = [t.replace("...", wide[rank - (len(s) - len(t.replace("...", ""))) :]) for t, s in zip(terms, shapes)]
    sizes: dict[str, int] = {}
    for term, shape in zip(spelt, shapes):
        if len(term) != len(shape):
            return None
        for c, size in zip(term, shape):
            sizes[c] = max(sizes.get(c, 1), size)
    if out is None:
        letters = "".join(spelt)
        out = wide + "".join(sorted(c for c in set(letters) if letters.count(c) == 1 and c not in wide))
    return spelt, out.replace("...", wide), sizes


def _scalars(graph: onnx.GraphProto) -> dict[str, int]:
    """The graph's integer scalars held as constants (a DFT's length or axis, an STFT's frame length)."""
    tensors = [(t.name, t) for t in graph.initializer]
    tensors += [
        (n.output[0], at.t) for n in graph.node if n.op_type == "Constant" for at in n.attribute if at.name == "value"
    ]
    ints = (onnx.TensorProto.INT64, onnx.TensorProto.INT32)
    return {
        name: int(numpy_helper.to_array(t).reshape(-1)[0])
        for name, t in tensors
        if t.data_type in ints and prod(t.dims) == 1 and t.data_location != onnx.TensorProto.EXTERNAL
    }


def _sized(
    given: onnx.ModelProto | Path, pinned: onnx.ModelProto, opset: int, run: bool
) -> tuple[dict[str, list[int]], dict[str, int]]:
    """The shapes and integer scalars of ``pinned`` (``given`` with its inputs at the audit's sizes, shapes
    inferred) that the FLOPs are counted by: onnx's inference, ONNX Runtime's symbolic inference where a compute
    node's shapes need more, then (``run``) one run of ``given`` for the shapes both leave unknown. A scalar
    computed from shapes (a DFT's length of twice the sequence's, a Loop's trip count of the sequence length) is
    folded from them (:func:`_fold`)."""
    shapes = _shapes(pinned)
    scalars = {k: v for g in [pinned.graph, *(g for _, g in _subgraphs(pinned.graph))] for k, v in _scalars(g).items()}
    compute = [n for n in pinned.graph.node if _is_compute(n)]
    if any(_flops(n, shapes, scalars, opset) is None for n in compute):
        shapes = {**_symbolic_shapes(pinned), **shapes}
    plans = {k: v for k in _wanted_scalars(pinned.graph, scalars) if (v := _fold_plan(k, pinned.graph)) is not None}
    scalars = {**_fold(plans, pinned, shapes), **scalars}
    plans = {k: v for k, v in plans.items() if k not in scalars}  # a shape they read is not known yet
    if not run:
        return shapes, scalars
    wanted = _unsized(compute, shapes, scalars, opset, _after_control_flow(pinned.graph)) + _scanned(pinned.graph)
    wanted += [n.input[0] for plan in plans.values() for n in plan if n.op_type in ("Shape", "Size")]
    if wanted := [w for w in dict.fromkeys(wanted) if w not in shapes]:
        shapes = {**_run_shapes(given, pinned, wanted), **shapes}
        scalars = {**_fold(plans, pinned, shapes), **scalars}
    return shapes, scalars


def _wanted_scalars(graph: onnx.GraphProto, scalars: Mapping[str, int]) -> list[str]:
    """The integer scalars, not constants, that ``graph``'s FLOPs are counted by: a DFT's length and axis, an
    STFT's frame length, the trip count of a Loop around compute nodes."""
    out: list[str] = []
    for node in graph.node:
        at = {"DFT": (1, 2), "STFT": (3,), "Loop": (0,) if _holds_compute(node) else ()}.get(node.op_type, ())
        out += [node.input[i] for i in at if i < len(node.input) and node.input[i] and node.input[i] not in scalars]
    return out


def _fold_plan(name: str, graph: onnx.GraphProto) -> list[onnx.NodeProto] | None:
    """The nodes of ``graph`` that compute ``name`` from the shapes of other tensors (Shape and Size ops, constants,
    arithmetic on them), in graph order; None where it reads a graph input's values or a Loop's, Scan's or If's
    output: then it is the data's, not the sizes'."""
    producer = {o: (i, n) for i, n in enumerate(graph.node) for o in n.output}
    inputs = {i.name for i in graph.input} - {t.name for t in graph.initializer}
    todo, nodes = [name], {}
    while todo:
        value = todo.pop()
        if value in inputs:
            return None
        index, node = producer.get(value, (-1, None))
        if node is None or index in nodes:
            continue
        if any(at.type == onnx.AttributeProto.GRAPH for at in node.attribute):
            return None
        nodes[index] = node
        todo += [] if node.op_type in ("Shape", "Size") else [i for i in node.input if i]
    return [nodes[i] for i in sorted(nodes)]


def _fold(
    plans: Mapping[str, list[onnx.NodeProto]], pinned: onnx.ModelProto, shapes: Mapping[str, list[int]]
) -> dict[str, int]:
    """The values of the scalars that ``plans`` compute (:func:`_fold_plan`), each Shape or Size op in them read from
    ``shapes`` (the sizes the audit counts at), evaluated by ONNX's reference runtime; those it cannot give (a shape
    not known, a weight ``pinned`` holds as a stub) are left out."""
    out: dict[str, int] = {}
    inits = {t.name: t for t in pinned.graph.initializer}
    for name, plan in plans.items():
        nodes = [_shape_constant(n, shapes) if n.op_type in ("Shape", "Size") else n for n in plan]
        if any(n is None for n in nodes):
            continue
        used = [inits[i] for i in dict.fromkeys(i for n in plan for i in n.input) if i in inits]
        sub = onnx.helper.make_graph(nodes, "fold", [], [onnx.ValueInfoProto(name=name)], used)
        try:
            from onnx.reference import ReferenceEvaluator

            model = onnx.helper.make_model(sub, opset_imports=pinned.opset_import, ir_version=pinned.ir_version)
            value = np.asarray(ReferenceEvaluator(model).run(None, {})[0])
        except Exception as exc:  # a helper for counting: what it cannot fold stays uncounted
            log.debug("folding %s from the graph's shapes failed: %s", name, exc)
            continue
        if value.size == 1 and value.dtype.kind in "iu":
            out[name] = int(value.reshape(-1)[0])
    return out


def _shape_constant(node: onnx.NodeProto, shapes: Mapping[str, list[int]]) -> onnx.NodeProto | None:
    """A Shape (its ``start``/``end`` slice) or Size node as the Constant it is at ``shapes``; None where its
    input's shape is not known."""
    shape = shapes.get(node.input[0])
    if shape is None:
        return None
    if node.op_type == "Size":
        value = np.array(prod(shape), np.int64)
    else:
        start = next((at.i for at in node.attribute if at.name == "start"), 0)
        end = next((at.i for at in node.attribute if at.name == "end"), len(shape))
        value = np.array(shape[start:end], np.int64)
    return onnx.helper.make_node("Constant", [], [node.output[0]], value=numpy_helper.from_array(value))


def _nested(
    graph: onnx.GraphProto,
    shapes: Mapping[str, list[int]],
    scalars: Mapping[str, int],
    opset: int,
    runs: int | None = 1,
) -> list[tuple[onnx.NodeProto, str, int | None]]:
    """Each compute node in a graph nested in ``graph`` (a Loop's or Scan's body, an If's branches, at any depth),
    with the op that holds it and how many times it runs per sample: ``runs`` times each trip count of the Loops
    and Scans around it (:func:`_trips`), None where one is not known; an If runs one branch."""
    out: list[tuple[onnx.NodeProto, str, int | None]] = []
    for node in graph.node:
        bodies = [at.g for at in node.attribute if at.name in SUBGRAPHS and at.type == onnx.AttributeProto.GRAPH]
        if not bodies:
            continue
        trips = 1 if node.op_type == "If" else _trips(node, shapes, scalars, opset)
        inner = None if runs is None or trips is None else runs * trips
        for body in bodies:
            out += [(n, node.op_type, inner) for n in body.node if _is_compute(n)]
            out += _nested(body, shapes, scalars, opset, inner)
    return out


def _trips(node: onnx.NodeProto, shapes: Mapping[str, list[int]], scalars: Mapping[str, int], opset: int) -> int | None:
    """How many times a Loop or Scan runs its body; None where the data decides. A Loop: its trip count where that
    is known and its condition cannot stop it sooner (:func:`_runs_to_the_end`). A Scan (opset 9 on): the length
    of its first scan input along its scan axis."""
    if node.op_type == "Loop" and node.input and node.input[0] and _runs_to_the_end(node):
        return scalars.get(node.input[0])
    scanned = _scanned_input(node)
    if node.op_type == "Scan" and opset >= 9 and scanned and scanned in shapes:
        axes = next((list(at.ints) for at in node.attribute if at.name == "scan_input_axes"), [0]) or [0]
        return shapes[scanned][axes[0] % len(shapes[scanned])]
    return None


def _runs_to_the_end(loop: onnx.NodeProto) -> bool:
    """Whether a Loop runs all its trips: it takes no condition (its body's is then ignored), or its body hands the
    condition on unchanged (through Identity ops) or sets it to a constant true (a ``for`` loop's export)."""
    if len(loop.input) < 2 or not loop.input[1]:
        return True
    body = next(at.g for at in loop.attribute if at.name == "body")
    producer = {o: n for n in body.node for o in n.output}
    name, node = traced_back(body.output[0].name, producer, lambda n: n.op_type == "Identity")
    if node is None:
        return name == body.input[1].name
    value = next((at.t for at in node.attribute if at.name == "value"), None) if node.op_type == "Constant" else None
    return value is not None and bool(numpy_helper.to_array(value).all())


def _scanned_input(node: onnx.NodeProto) -> str | None:
    """A Scan's first scan input (after its state inputs), whose scan axis gives its trip count; None for another
    op."""
    if node.op_type != "Scan":
        return None
    scanned = len(node.input) - next((at.i for at in node.attribute if at.name == "num_scan_inputs"), 0)
    return node.input[scanned] if scanned < len(node.input) else None


def _scanned(graph: onnx.GraphProto) -> list[str]:
    """The first scan inputs of ``graph``'s Scans that hold compute nodes: their trip counts' tensors."""
    return [x for n in graph.node if _holds_compute(n) and (x := _scanned_input(n))]


def _holds_compute(node: onnx.NodeProto) -> bool:
    """Whether a compute node is in ``node``'s subgraphs, at any depth."""
    bodies = [at.g for at in node.attribute if at.type == onnx.AttributeProto.GRAPH]
    return any(_is_compute(n) for b in bodies for g in [b, *(g for _, g in _subgraphs(b))] for n in g.node)


def _opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 17)


def _subgraphs(graph: onnx.GraphProto) -> list[tuple[str, onnx.GraphProto]]:
    """Every graph nested in ``graph`` (a Loop's or Scan's body, an If's branches, at any depth), with the op that
    holds it."""
    out: list[tuple[str, onnx.GraphProto]] = []
    for node in graph.node:
        for at in node.attribute:
            if at.name in SUBGRAPHS and at.type == onnx.AttributeProto.GRAPH:
                out += [(node.op_type, at.g), *_subgraphs(at.g)]
    return out


def _after_control_flow(graph: onnx.GraphProto) -> dict[str, str]:
    """Each tensor computed from a Loop's, Scan's or If's output, with that op: its shape is the data's (a
    Loop's trip count, the branch taken), which shape inference cannot give to the nodes after it."""
    out: dict[str, str] = {}
    for node in graph.node:  # in topological order, as ONNX keeps them
        owner = node.op_type if node.op_type in ("Loop", "Scan", "If") else None
        owner = owner or next((out[i] for i in node.input if i in out), None)
        if owner is not None:
            out.update(dict.fromkeys(node.output, owner))
    return out


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
    ``infer_shapes``, which writes a model file into the working directory when a shape stays unknown. Its own
    warnings (an index whose sign it cannot tell) are about its arithmetic, not the user's model: debug only."""
    try:
        # by way of onnxruntime.transformers, which imports the same module as ONNX Runtime's own fusions do:
        # onnxruntime.tools' package imports torch where it is installed (seconds, for a file's audit)
        from onnxruntime.transformers.shape_infer_helper import SymbolicShapeInference
    except ImportError as exc:
        log.debug("symbolic shape inference not available: %s", exc)
        return {}
    said = logging.getLogger(SymbolicShapeInference.__module__)  # its module's logger, by the name it came in by
    level = said.level
    said.setLevel(logging.ERROR)
    try:
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
    finally:
        said.setLevel(level)


def _unsized(
    compute: list[onnx.NodeProto],
    shapes: dict[str, list[int]],
    scalars: Mapping[str, int],
    opset: int,
    after: Mapping[str, str],
) -> list[str]:
    """The tensors of the compute nodes still unsized (their inputs and outputs of no known shape), save those of
    attention ops (their shapes do not give their FLOPs) and of nodes after a Loop, Scan or If (their shapes are
    the data's, which one run on made-up inputs does not give)."""
    out: dict[str, None] = {}
    for node in compute:
        if node.op_type in ATTENTION or any(i in after for i in node.input):
            continue
        if _flops(node, shapes, scalars, opset) is None:
            out.update(dict.fromkeys(t for t in [*node.input, *node.output] if t and t not in shapes))
    return list(out)


def _run_shapes(model: onnx.ModelProto | Path, pinned: onnx.ModelProto, names: list[str]) -> dict[str, list[int]]:
    """The shapes of the tensors ``names`` from one run of ``model`` on ONNX Runtime's CPU provider, fed zeros at
    ``pinned``'s input sizes (the sizes the audit counts at): the concrete shapes where neither shape inference
    computes them (an STFT's framing, a Reshape to a size computed from the input's). ``model`` as given, with its
    weights (``pinned`` is a light copy, whose big weights are stubs; a file's external data is read here), and
    the tensors added as its outputs for the run only. {} where it cannot run: those nodes stay uncounted."""
    try:
        feed = _zeros(pinned)
        full = load_onnx(model) if isinstance(model, Path) else model
        outputs = {o.name for o in full.graph.output}
        added = [onnx.ValueInfoProto(name=n) for n in names if n not in outputs]
        full.graph.output.extend(added)
        try:
            session = ort_session(full, optimization="none")
        finally:
            del full.graph.output[len(full.graph.output) - len(added) :]
        arrays = session.run(names, feed)
    except Exception as exc:  # a helper for counting: the nodes it cannot give stay uncounted, by precision
        log.debug("running the graph for its shapes failed: %s", exc)
        return {}
    return {n: list(a.shape) for n, a in zip(names, arrays) if a.ndim and all(a.shape)}


def _zeros(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Zeros of each graph input's type and (pinned) shape: valid values for an index or a mask input too."""
    inits = {t.name for t in model.graph.initializer}
    return {
        v.name: np.zeros(
            [d.dim_value for d in v.type.tensor_type.shape.dim],
            onnx.helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type),
        )
        for v in model.graph.input
        if v.name not in inits
    }


def _shapes(model: onnx.ModelProto) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for v in [*model.graph.value_info, *model.graph.input, *model.graph.output]:
        # an unknown first axis is the batch, pinned to 1 at the inputs (shape inference loses it through a Reshape
        # whose target it computes from the input's shape); an unknown axis elsewhere leaves the tensor unknown, as
        # does the one axis of a vector (an STFT's window built to a length inference does not compute, not a batch)
        shape = v.type.tensor_type.shape.dim
        batch = 1 if len(shape) > 1 else 0
        dims = [d.dim_value if d.dim_value > 0 else (batch if axis == 0 else 0) for axis, d in enumerate(shape)]
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
    Runtime engine's optimized graph, as its CPU provider fuses it: :func:`_as_fused`; its fused ops count by node
    where their shapes are not inferable, and a float op it left behind a DequantizeLinear counts in float), or
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
        runs, unbounded = {rest: sum(src.runs().values())}, [rest] if src.unbounded else []  # none swapped
        floor = share_floor(share, src.total, runs, src.largest, unbounded)
        method = f"declared by the builder: the linear layers it swapped in {declared.upper()}, the rest {rest}"
        return {**record, "share": share, "share_floor": floor, "method": method}
    if declared is not None:
        whole = {declared: 1.0}
        return {**record, "share": whole, "share_floor": whole, "method": "declared by the builder (dtype)"}
    if engine_graph is None:
        return {**record, "method": "source graph" if src.total else f"source graph, {src.basis()}"}
    ran = audit_graph(_as_fused(engine_graph), sizes, fused=True)
    if ran.float_behind_dq:  # the source graph's count of them too, where the engine graph's FLOPs fall short
        _floated(src, ran.float_behind_dq)
        record = src.record()
    if ran.total >= 0.9 * src.total > 0:
        counted = {k: v for k, v in ran.record().items() if k not in ("flops_per_sample", "counted_at")}
        return {**record, **counted, "method": "engine graph, by FLOPs"}
    # The runtime's fused ops hide their shapes: the source graph's FLOPs, less any precision the engine's graph
    # no longer computes in (ONNX Runtime's CPU provider runs an FP16 graph's MatMul/Conv in FP32, through casts)
    if any(ran.nodes[p] and not src.nodes[p] for p in LOW):  # converted at build: only the engine's graph knows
        whole = sum(ran.nodes.values())
        share = {p: round(ran.nodes[p] / whole, 4) for p in (*LOW, "fp32") if ran.nodes[p]}
        floor = share_floor(share, 0, {}, 0, set(ran.unbounded))  # a body run as often as the data says: in doubt
        method = "engine graph, by compute node (converted at build)"
        return {**record, "share": share, "share_floor": floor, "share_covers_nodes": 1.0, "method": method}
    gone = [p for p in LOW if not ran.nodes[p]]
    share, uncounted = _as_fp32(record["share"], gone), _as_fp32(src.uncounted, gone)
    runs, unbounded = _as_fp32(src.runs(), gone), set(_as_fp32(src.unbounded, gone))
    ops = {op: _as_fp32(by, gone) for op, by in record["uncounted_ops"].items()}
    floor = share_floor(share, src.total, runs, src.largest, unbounded)
    method = f"source graph {src.basis()}, checked against the engine graph"
    return {
        **record,
        "share": share,
        "share_floor": floor,
        "uncounted_nodes": uncounted,
        "uncounted_ops": ops,
        **({"trips_unknown": _as_fp32(src.unbounded, gone)} if src.unbounded else {}),
        "method": method,
    }


def _as_fused(path: Path) -> onnx.ModelProto | Path:
    """The ONNX Runtime engine graph at ``path`` with its Q/DQ pairs fused as ONNX Runtime's CPU provider fuses them
    (into QLinearConv, MatMulIntegerToFloat, ...: its extended optimizations), so that a float op still behind a
    DequantizeLinear is one it runs in float. The file itself where it holds no such op (nothing left to fuse: an
    FP32 graph, or one ORT's CPU provider already optimized and fused whole); else the graph ORT writes after
    optimizing it (a build's load fallback saves it unoptimized, and a CUDA engine's is the CUDA provider's, whose
    Q/DQ convolutions count as the CPU provider runs them); the file as written where ORT cannot."""
    graph = load_onnx(path, load_external_data=False)
    producer = {o: n for n in graph.graph.node for o in n.output}
    types = {t.name: t.data_type for t in graph.graph.initializer}
    behind = (n for n in graph.graph.node if _is_compute(n) and n.op_type not in INTEGER)
    if not any(_quantized(n, producer, types, set(types)) for n in behind):
        return path
    with tempfile.TemporaryDirectory(prefix="kiln-audit-") as tmp:
        fused = Path(tmp) / "fused.onnx"
        try:
            ort_session(path, options=session_options(optimization="extended", optimized_path=fused))
            return load_onnx(fused)
        except Exception as exc:  # a helper for counting: the graph as written is the engine's
            log.debug("optimizing %s on ONNX Runtime's CPU provider for its audit failed: %s", path.name, exc)
            return path


def _floated(src: Audit, floated: Mapping[str, str]) -> None:
    """Move the FLOPs of ``src``'s nodes that the engine runs in float (``floated``: name -> op, the engine graph's
    float ops behind a DequantizeLinear, named as in the source) to fp32, and record them."""
    for name in floated:
        op, precision, flops = src.by_node.get(name, ("", "fp32", 0))
        if precision != "fp32":
            src.flops[precision] -= flops
            src.flops["fp32"] += flops
            src.nodes[precision] -= 1
            src.nodes["fp32"] += 1
            src.by_node[name] = (op, "fp32", flops)
    src.flops, src.nodes = +src.flops, +src.nodes  # no precision left at 0
    src.float_behind_dq = dict(floated)


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
        if floor.get(label, 0.0) < share.get(label, 0.0):
            return _unsized_problem(audit, label, share.get(label, 0.0), floor.get(label, 0.0))
        ran = ", ".join(f"{p} {v:.0%}" for p, v in share.items()) or "nothing counted"
        said = f"labelled {label}, it computes {share.get(label, 0.0):.0%} in {label} ({ran}; {audit.get('method')})"
        return said + _float_behind_dq_note(audit)
    low = _low_label(floor)
    if label == "fp32" and low is not None:
        return f"labelled fp32, its graph computes {floor[low]:.0%} in {low} ({audit.get('method')})"
    return None


def _float_behind_dq_note(audit: dict[str, Any]) -> str:
    """The ops the engine's runtime left in float behind a DequantizeLinear (``float_behind_dq``), named after a
    refusal: quantized in the graph, they are not in the engine; '' where there are none."""
    ops = audit.get("float_behind_dq") or {}
    if not ops:
        return ""
    names = ", ".join(_op_count(op, n) for op, n in sorted(ops.items(), key=lambda kv: -kv[1]))
    return (
        f"; {names} {'runs' if sum(ops.values()) == 1 else 'run'} in float on the dequantized values: the runtime "
        "fused no integer op for them"
    )


def kernel_fix(audit: dict[str, Any], label: str) -> str | None:
    """The fix for an engine of ONNX Runtime's CPU provider refused because that runtime left compute ops quantized
    in its graph in float behind a DequantizeLinear (``float_behind_dq``): a ConvTranspose, for which it has no
    integer kernel, or an op of a kind it has one for that it did not fuse (:data:`ORT_CPU_STATIC_INTEGER`). None
    where those ops are not why ``label`` falls short: the label holds, or would not hold with them in ``label``
    (``float_behind_dq_share``: their share of the FLOPs) either."""
    ops = audit.get("float_behind_dq") or {}
    if not ops or label_problem(audit, label) is None:
        return None
    gained = audit.get("float_behind_dq_share")
    if gained is not None and (audit.get("share") or {}).get(label, 0.0) + gained < MIN_SHARE:
        return None
    runtime = "ONNX Runtime's CPU provider"
    no_kernel = [op for op in ops if op not in ORT_CPU_STATIC_INTEGER]
    unfused = [op for op in ops if op in ORT_CPU_STATIC_INTEGER]
    said = [f"{runtime} has no integer kernel for {_listed(no_kernel)}"] if no_kernel else []
    if unfused:
        by = "it fused" if no_kernel else f"{runtime} fused"
        said.append(f"{by} no integer kernel for the quantized {_listed(unfused)} of this graph")
    one = len(ops) == 1
    ways = [INTEGER_INSTEAD[op] for op in no_kernel if op in INTEGER_INSTEAD]
    ways += [f"build {label} on a GPU backend (TensorRT)", f"leave {label} out of precision.variants"]
    return (
        f"{'; '.join(said)}: its {label} engine would run {'it' if one else 'them'} in float; "
        f"{', '.join(ways[:-1])}, or {ways[-1]}"
    )


# What computes in integers on ONNX Runtime's CPU provider in place of a layer it has no integer kernel for
INTEGER_INSTEAD = {"ConvTranspose": "use nn.Upsample + Conv2d for integer convolutions on the CPU"}


def _listed(ops: list[str]) -> str:
    """``["ConvTranspose"]`` as "ConvTranspose", three ops as "A, B and C"."""
    return ops[0] if len(ops) == 1 else f"{', '.join(ops[:-1])} and {ops[-1]}"


def in_doubt(audit: dict[str, Any], label: str) -> bool:
    """Whether only the compute nodes not sized put a low-precision ``label`` in doubt: its share of the FLOPs
    counted holds :data:`MIN_SHARE`, its floor (those nodes weighed against it) does not."""
    share = (audit.get("share") or {}).get(label, 0.0)
    return label in LOW and share >= MIN_SHARE > audit.get("share_floor", {}).get(label, share)


def doubt_fix(audit: dict[str, Any], label: str) -> str | None:
    """The fix for an engine refused only because compute nodes could not be sized (:func:`in_doubt`), else None:
    nothing counted contradicts the label, so no gate or kernel is to blame. A dynamic axis left at 1 (no size
    given) can leave a graph unable to run (an STFT's frame longer than its signal): its real size is the fix."""
    if not in_doubt(audit, label):
        return None
    sizes = audit.get("counted_at") or {}
    at = ", ".join(f"{k}={v}" for k, v in sizes.items())
    resize = (
        "give the dynamic axes the sizes the engine serves (--set 'signature.shapes={AXIS: [MIN, MAX]}'), "
        if 1 in sizes.values()
        else ""
    )
    return (
        f"the label is in doubt, not contradicted: the audit could not size those nodes{f' at {at}' if at else ''} "
        f"(shape inference, then one ONNX Runtime run there); {resize}compute them in {label} too "
        f"({_knobs(label)}), or leave {label} out of precision.variants"
    )


def _knobs(label: str) -> str:
    """The settings that choose which nodes compute in ``label``: FP16's own, else calibration's (INT8, FP8)."""
    if label == "fp16":
        return "fewer precision.fp16.fp32_ops and precision.fp16.fp32_nodes"
    return "calibration.op_types, fewer calibration.exclude_nodes"


def _unsized_problem(audit: dict[str, Any], label: str, share: float, floor: float) -> str:
    """The refusal of a ``label`` that only the compute nodes not sized put in doubt, led by what is certain: how
    many compute nodes run in ``label``, how many in another precision could not be sized and which ops they are;
    the share of the FLOPs counted (``share``, which leaves them out; of the nodes' runs where no FLOPs are) only
    beside its ``floor``, and how those nodes were weighed."""
    nodes = audit.get("compute_nodes") or {}
    by_op = {op: sum(n for p, n in by.items() if p != label) for op, by in (audit.get("uncounted_ops") or {}).items()}
    others = {p: n for p, n in (audit.get("uncounted_nodes") or {}).items() if p != label and n}
    ops = ", ".join(_op_count(op, n) for op, n in sorted(by_op.items(), key=lambda kv: -kv[1]) if n)
    unsized = sum(others.values())
    counted = "the FLOPs counted" if audit.get("flops_per_sample") else "the compute nodes' runs (no FLOPs counted)"
    weighed = "each weighed as the largest node counted" if audit.get("flops_per_sample") else "each run as one"
    if any(n for p, n in (audit.get("trips_unknown") or {}).items() if p != label):
        weighed += "; a Loop's or Scan's body of no known trip count runs as many times as the data says"
    return (
        f"labelled {label}, {nodes.get(label, 0)} of its {sum(nodes.values())} compute nodes "
        f"{'runs' if nodes.get(label, 0) == 1 else 'run'} in {label} and "
        f"{unsized} in {'/'.join(sorted(others))} could not be sized{f' ({ops})' if ops else ''}: {share:.0%} of "
        f"{counted} run in {label}, as little as {floor:.0%} with those {unsized} ({weighed}; {audit.get('method')})"
    )


def _op_count(op: str, n: int) -> str:
    """``"MatMul (after a Loop)"`` seen 3 times as ``"MatMul x3 after a Loop"``."""
    name, _, where = op.partition(" (")
    return f"{name} x{n}" + (f" {where.rstrip(')')}" if where else "")


def _low_label(share: Mapping[str, float]) -> str | None:
    return next((p for p in LOW if share.get(p, 0.0) >= MIN_SHARE), None)


FP32_HINT = (
    "give the FP32 graph it was made from (the model before quantization or FP16 conversion: `kiln export`'s or "
    "`kiln optimize`'s output, or the FP32 ONNX file of your exporter); Kiln makes every variant from it"
)


def check_model_onnx(settings: Any) -> None:
    """The export stage's check (:attr:`kiln.core.stage.Stage.checks`): a ``model.onnx`` already INT8, FP8 or FP16
    is refused before the run takes it, which would make its FP32 reference and variants from it."""
    if settings.model.onnx:
        refuse_low_precision(Path(settings.model.onnx), f"model.onnx {settings.model.onnx}", "a run")


def refuse_low_precision(graph: onnx.ModelProto | Path, src: str, taker: str) -> None:
    """Refuse an input (``src``, for ``taker``: the command or run that takes an FP32 graph) that computes mostly
    in INT8, FP8 or FP16 already, by the audit's label (:meth:`Audit.label`: a low precision holding half of the
    FLOPs, the rule ``kiln build`` judges an engine's label by). Its variants would be made from no FP32 reference:
    quantizing Q/DQ or FP16 nodes again fails inside ONNX Runtime, and its copy would be written as the fp32
    variant. An FP32 graph with a few nodes in FP16 is taken. The graph runs on ONNX Runtime to size nodes
    (:func:`audit_graph`'s ``run``) only where those could make it low (:func:`_sizing_may_refuse`)."""
    audit = audit_graph(graph, run=False)
    if _sizing_may_refuse(audit):
        audit = audit_graph(graph)
    low = audit.label()
    if low == "fp32":
        return
    graph = load_onnx(graph, load_external_data=False) if isinstance(graph, Path) else graph
    nodes, share = audit.nodes, audit.share().get(low, 0.0)
    flops = f", {share:.0%} of its FLOPs" if audit.total else ""
    raise ModelError(
        f"{src} is already {low.upper()}: {nodes[low]} of its {sum(nodes.values())} compute nodes run in {low}"
        f"{flops} ({_low_precision_found(graph, low)}); {taker} takes an FP32 graph",
        hint=FP32_HINT,
    )


def _sizing_may_refuse(audit: Audit) -> bool:
    """Whether an audit labelled fp32 without sizing its unsized nodes could be labelled low once they are: some
    low precision is in doubt (:func:`in_doubt`), or has nodes not counted. A low label already holds with them
    weighed against it (its floor); an fp32 one with only fp32 nodes unsized stays fp32."""
    record = audit.record()
    return audit.label() == "fp32" and any(audit.uncounted[p] or in_doubt(record, p) for p in LOW)


def _low_precision_found(graph: onnx.ModelProto, low: str) -> str:
    """What makes ``graph`` ``low``, as a user can look it up: its Q/DQ nodes and integer ops, or its float16
    weights."""
    if low == "fp16":
        inits = graph.graph.initializer
        half = sum(t.data_type == onnx.TensorProto.FLOAT16 for t in inits)
        return f"{half} float16 weights of its {len(inits)} initializers"
    ops = Counter(n.op_type for n in graph.graph.node)
    found = [f"{ops[q]} {q}" for q in ("QuantizeLinear", "DequantizeLinear") if ops[q]]
    qdq = [" and ".join(found) + " nodes"] if found else []
    return ", ".join(qdq + [f"{n} {op}" for op, n in sorted(ops.items()) if op in INTEGER])
