"""ONNX Runtime engines: the model optimized offline by ONNX Runtime, saved beside its session settings.

CPU: extended-level fusions done offline (portable across x86 hosts; the host-specific NCHWc layout pass runs
at load), thread counts and execution mode stored for the runner. CUDA: cuDNN exhaustive convolution search,
NHWC where it helps, IO binding and CUDA graphs (applied by the runner), and ORT's transformer fusions. Those
fusions emit ORT-only contrib ops, so they are applied here, to ORT engines only, never to TensorRT's graphs.
"""

from __future__ import annotations

import io
import logging
import re
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager, redirect_stdout
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from kiln.core.compare import within_tolerance
from kiln.core.errors import BuildError
from kiln.core.inputs import AxisSizes, largest_sizes, random_inputs
from kiln.core.onnx_io import (
    QDQ,
    io_specs,
    light_model,
    load_onnx,
    model_carries_precision,
    ort_session,
    session_options,
)
from kiln.core.records import TensorSpec
from kiln.core.shapes import axis_names, shapes_flag
from kiln.core.text import first_line, ort_reason
from kiln.stages.engines.dynamic_axes import check_engine_graph, lost_in_model
from kiln.stages.engines.onnxruntime.autotune import autotune, relevant_knobs
from kiln.stages.engines.onnxruntime.config import OnnxRuntimeConfig
from kiln.stages.engines.onnxruntime.loading import settle_load
from kiln.stages.precision.audit import INTEGER
from kiln.stages.precision.fp16 import cast_captured_to_fp32, constants_as_tensors, name_nodes
from kiln.stages.precision.fp16_select import sequence_values, unconvertible_ops

log = logging.getLogger("kiln.build")


class _AsDebug(logging.Handler):
    """Passes another library's records on to Kiln's build log at debug level."""

    def emit(self, record: logging.LogRecord) -> None:
        log.debug("%s: %s", record.name, record.getMessage())


@contextmanager
def _logged_as_debug(name: str) -> Iterator[None]:
    """The logger ``name`` (and those under it) logged to Kiln's debug log for the block: ORT's transformer optimizer
    warns of a model producer it did not expect ("Model producer not matched") on every graph Kiln fuses, which
    the Python API, with no logging set up, would print to stderr through Python's last-resort handler."""
    logger = logging.getLogger(name)
    saved = logger.handlers, logger.propagate
    logger.handlers, logger.propagate = [_AsDebug()], False
    try:
        yield
    finally:
        logger.handlers, logger.propagate = saved


PROVIDERS = {"cpu": ["CPUExecutionProvider"], "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"]}
ATTENTION_OPS = {"Softmax", "MatMul"}


def build_ort_engine(
    onnx_path: Path,
    out: Path,
    device: str,
    precision: str,
    cfg: OnnxRuntimeConfig,
    keep_fp32: list[str] | None = None,
    max_batch: int = 32,
    name: str = "",
    axis_sizes: dict[str, list[int]] | None = None,
    check_graph: Callable[[Path], None] | None = None,
) -> dict[str, Any]:
    """Write ``out/engine.onnx`` and, where it can, autotune its session settings on this machine (see
    ``ort_autotune``); returns the backend's part of the metadata. ``max_batch``: the largest batch tuned;
    ``check_graph``: called with the written file before any session opens it (``BuildRequest.check_graph``)."""
    import onnxruntime as ort

    name = name or out.name  # ``out`` may be a staging folder: callers name the engine
    model = load_onnx(onnx_path)
    notes: dict[str, Any] = {}
    # Dynamic axes besides batch at their largest size in the data (fusion check and autotuning: the worst case)
    dynamic = largest_sizes(io_specs(model)[0], axis_sizes or {})
    fused, notes["transformer_fusion"] = maybe_fuse(model, device, cfg, dynamic)
    cuda_here = "CUDAExecutionProvider" in ort.get_available_providers()
    conv, applied = has_conv(model), notes["transformer_fusion"]["applied"]
    skip = autotune_skip_reason(device, cfg, cuda_here)
    knobs = (
        {}
        if skip
        else relevant_knobs(cfg.autotune.cuda_knobs if device == "cuda" else cfg.autotune.cpu_knobs, conv, applied)
    )
    to_fp16 = precision == "fp16" and not model_carries_precision(model)  # else the graph holds its precision
    keep_fused = None
    if keep_fp32 and to_fp16:
        keep_fused, notes["fp16_kept_fp32"] = keep_list_after_fusion(model, fused, keep_fp32, name, device)
    conversion, offline = _write_engine(
        fused, out / "engine.onnx", device, precision, cfg, cuda_here, to_fp16, keep_fused
    )
    if conversion:
        notes["fp16_conversion"] = conversion
    files = {"model": "engine.onnx"}
    if check_graph is not None:
        check_graph(out / files["model"])
    if offline != _offline_level(device, cuda_here):
        notes["offline_fallback"] = (
            "the CUDA EP's offline optimization fixed dynamic axes; the engine is the "
            "converted graph, optimized by the CUDA EP at load"
        )
    session = _session_record(device, cfg, conv, precision, offline)
    no_ep = device == "cuda" and not cuda_here
    unoptimized = lambda: _convert(fused, to_fp16, keep_fused)[0]  # noqa: E731 - made again only on a fallback
    check = _settle_load(out / files["model"], session, unoptimized, name, notes, no_ep)
    # A CPU autotune takes the check's session for its first candidate (CUDA candidates open fixed-shape copies)
    opened = [check] if device == "cpu" and check is not None else []
    del check
    if applied and False in knobs.get("transformer_fusion", []):  # the unfused graph is a candidate too
        files["model_unfused"] = "engine-unfused.onnx"
        dst = out / files["model_unfused"]
        _, alone = _write_engine(model, dst, device, precision, cfg, cuda_here, to_fp16, keep_fp32)
        unfused = lambda: _convert(model, to_fp16, keep_fp32)[0]  # noqa: E731
        # at the main file's load level: the engine records one for both
        _settle_load(dst, {**session, "offline_optimization": alone}, unfused, name, notes, no_ep, lower=False)
    built = {
        "files": files,
        "session": session,
        "cuda_graph": device == "cuda" and cfg.cuda.cuda_graph,
        "versions": {"onnxruntime": ort.__version__},
        "flavour": "onnxruntime",
        "builder_settings": notes,
    }
    for file in files.values():  # before autotuning: never time an engine that lost its source's dynamic axes
        check_engine_graph(onnx_path, out / file, file)
    if skip:
        log.info("not autotuning %s: %s", name, skip)
        built["autotune"] = {"skipped": skip}
        return built
    inputs, _ = io_specs(model)
    batches = sorted(set(cfg.autotune.batch_sizes or [1, max_batch]))
    base = {k: v for k, v in configured_knobs(cfg, conv, precision, applied).items() if k in knobs}
    built["autotune"] = autotune(
        out,
        {**built, "name": name, "device": device, "inputs": inputs, "dynamic": dynamic},
        onnx_path,
        cfg.autotune,
        base,
        knobs,
        batches,
        per_batch=device == "cuda",
        opened=opened,
    )
    _drop_unused_unfused(out, built)
    return built


def keep_list_after_fusion(
    source: onnx.ModelProto, fused: onnx.ModelProto, keep: list[str], name: str = "", device: str = "cuda"
) -> tuple[list[str], dict[str, Any]]:
    """The precision stage's FP32 nodes under the names they have after ORT's transformer fusion.

    Fusion replaces nodes (LayerNormalization + Add -> SkipLayerNormalization...) and their names with them, so
    a kept name may be gone: then the fused node that now writes one of the kept node's outputs is kept FP32
    instead. Kept nodes that vanished inside a fusion without a trace are recorded; those absorbed by a fused op
    that computes in FP32 anyway (:data:`FP32_FUSED_OPS`: T5's RMSNorm Pow and Sqrt) lose nothing and are only
    counted, the rest are said for engine ``name``: a warning where ``device`` computes FP16, at info on the CPU,
    which computes the whole engine in FP32 (the build's audit then skips it)."""
    names = {n.name for n in fused.graph.node}
    writer = {o: n.name for n in fused.graph.node for o in n.output}
    outputs = {n.name: list(n.output) for n in source.graph.node}
    mapped: dict[str, str] = {}
    lost: list[str] = []
    for node in keep:
        if node in names:
            mapped[node] = node
            continue
        heir = next((writer[o] for o in outputs.get(node, []) if o in writer), None)
        if heir is None:
            lost.append(node)
        else:
            mapped[node] = heir
    absorbed_by = absorbing_ops(source, fused)
    in_fp32 = [n for n in lost if absorbed_by(n) in FP32_FUSED_OPS]
    lost = [n for n in lost if n not in in_fp32]
    if lost:
        log.log(
            logging.INFO if device == "cpu" else logging.WARNING,
            "%s: %d nodes the precision stage kept FP32 were fused away by ONNX Runtime and run in the fused "
            "kernels' precision: %s",
            name or "onnxruntime engine",
            len(lost),
            ", ".join(lost[:10]) + (f", ... ({len(lost) - 10} more)" if len(lost) > 10 else ""),
        )
    renamed = {k: v for k, v in mapped.items() if k != v}
    record = {"requested": len(keep), "renamed": renamed, "lost": lost, "in_fp32_kernels": len(in_fp32)}
    return sorted(set(mapped.values())), record


# ORT's fused normalizations, which compute in FP32 whatever their inputs' type: a kept node they absorb stays FP32
FP32_FUSED_OPS = {
    "LayerNormalization",
    "SimplifiedLayerNormalization",
    "SkipLayerNormalization",
    "SkipSimplifiedLayerNormalization",
}


def absorbing_ops(source: onnx.ModelProto, fused: onnx.ModelProto) -> Callable[[str], str | None]:
    """A lookup of the op type of the fused node that absorbed a node of ``source``: the writer, in ``fused``, of
    the first tensor downstream of that node that ``fused`` still has (None where none is found). The graphs'
    maps are built once, for every node looked up."""
    writer = {o: n.op_type for n in fused.graph.node for o in n.output}
    by_name = {n.name: n for n in source.graph.node}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in source.graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)

    def absorbing(node: str) -> str | None:
        start = by_name.get(node)
        queue, seen = deque(start.output if start is not None else []), set()
        while queue:
            tensor = queue.popleft()
            if tensor in writer:
                return writer[tensor]
            if tensor in seen:
                continue
            seen.add(tensor)
            queue.extend(o for c in consumers.get(tensor, []) for o in c.output)
        return None

    return absorbing


def autotune_skip_reason(device: str, cfg: OnnxRuntimeConfig, cuda_here: bool) -> str | None:
    """None when this build autotunes; else why not (logged and recorded in the sidecar)."""
    if device == "cuda" and not cfg.autotune.cuda:
        return "build.onnxruntime.autotune.cuda is false"
    if device == "cuda" and not cuda_here:
        return (
            "no CUDAExecutionProvider on the build machine (needs onnxruntime-gpu and a GPU): the configured"
            " settings are used as built"
        )
    if device == "cpu" and not cfg.autotune.cpu:
        return "build.onnxruntime.autotune.cpu is false"
    return None


def configured_knobs(cfg: OnnxRuntimeConfig, conv: bool, precision: str, fused: bool) -> dict[str, Any]:
    """The knob values the configuration alone gives: autotuning's starting point (and its baseline)."""
    c = cfg.cuda
    return {
        "prefer_nhwc": _nhwc(cfg, conv, precision),
        "conv_algo_search": c.conv_algo_search,
        "conv_max_workspace": True,
        "cuda_graph": c.cuda_graph,
        "transformer_fusion": fused,
        "intra_op_threads": cfg.intra_op_threads,
        "inter_op_threads": cfg.inter_op_threads,
        "execution_mode": cfg.execution_mode,
    }


def _drop_unused_unfused(out: Path, built: dict[str, Any]) -> None:
    """The unfused graph stays in the engine only if some batch size chose it."""
    record = built["autotune"]
    choices = list((record.get("choice_by_batch") or {}).values()) + [record["choice"]]
    if "model_unfused" in built["files"] and all(c["knobs"].get("transformer_fusion", True) for c in choices):
        (out / built["files"].pop("model_unfused")).unlink()


def _offline_level(device: str, cuda_here: bool) -> str:
    # Fusions are assigned per execution provider, so fuse offline only for the EP the engine will run on.
    return "extended" if device == "cpu" or cuda_here else "basic"


def _session_record(device: str, cfg: OnnxRuntimeConfig, conv: bool, precision: str, offline: str) -> dict[str, Any]:
    """The session the runner opens the engine with, as recorded (``backend_info.session``)."""
    return {
        "providers": provider_list(device, cfg, conv, precision),
        "intra_op_threads": cfg.intra_op_threads,
        "inter_op_threads": cfg.inter_op_threads,
        "execution_mode": cfg.execution_mode,
        "offline_optimization": offline,
        "load_optimization": "all",
    }


def _settle_load(
    path: Path,
    session: dict[str, Any],
    unoptimized: Callable[[], onnx.ModelProto],
    name: str,
    notes: dict[str, Any],
    no_ep: bool,
    lower: bool = True,
) -> Any:
    """Check that the engine file at ``path`` opens with the ``session`` recorded for it, as its runner opens it,
    falling back as :func:`loading.settle_load` says: ``session`` (the main file's: ``lower``) takes the levels
    that open, a fallback goes into ``notes``. Returns the check's session (a CPU autotune reuses it).
    ``no_ep``: a CUDA engine built without the CUDA EP, which this machine cannot open as it will run."""
    if no_ep:
        notes["load_check"] = "not checked: no CUDAExecutionProvider on the build machine"
        return None
    loaded = settle_load(path, session, unoptimized, name, lower)
    if loaded.fallback:
        notes.setdefault("load_fallback", []).append(loaded.fallback)
    if lower:
        session |= {"offline_optimization": loaded.offline, "load_optimization": loaded.load}
    return loaded.session


def _write_engine(
    model: onnx.ModelProto,
    dst: Path,
    device: str,
    precision: str,
    cfg: OnnxRuntimeConfig,
    cuda_here: bool,
    to_fp16: bool,
    keep_fp32: list[str] | None,
) -> tuple[str | None, str]:
    """FP16 conversion (``to_fp16``: asked for, and the graph is FP32), then ORT's offline optimization saved to
    ``dst``. Returns the conversion note and the offline level used.

    An engine must take every shape its graph takes, and ORT's save through the CUDA EP can fix a dynamic axis.
    If it did, the engine is the graph as
    converted, not optimized offline: the runner's session optimizes it at load ("all"), with the same result at
    run time and a slower load. (Not a save through the CPU EP, as ORT's maintainers suggest for CUDA-EP-saved
    models in microsoft/onnxruntime#2474: for an FP16 graph the CPU EP inserts Casts to FP32 around every op it has
    no FP16 kernel for, and those would be saved into the CUDA engine.)"""

    model, note = _convert(model, to_fp16, keep_fp32)
    if device == "cuda" and not cuda_here:
        # No CUDA EP here to optimize for: a save through the CPU EP would carry its Casts to FP32 (around every
        # op it has no FP16 kernel for) into the CUDA engine. The graph as converted (loaded once, so a graph ORT
        # refuses fails here); the CUDA EP optimizes it at load.
        ort_session(model, optimization="none", error=BuildError)
        onnx.save(model, str(dst))
        return note, "none"
    src = dst.with_suffix(".source.onnx")
    onnx.save(model, str(src))
    offline = _offline_level(device, cuda_here)
    on_cuda = device == "cuda" and cuda_here
    providers = provider_list(device, cfg, has_conv(model), precision) if on_cuda else ["CPUExecutionProvider"]
    try:  # the session writes the optimized model
        ort_session(
            src,
            providers=providers,
            options=session_options(optimization=offline, optimized_path=dst),
            error=BuildError,
        )
        lost = lost_in_model(model, onnx.load(str(dst), load_external_data=False))
        if lost and on_cuda:
            log.warning(
                "%s: the CUDA EP's offline optimization fixed %s; keeping the graph unoptimized (the CUDA "
                "EP optimizes it at load)",
                dst.name,
                "; ".join(lost[:3]),
            )
            offline = "none"
            src.replace(dst)
    finally:
        src.unlink(missing_ok=True)
    return note, offline


def _convert(model: onnx.ModelProto, to_fp16: bool, keep_fp32: list[str] | None) -> tuple[onnx.ModelProto, str | None]:
    """The graph in the engine's precision (``to_fp16``: asked for, and the graph is FP32) and the conversion's
    note; ``model`` itself when there is nothing to convert."""
    if not to_fp16:
        return model, None
    from onnxruntime.transformers.float16 import (
        DEFAULT_OP_BLOCK_LIST,
        convert_float_to_float16,
    )

    # ORT's own converter: it knows the fused contrib ops and keeps their FP32 accumulations.
    src, fixed = _fp32_sequences_and_control_flow(model)
    ops = {n.op_type for n in src.graph.node}
    keep = list(keep_fp32 or [])
    converted = src
    if fixed:  # the converter works in place; ``src`` keeps the FP32 types for the casts below
        converted = onnx.ModelProto()
        converted.CopyFrom(src)
    converted = convert_float_to_float16(
        converted,
        keep_io_types=True,
        disable_shape_infer=True,  # done above: the converter must not see the sequence types again
        op_block_list=DEFAULT_OP_BLOCK_LIST + [k for k in keep if k in ops],
        node_block_list=sorted({k for k in keep if k not in ops} | fixed),
    )
    if fixed:  # Loop bodies read FP32 copies of the outer tensors they capture
        cast_captured_to_fp32(converted, src, fixed)
    return converted, "onnxruntime.transformers.float16 after fusion, io kept fp32"


def _fp32_sequences_and_control_flow(model: onnx.ModelProto) -> tuple[onnx.ModelProto, set[str]]:
    """A shape-inferred, named copy of ``model`` ready for ORT's converter, and the nodes it must keep FP32.

    Control flow and every node reading or writing a sequence stay FP32 (see ``unconvertible_ops``). The
    converter retypes every float sequence in value_info to FP16 and casts a blocked node's sequence like a
    tensor (an invalid graph, e.g. the Loop of an ``nn.EmbeddingBag`` export), so the copy's value_info lists
    no sequence: what the converter does not see it leaves FP32. Float-list Constants become tensor Constants,
    which the converter converts (see ``constants_as_tensors``)."""
    src = onnx.ModelProto()
    src.CopyFrom(model)
    constants_as_tensors(name_nodes(src).graph)
    # The converter's own inference (recorded types kept, failures skipped), on a copy light enough for > 2 GB
    inferred = onnx.shape_inference.infer_shapes(light_model(src)[0])
    fixed, sequences = set(unconvertible_ops(inferred)), sequence_values(inferred)
    del src.graph.value_info[:]
    src.graph.value_info.extend(v for v in inferred.graph.value_info if v.name not in sequences)
    return src, fixed


def provider_list(device: str, cfg: OnnxRuntimeConfig, conv: bool, precision: str) -> list[Any]:
    if device == "cpu":
        return ["CPUExecutionProvider"]
    c, nhwc = cfg.cuda, _nhwc(cfg, conv, precision)
    opts = {
        "device_id": str(c.device_id),
        "cudnn_conv_algo_search": c.conv_algo_search,
        "cudnn_conv_use_max_workspace": "1",
        "prefer_nhwc": "1" if nhwc else "0",
        "use_tf32": "1" if c.tf32 else "0",
    }
    return [("CUDAExecutionProvider", opts), "CPUExecutionProvider"]


def _nhwc(cfg: OnnxRuntimeConfig, conv: bool, precision: str) -> bool:
    p = cfg.cuda.prefer_nhwc
    return p == "on" or (p == "auto" and conv and precision != "fp32")


def has_conv(model: onnx.ModelProto) -> bool:
    return any(n.op_type == "Conv" for n in model.graph.node)


def maybe_fuse(
    model: onnx.ModelProto, device: str, cfg: OnnxRuntimeConfig, dynamic: int | AxisSizes | None = None
) -> tuple[onnx.ModelProto, dict[str, Any]]:
    """ORT transformer fusions, kept only if the fused graph computes the same outputs (checked on CPU, with
    dynamic axes besides batch at ``dynamic``: a size the model takes, e.g. the data's longest sequence)."""
    ops = {n.op_type for n in model.graph.node}
    if cfg.transformer_fusion == "off":
        return model, {"applied": False, "why": "off in config"}
    if cfg.transformer_fusion == "auto" and not ATTENTION_OPS <= ops:
        return model, {"applied": False, "why": "no attention-like ops"}
    if cfg.transformer_fusion == "auto" and graph_has_fp16(model):
        return model, {"applied": False, "why": "graph already FP16: ORT fuses best from the FP32 graph"}
    if cfg.transformer_fusion == "auto" and graph_is_int8(model):
        log.info("ORT transformer fusion not applied: %s", ALREADY_INT8)
        return model, {"applied": False, "why": ALREADY_INT8}
    from onnxruntime.transformers.optimizer import optimize_model

    # optimize_model rewrites a ModelProto in place: fuse a copy, so the parity check below compares two
    # different graphs and the caller's unfused graph (an autotune candidate) stays unfused.
    work = onnx.ModelProto()
    work.CopyFrom(model)
    _with_layernorm_biases(work)
    printed = io.StringIO()  # its shape inference print()s its failures: kept for --verbose, not on the console
    try:
        with redirect_stdout(printed), _logged_as_debug("onnxruntime.transformers"):
            fused = optimize_model(
                work,
                model_type=cfg.fusion_model_type,
                num_heads=0,
                hidden_size=0,
                opt_level=0,
                use_gpu=device == "cuda",
            )
    except Exception as exc:  # noqa: BLE001 - a fusion is an optimization: its own failure keeps the graph as it is
        why = f"{type(exc).__name__} in onnxruntime.transformers' optimizer: {first_line(str(exc)) or 'no message'}"
        log.warning("ORT transformer fusion not applied: %s; keeping the unfused graph", why)
        return model, {"applied": False, "why": f"fusion failed: {why}"}
    if printed.getvalue().strip():
        log.debug("onnxruntime.transformers.optimizer printed: %s", printed.getvalue().strip())
    stats = {k: v for k, v in fused.get_fused_operator_statistics().items() if v}
    if not stats:
        return model, {"applied": False, "why": "no pattern matched"}
    if not any(o.domain == "com.microsoft" for o in fused.model.opset_import):
        # The fused ops live in ORT's contrib domain; without its import the model is invalid to save/convert.
        fused.model.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
    _keep_inputs(model, fused.model)
    err = _parity(model, fused.model, dynamic=dynamic)
    if err is not None:
        log.warning(
            "ORT transformer fusion not applied: %s; keeping the unfused graph%s", err, _unsized(model, dynamic, err)
        )
        return model, {"applied": False, "why": f"fused graph rejected: {err}"}
    return fused.model, {"applied": True, "fused": stats}


def _with_layernorm_biases(model: onnx.ModelProto) -> None:
    """Each LayerNormalization without a bias (``nn.LayerNorm(elementwise_affine=False)`` or ``bias=False``, as the
    dynamo exporter writes it: two inputs) given a zero one of its stored scale's shape, in place: ORT's fusions
    read a third input of every LayerNormalization they fuse (a DiT's adaLN blocks), and the sum is unchanged."""
    stored = {t.name: t for t in model.graph.initializer}
    for i, node in enumerate(model.graph.node):
        scale = stored.get(node.input[1]) if node.op_type == "LayerNormalization" and len(node.input) == 2 else None
        if scale is None:
            continue
        zeros = numpy_helper.to_array(scale) * 0
        name = f"{node.name or node.output[0]}_kiln_zero_bias_{i}"
        model.graph.initializer.append(numpy_helper.from_array(zeros, name))
        node.input.append(name)


def _unsized(model: onnx.ModelProto, dynamic: int | AxisSizes | None, err: str) -> str:
    """Where the fusion check could not run the graph and nothing sized its named dynamic axes besides batch
    (``kiln build FILE`` without ``signature.shapes``: they ran at each of :data:`UNSIZED_TRIES`, which a
    convolution over long audio refuses), how to give their sizes; else nothing."""
    named = axis_names(io_specs(model)[0])
    if dynamic is not None or not named or not err.startswith(_CANNOT_RUN):
        return ""
    axes = f"dynamic ax{'es' if len(named) > 1 else 'is'} " + ", ".join(f"'{n}'" for n in named)
    tried = ", ".join(str(n) for n in UNSIZED_TRIES[:-1]) + f" and {UNSIZED_TRIES[-1]}"
    return f" ({axes} ran at {tried}: give the sizes the model takes, {shapes_flag(named)})"


def _keep_inputs(model: onnx.ModelProto, fused: onnx.ModelProto) -> None:
    """Inputs the fusion pruned (ones no node reads, such as a ``token_type_ids`` the model ignores) put back, in
    the original order: the engine takes what the unfused graph and every other engine of the run take."""
    kept = {i.name: i for i in fused.graph.input}
    if [i.name for i in model.graph.input] == list(kept):
        return
    inputs = [kept.get(i.name, i) for i in model.graph.input] + [
        i for n, i in kept.items() if n not in {j.name for j in model.graph.input}
    ]
    del fused.graph.input[:]
    fused.graph.input.extend(inputs)


def graph_has_fp16(model: onnx.ModelProto) -> bool:
    return any(i.data_type == onnx.TensorProto.FLOAT16 for i in model.graph.initializer)


# Ops of a quantized graph: Q/DQ pairs (the precision stage's INT8 graph) and ONNX Runtime's integer kernels (its
# ONNX Runtime CPU graph); QLinear* ops are matched by prefix
INT8_OPS = QDQ | INTEGER | {"DynamicQuantizeLinear"}  # a quantized graph's ops (audit's integer ops)
ALREADY_INT8 = (
    "graph already INT8 (Q/DQ or integer ops): ORT's fusions rewrite it into QOrdered* ops, which have no CPU kernel "
    "(the fusion's check runs on CPU) and run on CUDA only"
)


def graph_is_int8(model: onnx.ModelProto) -> bool:
    """Whether ``model`` is quantized (:data:`INT8_OPS`, QLinear*): ORT's transformer fusions turn such a graph into
    QOrdered* ops, which the fusion's CPU parity check cannot run, so fusing it is wasted work."""
    return any(n.op_type in INT8_OPS or n.op_type.startswith("QLinear") for n in model.graph.node)


# The fusion check's batch, and the sizes tried in turn for the dynamic axes nothing sizes, until the unfused graph
# runs (a convolution over an image or audio refuses the smallest)
FUSION_CHECK_BATCH = 2
UNSIZED_TRIES = (FUSION_CHECK_BATCH, 16, 64, 256)
UNSIZED_BYTES = 64 << 20  # the largest random feed a try makes; past it, the sizes left are not tried
_CANNOT_RUN = "cannot run random inputs"
# What ONNX Runtime names where no kernel runs a node: "implementation for QOrderedMatMul(1)" (op and its version)
_NO_KERNEL = re.compile(r"implementation for [\w.]+(?:\(\d+\))?")
_ORT_CODE = re.compile(r"\[ONNXRuntimeError\] : \d+ : \w+ : ")


def _feed_bytes(specs: list[TensorSpec], batch: int, size: int) -> int:
    """The bytes of :func:`random_inputs`' feed with ``batch`` rows and every other dynamic axis at ``size``,
    counted before any array is made."""
    total = 0
    for spec in specs:
        dims = [d if isinstance(d, int) else batch if i == 0 else size for i, d in enumerate(spec.shape)]
        total += int(np.prod(dims, dtype=np.int64)) * np.dtype(spec.dtype).itemsize
    return total


def load_reason(exc: BaseException, limit: int = 120) -> str:
    """Why ONNX Runtime cannot load a graph, in ``limit`` characters, without the status code it quotes
    mid-message; where it names an op it has no kernel for and is too long, cut right after the op (and its
    version), whatever the limit: the op is what the reader needs, the node's name after it is not."""
    text = _ORT_CODE.sub("", ort_reason(exc, 1000))
    missing = _NO_KERNEL.search(text)
    if len(text) <= limit:
        return text
    return text[: missing.end()] if missing else text[:limit]


def _parity(
    ref: onnx.ModelProto,
    new: onnx.ModelProto,
    batch: int = FUSION_CHECK_BATCH,
    dynamic: int | AxisSizes | None = None,
) -> str | None:
    """None when both graphs agree on random inputs; else a short description of the difference."""
    try:
        a, b = (ort_session(m, error=BuildError) for m in (ref, new))
    except BuildError as exc:  # e.g. a fused op with no CPU kernel: cannot check, so do not fuse
        return f"cannot run on CPU to check ({load_reason(exc)})"
    specs, want = io_specs(ref)[0], None
    for size in [dynamic] if dynamic else UNSIZED_TRIES:
        if not dynamic and size != FUSION_CHECK_BATCH and _feed_bytes(specs, batch, size) > UNSIZED_BYTES:
            break  # a video's time, height and width at 256 each: no check is worth that memory
        feed = random_inputs(specs, batch, dynamic=size)
        try:
            want = a.run(None, feed)
            break
        except Exception as exc:  # ORT's own error type; a graph that cannot run these inputs cannot be checked
            failed = exc
    if want is None:
        return f"{_CANNOT_RUN} to check ({ort_reason(failed, 160)})"
    try:
        got = b.run(None, feed)
    except Exception as exc:  # the unfused graph runs them: the fusion broke it (e.g. ORT's fusions on a T5)
        return f"the fused graph does not run inputs the unfused one runs ({ort_reason(exc, 160)})"
    for name, x, y in zip([o.name for o in ref.graph.output], want, got):
        ok, err, why = within_tolerance(x, y, atol=1e-3, rtol=1e-3)
        if not ok:
            return f"output '{name}' {why}"
    return None
