"""INT8 Q/DQ graphs with ``onnxruntime.quantization.quantize_static``: per-channel symmetric weights,
symmetric activations, QuantizeLinear/DequantizeLinear pairs (the form TensorRT 10/11 and ORT both run)."""

from __future__ import annotations

import inspect
import logging
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from kiln.calibration.config import CalibrationConfig
from kiln.calibration.quiet import ort_said_to_debug
from kiln.calibration.ranges import Ranges, _ort_method, ranges_file
from kiln.core.cpu_int8 import ORT_CPU_STATIC_INTEGER, resolve_reduce_range
from kiln.core.errors import ModelError, refuse_unknown_names
from kiln.core.graphsurgeon import gs
from kiln.core.logs import root_handlers_kept
from kiln.core.onnx_io import rename_values, value_names
from kiln.core.text import first_line

log = logging.getLogger("kiln.calibration")

# The ops that carry the arithmetic worth quantizing; the first and last of them are the usual accuracy risks.
COMPUTE_OPS = ("Conv", "ConvTranspose", "MatMul", "Gemm")


def first_last_compute(model: onnx.ModelProto) -> list[str]:
    """The first compute layer, the last one in the graph, and the last one before each graph output through
    activations and layout ops (every head of a detector: a heatmap quantized ahead of its sigmoid takes 256
    values, whose ties a peak search counts as detections of their own)."""
    names = [n.name for n in model.graph.node if n.op_type in COMPUTE_OPS]
    return sorted({names[0], names[-1], *last_compute(model)}) if names else []


# Ops a head's output passes through after its last layer: activations and layout, their data input followed
PASS_THROUGH = {
    "Sigmoid", "Softmax", "LogSoftmax", "Relu", "LeakyRelu", "Clip", "Tanh", "HardSigmoid", "Identity", "Cast",
    "Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze", "Resize", "Upsample",
}  # fmt: skip
# squash a layer's result into scores that are read on their own (a heatmap's peaks, a multi-label threshold);
# a softmax's are read by their argmax, which top-1 agreement gates
SCORES = {"Sigmoid", "HardSigmoid"}
# followed where every other input is a constant (a bias, a scale) or computed from shapes (:func:`shape_derived`)
ARITHMETIC = {"Add", "Sub", "Mul", "Div"}
SHAPE_OPS = {"Shape", "Size"}  # their outputs are sizes, not the values of the tensor they read


def last_compute(model: onnx.ModelProto, scores_only: bool = False) -> set[str]:
    """The compute layers whose results reach a graph output through activations, layout ops and arithmetic with
    constants only (not through a residual sum, whose other branch would lead to every layer before it);
    ``scores_only``: those whose way passes a squashing activation (:data:`SCORES`). A value computed from the
    input's sizes counts as a constant: a box head scaled to pixels by an image size read with Shape/Gather where
    height and width are dynamic is the constant multiplier of a static graph."""
    producer = {out: n for n in model.graph.node for out in n.output}
    constant = shape_derived(model)
    found: set[str] = set()
    stack = [(o.name, False) for o in model.graph.output]
    while stack:
        name, scored = stack.pop()
        node = producer.get(name)
        if node is None:
            continue
        scored = scored or node.op_type in SCORES
        if node.op_type in COMPUTE_OPS:
            found |= {node.name} if scored or not scores_only else set()
        elif node.op_type in PASS_THROUGH and node.input:
            stack.append((node.input[0], scored))
        elif node.op_type in ARITHMETIC:
            computed = [i for i in node.input if i and i not in constant]
            stack.extend((i, scored) for i in (computed if len(computed) == 1 else []))
    return found


def shape_derived(model: onnx.ModelProto) -> set[str]:
    """Initializers, Constant outputs, Shape/Size outputs and every value computed from those alone (Gather, Cast,
    Unsqueeze, Concat of sizes): values that do not depend on the data of any input, only on its shape. Follows the
    graph's node order (topological, as ONNX requires)."""
    found = {i.name for i in model.graph.initializer}
    for n in model.graph.node:
        inputs = [i for i in n.input if i]
        if n.op_type in SHAPE_OPS or n.op_type == "Constant" or (inputs and all(i in found for i in inputs)):
            found.update(n.output)
    return found


def excluded_nodes(model: onnx.ModelProto, cfg: CalibrationConfig, extra: Iterable[str] = ()) -> list[str]:
    """Nodes kept in float: configured names, configured op types, first/last layers, the layers that write the
    outputs (``keep_output_layers``), and fallback's picks. An
    excluded op type outside ``op_types`` adds no node: it is never quantized, so nothing is kept for it."""
    return sorted(kept_by(model, cfg, extra))


def kept_by(model: onnx.ModelProto, cfg: CalibrationConfig, extra: Iterable[str] = ()) -> dict[str, str]:
    """Each node :func:`excluded_nodes` keeps in float, with the setting that keeps it (the first that names it;
    ``extra``: the precision fallback's picks), so that a graph left all float can say which setting did it."""
    why = dict.fromkeys(cfg.exclude_nodes, "calibration.exclude_nodes")
    types = (n.name for n in model.graph.node if n.op_type in cfg.exclude_op_types and n.op_type in cfg.op_types)
    why |= {n: "calibration.exclude_op_types" for n in types if n not in why}
    if cfg.exclude_first_last:
        why |= {n: "calibration.exclude_first_last" for n in first_last_compute(model) if n not in why}
    if cfg.keep_output_layers != "off":
        last = last_compute(model, scores_only=cfg.keep_output_layers == "auto")
        setting = f"calibration.keep_output_layers: {cfg.keep_output_layers}, the last layer before an output"
        why |= {n: setting for n in last if n not in why}
    return why | {n: "the precision fallback" for n in extra if n not in why}


def check_exclusions(model: onnx.ModelProto, cfg: CalibrationConfig) -> None:
    """Names in ``exclude_nodes`` and ``exclude_op_types`` that the graph does not have are one error, with the
    closest real names: a typo would otherwise keep nothing in float, silently. An excluded op type the graph
    has but ``op_types`` does not quantize is logged: it stays float anyway."""
    nodes = [n.name for n in model.graph.node]
    ops = sorted({n.op_type for n in model.graph.node})
    known = set(nodes)
    wrong = [("calibration.exclude_nodes", "node", n, nodes) for n in cfg.exclude_nodes if n not in known]
    wrong += [("calibration.exclude_op_types", "op type", o, ops) for o in cfg.exclude_op_types if o not in ops]
    refuse_unknown_names(wrong)
    idle = [o for o in cfg.exclude_op_types if o not in cfg.op_types and o not in DYNAMIC_RECURRENT]
    if idle:
        log.warning(
            "calibration.exclude_op_types: %s not in calibration.op_types, so never quantized: the setting keeps "
            "nothing in float",
            ", ".join(idle),
        )


UNREACHED = (
    "no calibration sample reached it (a routed branch, e.g. an MoE expert, that none of the calibration data takes): "
    "kept in float"
)


def unbounded_nodes(model: onnx.ModelProto, ranges: Ranges, *, warn: bool = True) -> dict[str, str]:
    """Nodes that write or read a tensor with no calibrated scale, each with the reason it stays in float: a range
    that is not finite (:meth:`Ranges.unbounded`; a quantized node there would turn the infinity into a NaN scale)
    or a tensor no calibration batch held a value of (:meth:`Ranges.unreached`). ``warn``: say the unreached nodes
    in one warning (the precision stage asks once per variant; the quantizers, called each fallback round, not)."""
    unbounded, unreached = set(ranges.unbounded()), set(ranges.unreached())
    out: dict[str, str] = {}
    for node in model.graph.node:
        tensors = [*node.output, *node.input]
        hit = next((t for t in tensors if t in unbounded), None)
        if hit is not None:
            out[node.name] = f"'{hit}' is not finite on calibration data (no INT8/FP8 scale holds it)"
        elif any(t in unreached for t in tensors):
            out[node.name] = UNREACHED
    if warn:
        warn_unreached([n for n, why in out.items() if why == UNREACHED])
    return out


def warn_unreached(nodes: list[str]) -> None:
    """One warning naming the nodes no calibration sample reached: their float fallback is right, but the data
    leaves a branch of the model untested by calibration, which the user should know."""
    if nodes:
        more = f" and {len(nodes) - 4} more" if len(nodes) > 4 else ""
        log.warning(
            "no calibration sample reached %d nodes (%s%s): a routed branch, e.g. an MoE expert, that none of the "
            "calibration data takes; with no INT8/FP8 scale they are kept in float; fix: calibrate on data that "
            "takes every branch of the model (--calibration, data.name)",
            len(nodes),
            ", ".join(nodes[:4]),
            more,
        )


def unbounded_quietly(ranges: Ranges) -> AbstractContextManager[Any]:
    """numpy's division and cast warnings silenced where ``ranges`` hold tensors without a scale (not finite, or no
    value held): ORT's quantizer computes a scale for every tensor of the cache, theirs too (NaN), and their nodes
    stay in float (:func:`unbounded_nodes`), so the warnings name nothing wrong (the log counts those tensors)."""
    quiet = ranges.unbounded() or ranges.unreached()
    return np.errstate(divide="ignore", invalid="ignore") if quiet else nullcontext()


def quantizable_op_types(cfg: CalibrationConfig) -> list[str]:
    return sorted(set(cfg.op_types) - set(cfg.exclude_op_types))


# Recurrent ops ONNX Runtime's dynamic quantization computes in int8: an LSTM, as its DynamicQuantizeLSTM kernel (int8
# weights, each step's input and hidden state quantized as it runs). It has no int8 kernel for GRU or RNN, which stay
# float. No runtime computes them in int8 from Q/DQ, so calibration.op_types (the Q/DQ graph's) does not list them.
DYNAMIC_RECURRENT = ("LSTM",)


# Op types of calibration.op_types that dynamic quantization takes too, where listed there: a Gather whose table is
# a stored weight is stored in int8 and its looked-up rows dequantized (an embedding table a quarter of its size).
DYNAMIC_LISTED = ("Gather",)


def dynamic_op_types(cfg: CalibrationConfig) -> list[str]:
    """The op types the dynamic ONNX Runtime CPU graph quantizes: MatMul (a Gemm too, rewritten into one), the ops
    of :data:`DYNAMIC_LISTED` that ``calibration.op_types`` lists, and the recurrent ops of
    :data:`DYNAMIC_RECURRENT` that ``calibration.exclude_op_types`` does not keep in float. Every other op type
    listed stays float in this graph and is quantized in the Q/DQ graph only: convolutions are left to the static
    scheme (:func:`ort_cpu_scheme` picks it where they hold the compute), and the rest compute nothing in int8 there."""
    listed = quantizable_op_types(cfg)
    return [
        "MatMul",
        *(op for op in DYNAMIC_LISTED if op in listed),
        *(op for op in DYNAMIC_RECURRENT if op not in cfg.exclude_op_types),
    ]


def dynamic_nodes(model: onnx.ModelProto, cfg: CalibrationConfig, flops: Mapping[str, int] | None = None) -> set[str]:
    """The nodes the ONNX Runtime CPU graph of ``model`` quantizes beyond ``calibration.op_types`` (its LSTMs, where
    its scheme is dynamic): candidates of that graph's precision fallback too, which may keep them in float."""
    if ort_cpu_scheme(model, cfg, flops) != "dynamic":
        return set()
    extra = set(dynamic_op_types(cfg)) - {"MatMul", *quantizable_op_types(cfg)}
    return {n.name for n in model.graph.node if n.op_type in extra}


PER_CHANNEL_OPSET = 13  # DequantizeLinear's ``axis``: one scale per channel


def per_channel_graph(
    model: onnx.ModelProto, cfg: CalibrationConfig
) -> tuple[onnx.ModelProto | None, CalibrationConfig]:
    """The graph and settings INT8 Q/DQ graphs of ``model`` are quantized from. Per-channel weight scales need
    DequantizeLinear's ``axis``, which came with opset 13, and ORT's quantizer writes it whatever the graph's opset
    (ONNX Runtime then refuses the graph as invalid). An older graph is raised to opset 13 with
    ``onnx.version_converter`` (returned: the variant's outputs are still compared with the FP32 graph's); where the
    converter cannot raise it, weights are quantized per tensor (returned: None and ``per_channel`` off). What was
    done is logged. ``(None, cfg)``: the graph is quantized as it is."""
    from onnx import version_converter

    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), PER_CHANNEL_OPSET)
    if not cfg.per_channel or opset >= PER_CHANNEL_OPSET:
        return None, cfg
    try:
        raised = version_converter.convert_version(model, PER_CHANNEL_OPSET)
    except Exception as exc:  # noqa: BLE001 - the converter raises plain exceptions on ops it has no adapter for
        log.warning(
            "int8: the graph is at opset %d and onnx.version_converter cannot raise it to %d (%s); weights are "
            "quantized per tensor (per-channel scales need opset %d)",
            opset,
            PER_CHANNEL_OPSET,
            first_line(exc),
            PER_CHANNEL_OPSET,
        )
        return None, cfg.model_copy(update={"per_channel": False})
    log.warning(
        "int8: the graph is at opset %d and per-channel weight scales need opset %d: the INT8 graphs are quantized "
        "from a copy raised to opset %d with onnx.version_converter (FP32 and the other variants keep opset %d)",
        opset,
        PER_CHANNEL_OPSET,
        PER_CHANNEL_OPSET,
        opset,
    )
    return raised, cfg


# ORT's quantizer types a tensor that shape inference leaves untyped (one a contrib op such as com.microsoft Gelu
# writes) as float: the graphs Kiln quantizes compute in float, and without it quantize_dynamic refuses them
UNTYPED_AS_FLOAT = {"DefaultTensorType": onnx.TensorProto.FLOAT}


def quantize_int8(
    model_path: Path, out_path: Path, ranges: Ranges, cfg: CalibrationConfig, extra_exclude: Iterable[str] = ()
) -> dict[str, Any]:
    """Write the Q/DQ model to ``out_path`` from cached ``ranges`` (no calibration pass happens here)."""
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static

    model = onnx.load(str(model_path), load_external_data=False)
    exclude = excluded_nodes(model, cfg, [*extra_exclude, *unbounded_nodes(model, ranges, warn=False)])
    seven_bits = resolve_reduce_range(cfg.reduce_range)
    if "calibration_cache_path" not in inspect.signature(quantize_static).parameters:
        # ORT < 1.32 has no cache argument; it would need a reader and calibrate again
        raise RuntimeError("onnxruntime >= 1.32 is needed to quantize from cached calibration ranges")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    _quiet_ort_preprocess_warning()
    source: str | onnx.ModelProto = str(model_path)
    if shared_biases(model):
        source = onnx.load(str(model_path))  # with its weights: the copy is handed over whole
        unshare_biases(source)
    try:
        # uncached ranges: a scratch file for this call only
        with (
            ranges_file(_without_nan(ranges)) as cache_path,
            unbounded_quietly(ranges),
            root_handlers_kept(),
            ort_said_to_debug("quantize_static"),
        ):
            quantize_static(
                source,
                str(out_path),
                None,
                quant_format=QuantFormat.QDQ,
                op_types_to_quantize=quantizable_op_types(cfg),
                per_channel=cfg.per_channel,
                # TensorRT takes only symmetric signed INT8; ORT's x86 kernels are fastest with uint8 activations
                activation_type=QuantType.QUInt8 if cfg.activation_type == "uint8" else QuantType.QInt8,
                weight_type=QuantType.QInt8,
                reduce_range=seven_bits,
                nodes_to_exclude=exclude,
                calibrate_method=_ort_method(ranges.method),
                use_external_data_format=model_path.with_name(model_path.name + ".data").is_file(),
                extra_options={
                    **UNTYPED_AS_FLOAT,
                    "ActivationSymmetric": cfg.symmetric_activations,
                    "WeightSymmetric": True,
                    "QuantizeBias": cfg.quantize_bias,
                },
                calibration_cache_path=str(cache_path),
            )
    except Exception as exc:  # ORT's quantizer raises plain exceptions on graphs it cannot quantize
        raise quantizer_failed("quantize_static", exc, model, "int8", ranges) from None
    q = _float_outputs_at(out_path, model)
    counts = {op: sum(n.op_type == op for n in q.graph.node) for op in ("QuantizeLinear", "DequantizeLinear")}
    log.info(
        "int8: %d Q / %d DQ nodes, %d nodes kept in float",
        counts["QuantizeLinear"],
        counts["DequantizeLinear"],
        len(exclude),
    )
    return {
        "excluded": exclude,
        "qdq_nodes": counts,
        "calibration_cache": str(ranges.path) if ranges.path else None,
        "cache_hit": ranges.cache_hit,
        "method": ranges.method,
        "reduce_range": seven_bits,
    }


def _float_outputs_at(out_path: Path, source: onnx.ModelProto) -> onnx.ModelProto:
    """The quantized graph at ``out_path`` with :func:`serve_float_outputs` applied and its nodes in an order the
    ONNX checker takes (:func:`sort_with_subgraphs`), saved back where it changed (its external weights, not
    loaded, stay where they are)."""
    q = onnx.load(str(out_path), load_external_data=False)
    served = serve_float_outputs(q, source)
    if served:
        log.info("quantized graph: outputs %s served in float (their readers in the graph stay quantized)", served)
    if sort_with_subgraphs(q) or served:
        onnx.save_model(q, str(out_path))
    return q


def serve_float_outputs(model: onnx.ModelProto, source: onnx.ModelProto) -> list[str]:
    """Serve each graph output that the quantized ``model`` also reads from the float tensor its Q/DQ pair
    quantizes, keeping its name. Returns the outputs so served.

    ONNX Runtime's QDQ quantizer puts a QuantizeLinear/DequantizeLinear pair on every tensor a quantized node reads;
    where that tensor is a graph output too, its producer writes ``<name>_QuantizeLinear_Input`` and the
    DequantizeLinear writes ``<name>``, so the served output is rounded to INT8 (or E4M3) and clipped to its
    calibrated range: an error no node kept in float can remove (a seq2seq encoder's last hidden state that
    cross-attention reads, a decoder's new keys and values, a backbone's features returned beside its logits). The
    names are put the way ORT writes them for a tensor that is not an output: the producer writes ``<name>``, the
    DequantizeLinear ``<name>_DequantizeLinear_Output``, which the readers (subgraphs too) read, so they stay
    quantized. Only where that producer is the node ``source`` (the float graph) computes the output with: ORT
    removes a Relu ahead of an asymmetric Q, whose zero point clips at 0, and the Q's input is then the Relu's
    input. An output nothing else reads keeps its pair: it is the output quantization of the layer that writes it."""
    producer = {o: n for n in model.graph.node for o in n.output}
    computes = {o: (n.name, n.op_type) for n in source.graph.node for o in n.output}
    read = {i for n in model.graph.node for i in n.input}
    named = {v.name for v in (*model.graph.input, *model.graph.output, *model.graph.initializer)}
    taken = value_names(model.graph)
    outputs = [o.name for o in model.graph.output]
    mapping: dict[str, str] = {}  # the float tensor -> the output's name, the output -> its DequantizeLinear's
    for out in outputs:
        pre = _quantized_from(out, producer)
        node = producer.get(pre) if pre is not None else None
        if node is None or pre in named or out not in read or computes.get(out) != (node.name, node.op_type):
            continue
        mapping |= {pre: out, out: _unused(f"{out}_DequantizeLinear_Output", taken)}
    rename_values(model.graph, mapping)
    for o, name in zip(model.graph.output, outputs):  # the graph's outputs keep their names
        o.name = name
    served = [out for out in outputs if out in mapping]
    _copies_read_float(model, {mapping[out]: out for out in served}, set(outputs))
    return served


def _copies_read_float(model: onnx.ModelProto, float_of: dict[str, str], outputs: set[str]) -> None:
    """Point each Identity that copies a served output's DequantizeLinear into another graph output (a tensor
    returned twice: ``last_hidden_state`` and ``hidden_states[-1]``) at the float tensor, so both come out alike."""
    for node in model.graph.node:
        if node.op_type == "Identity" and node.input[0] in float_of and node.output[0] in outputs:
            node.input[0] = float_of[node.input[0]]


def _unused(name: str, taken: set[str]) -> str:
    """``name``, or with the first number appended that makes it a name ``taken`` lacks; added to ``taken``."""
    fresh = next(f"{name}{k or ''}" for k in range(len(taken) + 1) if f"{name}{k or ''}" not in taken)
    taken.add(fresh)
    return fresh


def _quantized_from(tensor: str, producer: dict[str, onnx.NodeProto]) -> str | None:
    """The tensor that ``tensor`` is the DequantizeLinear(QuantizeLinear(...)) of; None where it is not one."""
    dq = producer.get(tensor)
    q = producer.get(dq.input[0]) if dq is not None and dq.op_type == "DequantizeLinear" else None
    return q.input[0] if q is not None and q.op_type == "QuantizeLinear" else None


FP8_OPSET = 19  # QuantizeLinear/DequantizeLinear with float8 types


def quantize_fp8(
    model_path: Path, out_path: Path, ranges: Ranges, cfg: CalibrationConfig, extra_exclude: Iterable[str] = ()
) -> dict[str, Any]:
    """Write an FP8 (E4M3) Q/DQ model to ``out_path`` from calibrated ``ranges`` (minmax): one scale per tensor for
    weights and activations, as TensorRT builds FP8 layers from Q/DQ pairs, each activation's scale its range's
    largest magnitude over E4M3's largest value (TensorRT's and ModelOpt's max calibration). The graph is raised to
    opset 19 first (float8 Q/DQ). For TensorRT: ONNX Runtime's providers have no FP8 kernels and run such a graph in
    float (validation of the graph itself runs it so, on the CPU).

    ONNX Runtime's float8 quantizer takes only its distribution calibration, whose scale (the tensor's standard
    deviation over that of all E4M3 values) saturates a tensor beyond about 4.5 standard deviations: ReLU and
    convolution outputs with long tails lost most of their signal that way. The ranges are handed to it as
    distribution data whose deviation gives exactly the max-calibrated scale (:func:`_as_distribution`)."""
    from onnx import version_converter
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static

    model = onnx.load(str(model_path))
    exclude = excluded_nodes(model, cfg, [*extra_exclude, *unbounded_nodes(model, ranges, warn=False)])
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), FP8_OPSET)
    if opset < FP8_OPSET:
        model = version_converter.convert_version(model, FP8_OPSET)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    _quiet_ort_preprocess_warning()
    try:
        with (
            ranges_file(_as_distribution(ranges)) as cache_path,
            unbounded_quietly(ranges),
            root_handlers_kept(),
            ort_said_to_debug("quantize_static"),
        ):
            quantize_static(
                model,
                str(out_path),
                None,
                quant_format=QuantFormat.QDQ,
                op_types_to_quantize=quantizable_op_types(cfg),
                per_channel=False,
                activation_type=QuantType.QFLOAT8E4M3FN,
                weight_type=QuantType.QFLOAT8E4M3FN,
                nodes_to_exclude=exclude,
                calibrate_method=_ort_method("distribution"),
                extra_options={
                    **UNTYPED_AS_FLOAT,
                    "ActivationSymmetric": True,
                    "WeightSymmetric": True,
                    "QuantizeBias": False,
                },
                calibration_cache_path=str(cache_path),
            )
    except Exception as exc:  # ORT's quantizer raises plain exceptions on graphs it cannot quantize
        raise quantizer_failed("quantize_static (FP8)", exc, model, "fp8") from None
    q = _float_outputs_at(out_path, model)
    counts = {op: sum(n.op_type == op for n in q.graph.node) for op in ("QuantizeLinear", "DequantizeLinear")}
    log.info("fp8: %d Q / %d DQ nodes, %d nodes kept in float", *counts.values(), len(exclude))
    return {"excluded": exclude, "qdq_nodes": counts, "opset": FP8_OPSET, "method": ranges.method}


def _as_distribution(ranges: Ranges) -> Ranges:
    """``ranges`` as ORT's distribution calibration data whose scale for float8 (``std / std(E4M3 values)``,
    ``compute_scale_zp_float8``) is the max-calibrated one, ``amax / 448``; uncached (a scratch file per use). The
    deviation divides before it multiplies, so an amax near float32's largest (a mask filled with ``-FLT_MAX``) keeps
    a finite one; an amax that is not finite stays so, with no numpy warning (its nodes stay in float:
    :func:`unbounded_nodes`)."""
    import numpy as np
    from ml_dtypes import float8_e4m3fn
    from onnxruntime.quantization.calibrate import CalibrationMethod, TensorData, TensorsData

    values = np.arange(256, dtype=np.uint8).view(float8_e4m3fn).astype(np.float32)
    std_f8 = float(np.std(values[np.isfinite(values)]))
    data = {}
    for name, td in ranges.tensors.items():
        lo, hi = (np.asarray(v, dtype=np.float32) for v in td.range_value)
        amax = np.maximum(np.abs(lo), np.abs(hi)).astype(np.float32)
        data[name] = TensorData(
            avg=np.zeros_like(amax), std=(amax / E4M3_MAX * std_f8).astype(np.float32), lowest=-amax, highest=amax
        )
    return Ranges(TensorsData(CalibrationMethod.Distribution, data), None, ranges.key + "-fp8", False, "minmax")


E4M3_MAX = 448.0
BIAS_OPS = ("Conv", "ConvTranspose", "Gemm")  # ops whose third input is a bias ORT's quantizer quantizes


def shared_biases(model: onnx.ModelProto) -> dict[str, int]:
    """Bias initializers that more than one Conv/Gemm reads: name -> number of readers."""
    inits = {i.name for i in model.graph.initializer}
    uses: dict[str, int] = {}
    for node in model.graph.node:
        if node.op_type in BIAS_OPS and len(node.input) > 2 and node.input[2] in inits:
            uses[node.input[2]] = uses.get(node.input[2], 0) + 1
    return {name: n for name, n in uses.items() if n > 1}


def unshare_biases(model: onnx.ModelProto) -> None:
    """Give every reader of a shared bias its own copy, under a name no value has.

    ORT's QDQ quantizer copies a shared bias itself (each reader's bias scale differs) and names the copy by
    appending a number to the name, checking only the initializers' names: the dynamo exporter's ``val_11`` became
    ``val_114``, the name of a shape tensor elsewhere in a transformers Wav2Vec2, and ONNX Runtime then refused the
    INT8 graph ("Type 'tensor(int64)' of input parameter (val_114) of operator (Conv) ... is invalid")."""
    shared = shared_biases(model)
    taken = value_names(model.graph)
    tensors = {i.name: i for i in model.graph.initializer if i.name in shared}
    for node in model.graph.node:
        if node.op_type in BIAS_OPS and len(node.input) > 2 and node.input[2] in shared:
            name = node.input[2]
            fresh = next(
                f"{name}_{node.name or 'bias'}_{k}"
                for k in range(len(taken) + 1)
                if f"{name}_{node.name or 'bias'}_{k}" not in taken
            )
            taken.add(fresh)
            copy = onnx.TensorProto()
            copy.CopyFrom(tensors[name])
            copy.name = fresh
            model.graph.initializer.append(copy)
            node.input[2] = fresh
    still_read = {n for node in model.graph.node for n in node.input} | {i.name for i in model.graph.input}
    for name in shared:  # the original goes where nothing reads it now
        if name not in still_read:
            model.graph.initializer.remove(tensors[name])


def ort_cpu_scheme(model: onnx.ModelProto, cfg: CalibrationConfig, flops: Mapping[str, int] | None = None) -> str:
    """``cfg.ort_cpu_scheme`` with ``auto`` resolved: ONNX Runtime's quantization guide recommends dynamic
    quantization for Transformer-style graphs and static for CNNs. On a Transformer, dynamic wins on CPU
    because ORT fuses each quantized MatMul with its bias into one DynamicQuantizeMatMul kernel, while the
    static graph adds Q/DQ nodes on every activation (measured in benchmarks/precision_bench.py). A recurrent
    graph (an LSTM's) is dynamic too: only dynamic quantization computes an LSTM in int8 (:data:`DYNAMIC_RECURRENT`).
    A graph with both convolutions and those layers goes by where its FLOPs are (``flops``: per op type, given by
    the caller, which counts them; :func:`_mostly_dynamic`), not by the ops it has: the patch-embedding convolution
    of a ViT, DeiT or Swin makes no CNN of it. Dynamic quantizes MatMul layers and LSTMs, so it needs MatMul among
    the quantized op types."""
    if cfg.ort_cpu_scheme != "auto":
        return cfg.ort_cpu_scheme  # the config refuses "dynamic" without MatMul among the quantized op types
    ops = {n.op_type for n in model.graph.node}
    if not ops & DYNAMIC_OPS or "MatMul" not in quantizable_op_types(cfg):
        return "static"
    return "dynamic" if not ops & STATIC_OPS or _mostly_dynamic(flops) else "static"


STATIC_OPS = {"Conv", "ConvTranspose"}  # what static quantization is for: a CNN's compute
DYNAMIC_OPS = {"MatMul", "Gemm", *DYNAMIC_RECURRENT}  # what dynamic quantization computes in int8


def _mostly_dynamic(flops: Mapping[str, int] | None) -> bool:
    """Whether more of the graph's FLOPs per sample (``flops``: by op type, the precision audit's count, None where
    the graph could not be sized: then judged by its ops, a convolution making it static) are in MatMul/Gemm layers
    and LSTMs than in convolutions."""
    if flops is None:
        return False
    return sum(flops.get(op, 0) for op in DYNAMIC_OPS) > sum(flops.get(op, 0) for op in STATIC_OPS)


def quantize_int8_dynamic(
    model_path: Path, out_path: Path, cfg: CalibrationConfig, extra_exclude: Iterable[str] = ()
) -> dict[str, Any]:
    """ONNX Runtime CPU graph with int8 weights and run-time (per batch) uint8 activation scales: needs no
    calibration ranges. Float-kept nodes as in the Q/DQ graph; unlike it, MatMuls of two activations (q k^T,
    attention x v) stay float too (ORT's MatMulConstBOnly default for dynamic quantization), LSTMs are quantized
    (ORT's DynamicQuantizeLSTM), and embedding tables (Gather) where ``calibration.op_types`` lists Gather
    (:func:`dynamic_op_types`)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    model = onnx.load(str(model_path), load_external_data=False)
    ops = quantizable_op_types(cfg)
    kept = kept_by(model, cfg, extra_exclude)
    exclude = set(kept)
    seven_bits = resolve_reduce_range(cfg.reduce_range)
    # quantize_dynamic first rewrites every Gemm into "<name>_MatMul" + "<name>_Add" and quantizes that MatMul,
    # so a Gemm kept in float (by name or because Gemm is not a quantized op type) is excluded under that name.
    gemms = [n.name for n in model.graph.node if n.op_type == "Gemm"]
    exclude |= {f"{g}_MatMul" for g in gemms if g in exclude or "Gemm" not in ops}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    _quiet_ort_preprocess_warning()
    try:
        # ORT's quantizers' module-level logging.warning() would add a root handler
        with root_handlers_kept(), ort_said_to_debug("quantize_dynamic"):
            quantize_dynamic(
                str(model_path),
                str(out_path),
                op_types_to_quantize=dynamic_op_types(cfg),  # never empty: ORT reads an empty list as "every op it can"
                per_channel=cfg.per_channel,
                weight_type=QuantType.QInt8,  # u8 activations x s8 weights: the VNNI / AVX2 kernel pairing
                reduce_range=seven_bits,
                nodes_to_exclude=sorted(exclude),
                use_external_data_format=model_path.with_name(model_path.name + ".data").is_file(),
                extra_options=UNTYPED_AS_FLOAT,
            )
    except Exception as exc:  # ORT's quantizer raises plain exceptions on graphs it cannot quantize
        raise quantizer_failed("quantize_dynamic", exc, model, "int8") from None
    q = onnx.load(str(out_path), load_external_data=False)
    if sort_with_subgraphs(q):
        onnx.save_model(q, str(out_path))
    integer = sum(n.op_type == "MatMulInteger" for n in q.graph.node)
    lstms = sum(n.op_type == "DynamicQuantizeLSTM" for n in q.graph.node)
    tables = len(int8_tables(q))
    if integer + lstms == 0 and model_path not in _SAID_FLOAT:
        _SAID_FLOAT.add(model_path)  # once per graph: the precision fallback quantizes it again each round
        log.warning(
            "int8 dynamic: no MatMul or LSTM was quantized: %s; the ONNX Runtime CPU INT8 graph computes in float%s",
            _why_float(model, kept, ops),
            f" ({tables} embedding tables stored in int8)" if tables else "",
        )
    log.info(
        "int8 dynamic: %d integer MatMuls, %d integer LSTMs, %d int8 embedding tables, %d nodes kept in float",
        integer,
        lstms,
        tables,
        len(exclude),
    )
    return {
        "integer_matmuls": integer,
        "integer_lstms": lstms,
        "int8_tables": tables,
        "excluded": sorted(exclude),
        "reduce_range": seven_bits,
    }


def _without_nan(ranges: Ranges) -> Ranges:
    """``ranges`` less its tensors with a NaN bound: their nodes stay in float (:func:`unbounded_nodes`), and ORT's
    quantizer, which computes a scale for every tensor it is given, fails on a NaN one ("scale issue")."""
    nan = ranges.nan_bounded()
    return ranges.without(nan) if nan else ranges


# ORT's compute_scale_zp asserts a scale >= 0: a NaN range (or a negative width) fails it with this message alone
SCALE_ISSUE = "scale issue"


def quantizer_failed(
    call: str, exc: Exception, model: onnx.ModelProto, variant: str, ranges: Ranges | None = None
) -> ModelError:
    """The error for ORT's quantizer failing on ``model`` (``call``: the function that raised ``exc``): its message
    in whole sentences, and each tensor or node it quotes as the node to keep in float (a tensor by the node that
    writes it), so the fix names what calibration.exclude_nodes takes. Its bare "scale issue" is said in words,
    with the tensors of ``ranges`` whose range is NaN."""
    if isinstance(exc, AssertionError) and str(exc).strip() == SCALE_ISSUE:
        return _scale_issue(call, model, variant, ranges)
    nodes = quoted_nodes(str(exc), model)
    keep = (
        f"keep {', '.join(f'{n} ({why})' for n, why in nodes.items())} in float: "
        f"--set 'calibration.exclude_nodes=[{', '.join(nodes)}]'"
        if nodes
        else "keep the node it names in float (calibration.exclude_nodes)"
    )
    return ModelError(
        f"onnxruntime.quantization.{call} failed ({type(exc).__name__}: {whole_sentences(str(exc))})",
        hint=f"{keep}, or drop {variant} from precision.variants (the other variants are still built)",
    )


def _scale_issue(call: str, model: onnx.ModelProto, variant: str, ranges: Ranges | None) -> ModelError:
    """ORT's "scale issue": a calibrated range gave no INT8 scale (NaN, or a negative width); the tensors whose
    range is NaN and the nodes writing them, where ``ranges`` tell."""
    nan = ranges.nan_bounded() if ranges is not None else []
    writers = {out: n.name for n in _nodes(model.graph) if n.name for out in n.output}
    nodes = list(dict.fromkeys(writers[t] for t in nan if t in writers))
    which = f": {', '.join(repr(t) for t in nan[:4])}{' and more' if len(nan) > 4 else ''}" if nan else ""
    keep = f"--set 'calibration.exclude_nodes=[{', '.join(nodes)}]'" if nodes else "calibration.exclude_nodes"
    cause = (
        f": a tensor NaN on the calibration data{which} (a Sqrt or Log of negative inputs, 0/0)"
        if nan
        else " (a tensor NaN on the calibration data, or a range whose end lies below its start)"
    )
    return ModelError(
        f"onnxruntime.quantization.{call} failed (AssertionError: {SCALE_ISSUE}): a calibrated range gave no "
        f"{variant.upper()} scale, its width NaN or negative{cause}",
        hint=f"calibrate on inputs the model is defined at (data.name, --calibration), keep the nodes writing "
        f"NaN in float ({keep}), or drop {variant} from precision.variants (the other variants are still built)",
    )


def quoted_nodes(text: str, model: onnx.ModelProto) -> dict[str, str]:
    """Node name -> how ``text`` names it, for each name quoted in ``text`` that is a node of ``model`` or a tensor
    one of its nodes writes (ORT's quantizer names tensors, calibration.exclude_nodes takes nodes)."""
    named = {n.name for n in _nodes(model.graph) if n.name}
    writers = {out: n.name for n in _nodes(model.graph) if n.name for out in n.output}
    found: dict[str, str] = {}
    for name in re.findall(r"'([^'\s]+)'", text):
        if name in named:
            found.setdefault(name, "named in the error")
        elif name in writers:
            found.setdefault(writers[name], f"writes tensor '{name}'")
    return found


def whole_sentences(text: str, limit: int = 300) -> str:
    """``text`` on one line, cut after its last whole sentence within ``limit`` characters (else at a word, with
    "..."): a library's long error keeps the sentences that name the problem and ends on no half word."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    kept = ""
    for sentence in re.split(r"(?<=[.!?])\s+", text):
        if len(kept) + len(sentence) + 1 > limit:
            break
        kept = f"{kept} {sentence}".strip()
    return kept or text[:limit].rsplit(" ", 1)[0] + " ..."


def int8_tables(model: onnx.ModelProto) -> list[str]:
    """The Gather nodes of ``model`` (an If, Loop or Scan body's too: an exported ``nn.EmbeddingBag`` looks its rows
    up in a Loop) that read a stored 8-bit table: the embedding tables dynamic quantization stored in int8."""
    eight_bit = {onnx.TensorProto.INT8, onnx.TensorProto.UINT8}
    stored = {t.name for t in model.graph.initializer if t.data_type in eight_bit}
    return [n.name for n in _nodes(model.graph) if n.op_type == "Gather" and n.input and n.input[0] in stored]


def _nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    """Every node of ``graph`` and of the bodies its nodes hold, at any depth."""
    for node in graph.node:
        yield node
        for a in node.attribute:
            yield from (n for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else a.graphs) for n in _nodes(g))


def sort_with_subgraphs(model: onnx.ModelProto) -> bool:
    """Order the nodes of ``model`` topologically, counting the outer tensors an If, Loop or Scan body reads, where it
    has such a node; True where it did. ORT's quantizer re-sorts the graphs it writes by the nodes' listed inputs
    alone, so a body reading an outer tensor (an exported ``nn.EmbeddingBag``'s Loop over bags) may come before the
    node writing it, which the ONNX checker refuses. onnx-graphsurgeon's sort counts them; the model's own fields
    (opsets, metadata, functions) are kept as they are, only its graph is replaced."""
    subgraph = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
    if not any(a.type in subgraph for n in model.graph.node for a in n.attribute):
        return False
    model.graph.CopyFrom(gs.export_onnx(gs.import_onnx(model).toposort()).graph)
    return True


_SAID_FLOAT: set[Path] = set()


def _why_float(model: onnx.ModelProto, kept: dict[str, str], ops: list[str]) -> str:
    """Why dynamic quantization left every MatMul and LSTM float, with what to do: it quantizes only a MatMul or
    Gemm whose second input is a stored weight, and LSTMs, none of a graph whose compute is elsewhere (a GRU, a
    convolution, an Einsum: named too beside weighted layers kept in float); ``kept`` keeps some in float, each by
    the setting named (a Gemm also where Gemm is not among ``ops``, the quantized op types); an exported graph that
    reaches its weights through Transpose or Mul nodes has none until constant folding (``kiln optimize``, which the
    pipeline runs before this stage) makes them stored weights."""
    stored = {t.name for t in model.graph.initializer}
    layers = [n for n in model.graph.node if n.op_type in ("MatMul", "Gemm")]
    if not layers:
        compute = sorted({n.op_type for n in model.graph.node if n.op_type in FLOAT_COMPUTE})
        where = (
            f": its compute is in {', '.join(compute)}, which dynamic quantization leaves in float" if compute else ""
        )
        if {n.op_type for n in model.graph.node} & set(DYNAMIC_RECURRENT):
            where += f"{';' if where else ':'} its LSTMs are kept in float (calibration.exclude_*, or the fallback)"
        return f"it has no MatMul or Gemm{where} ({_static_advice(model)})"
    weighted = [n for n in layers if len(n.input) > 1 and n.input[1] in stored]
    if not weighted:
        producer = {o: n for n in model.graph.node for o in n.output}
        folded = [n for n in layers if len(n.input) > 1 and folds_to_weight(n.input[1], producer, stored)]
        if folded:
            return (
                f"none of its {len(layers)} MatMuls takes a stored weight ({len(folded)} reach theirs through other "
                "nodes): `kiln optimize` the graph first, which folds them"
            )
        return (
            f"its {len(layers)} MatMul/Gemm layers each multiply two activations (attention's scores and values), "
            "which dynamic quantization leaves in float"
        )
    by_type = [n.name for n in weighted if n.op_type == "Gemm" and "Gemm" not in ops]
    said = [f"{len(by_type)} Gemm, and Gemm is not in calibration.op_types (add it there)"] if by_type else []
    by_setting: dict[str, list[str]] = {}
    for n in weighted:
        if n.name not in by_type:
            by_setting.setdefault(kept.get(n.name, "ONNX Runtime's quantizer"), []).append(n.name)
    for setting, names in by_setting.items():
        listed = ", ".join(sorted(names)[:4]) + (", ..." if len(names) > 4 else "")
        said.append(f"{len(names)} by {setting} ({listed})")
    said_all = f"its {len(weighted)} MatMul/Gemm layers with stored weights are all kept in float: {'; '.join(said)}"
    return said_all + _float_compute(model)


def _float_compute(model: onnx.ModelProto) -> str:
    """Where a graph holds compute that dynamic quantization leaves in float (:data:`FLOAT_COMPUTE` but Conv, which
    :func:`_static_advice` covers: an Einsum, a GRU), that it does, with how many nodes: beside a few kept layers,
    the reason the graph stays float."""
    counts = Counter(n.op_type for n in model.graph.node if n.op_type in FLOAT_COMPUTE and n.op_type != "Conv")
    if not counts:
        return ""
    nodes = ", ".join(f"{c} {op}" for op, c in sorted(counts.items()))
    einsum = " (write an Einsum as torch.matmul or nn.Linear for an int8 MatMul)" if "Einsum" in counts else ""
    return f"; the rest of its compute is in {nodes} nodes, which dynamic quantization leaves in float{einsum}"


def _static_advice(model: onnx.ModelProto) -> str:
    """What the static scheme would change for a graph dynamic quantization left in float: its Conv layers computed
    in int8 (:data:`ORT_CPU_STATIC_INTEGER`), not its ConvTranspose layers, which ONNX Runtime's CPU provider runs in
    float under either scheme. Static is advised only where it computes something in int8, and beside ConvTranspose
    layers only as far as the Conv layers hold the compute (their FLOPs are not counted here)."""
    ops = Counter(n.op_type for n in model.graph.node)
    convs, transposed = ops["Conv"], ops["ConvTranspose"]
    if not transposed:
        if convs:
            return "calibration.ort_cpu_scheme: static computes its Conv layers in int8 (QLinearConv)"
        return "drop int8 from precision.variants for this model"
    no_kernel = "ONNX Runtime's CPU provider has no integer kernel for ConvTranspose under either scheme"
    if convs:  # static is worth it only where the Conv layers, not the ConvTranspose ones, hold the compute
        return (
            f"static would compute its {convs} Conv in int8 (QLinearConv), not its {transposed} ConvTranspose "
            f"({no_kernel}): calibration.ort_cpu_scheme: static only where the Conv layers hold most of its compute"
        )
    *first, last = ORT_CPU_STATIC_INTEGER
    static = f"{', '.join(first)} and {last}"
    return (
        f"{no_kernel}; static computes only {static} in int8: use nn.Upsample + Conv2d for integer convolutions on the "
        "CPU, build int8 on a GPU backend (TensorRT), or drop int8 from precision.variants for this model"
    )


# The op types ONNX Runtime's CPU provider computes in integers from a static (Q/DQ) graph, each with the kernel it
# fuses its Q/DQ pairs into; it has none for a ConvTranspose, which it runs in float on the dequantized values.
# compute ops dynamic quantization (op_types_to_quantize: MatMul, LSTM) leaves as they are: ONNX Runtime has no
# dynamic int8 kernel for a GRU or an RNN
FLOAT_COMPUTE = {"Conv", "ConvTranspose", "GRU", "RNN", "Einsum", "DFT", "STFT", "Attention"}


def folds_to_weight(name: str, producer: dict[str, onnx.NodeProto], stored: set[str]) -> bool:
    """Whether ``name`` is computed from ``stored`` weights and constants alone (a Transpose of a weight; ``producer``:
    value -> the node writing it): constant folding makes it a stored weight."""
    constant = stored
    seen: set[str] = set()
    stack = [name]
    while stack:
        value = stack.pop()
        if value in constant or value in seen or not value:
            continue
        seen.add(value)
        node = producer.get(value)
        if node is None:  # a graph input: an activation
            return False
        stack.extend(node.input)
    return bool(name)


def _quiet_ort_preprocess_warning() -> None:
    """quantize_static warns on the root logger that the model was not pre-processed; Kiln's optimize stage
    already ran shape inference and graph cleanup, and ORT's pre-processing would add ORT-only fused ops that
    TensorRT cannot parse, so the advice does not apply."""
    root = logging.getLogger()
    if not any(getattr(f, "_kiln", False) for f in root.filters):
        f = logging.Filter()
        f.filter = lambda rec: "pre-process" not in rec.getMessage()  # type: ignore[method-assign]
        f._kiln = True  # type: ignore[attr-defined]
        root.addFilter(f)
