"""The build stage: :func:`build_engine` makes one engine folder; :func:`run` builds every (backend, device,
precision) engine the config asks for. ``kiln build model.onnx ...`` calls :func:`build_engine` directly."""

from __future__ import annotations

import logging
import re
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from itertools import chain, islice
from pathlib import Path
from typing import Any

import onnx

from kiln.calibration.feeds import FILE as FEEDS_FILE
from kiln.core.artifacts import atomic_dir, ensure_writable, hash_file, hash_json
from kiln.core.errors import BuildError, ConfigError, KilnError, ModelError
from kiln.core.inputs import check_batch_fits, largest_sizes, random_inputs
from kiln.core.onnx_io import check_tensor_io, index_floors, index_ranges, io_specs, load_onnx, ort_session
from kiln.core.ownership import held
from kiln.core.progress import Progress, SilentProgress
from kiln.core.records import EngineMetadata, EngineSource, IntRange, Variants, by_column, whole_range
from kiln.core.stage import StageContext
from kiln.core.text import short_reason
from kiln.models.model_io import load_trained
from kiln.stages.engines.backend import SIDECAR, Backend, BuildRequest, Built, read_metadata
from kiln.stages.engines.config import BuildConfig
from kiln.stages.engines.declaration import BuildSettings, BuildSummary, EngineEntry
from kiln.stages.engines.dynamic_axes import check_engine_graph
from kiln.stages.engines.registry import BACKENDS, backend_named
from kiln.stages.engines.reuse import PreviousBuild, inputs_key
from kiln.stages.engines.sizes import checked_ranges, probe_graphs, record_checked
from kiln.stages.engines.tensorrt.errors import gc_pause_held
from kiln.stages.export.batch_axes import batch_ties, first_axis_names, write_ties
from kiln.stages.export.declaration import read_axis_steps
from kiln.stages.precision.audit import (
    INTEGER,
    LOW,
    MIN_SHARE,
    audit_graph,
    doubt_fix,
    engine_audit,
    kernel_fix,
    label_problem,
)
from kiln.stages.precision.config import PRECISIONS

log = logging.getLogger("kiln.build")


def engine_name(backend: str, device: str, precision: str) -> str:
    return backend_named(backend).engine_name(device, precision)


def build_engine(
    onnx_path: Path,
    out_dir: Path,
    backend: str,
    device: str,
    precision: str,
    cfg: BuildConfig,
    cache_dir: Path,
    progress: Progress | None = None,
    *,
    max_batch: int = 32,
    name: str | None = None,
    keep_fp32: list[str] | None = None,
    torch_model: Callable[[], Any] | None = None,
    axis_sizes: dict[str, list[int]] | None = None,
    calibration: Path | None = None,
    int_ranges: dict[str, IntRange] | None = None,
    axis_steps: dict[str, list[int]] | None = None,
    inputs_hash: str | None = None,
    value_ranges: dict[str, list[float]] | None = None,
) -> EngineMetadata:
    """Build one engine into ``out_dir`` (replaced atomically) and return its metadata (``kiln-engine.json``).

    ``max_batch`` bounds default optimization profiles (dynamic batch 1..max_batch) and the autotuned batch sizes;
    ``calibration``: the precision stage's calibration batches, for backends that calibrate the model themselves;
    ``int_ranges``: each integer input's values in the data (an index the data holds below 0 is one the model
    takes: PyTorch's ``table[i]`` counts it from the end, as ONNX's ``Gather`` does); ``value_ranges``: each float
    input's [smallest, largest] value in the data, recorded for random inputs drawn later; ``axis_steps``: dynamic
    axis -> [step, offset] where the model takes only sizes ``offset + k * step`` (the export found them; a torch
    engine's own capture may find them too); ``inputs_hash``: the hash of everything the engine is built from
    (:func:`kiln.stages.engines.reuse.inputs_key`), recorded as its ``settings_hash`` so that a rerun of the build
    stage can keep it; None: the hash of the build's own arguments.
    """
    chosen = _check_choice(backend, device, precision)
    onnx_path, out_dir = Path(onnx_path), Path(out_dir)
    graph = load_onnx(onnx_path, load_external_data=False)
    inputs, outputs = io_specs(graph)
    check_batch_fits(inputs, max_batch)  # profiles and autotuning allocate batches this large
    name = name or chosen.engine_name(device, precision)
    settings = chosen.settings(cfg)
    t0 = time.perf_counter()
    early = EarlyAudit(onnx_path, precision, name, axis_sizes)
    with (progress or SilentProgress()).task(f"building {name}", total=1) as bar, atomic_dir(out_dir) as out:
        request = BuildRequest(
            onnx_path,
            out,
            device,
            precision,
            settings,
            Path(cache_dir),
            inputs,
            max_batch,
            keep_fp32,
            dict(axis_sizes or {}),
            name=name,
            torch_model=torch_model,
            calibration=calibration,
            check_graph=early,
            index_ranges=_index_ranges(graph, inputs, int_ranges or {}),
        )
        with naming_source(out, onnx_path):
            built = chosen.build(request)
        for file in built.files.values():  # an ONNX engine must take every shape its source graph takes
            if file.endswith(".onnx"):
                check_engine_graph(onnx_path, out / file, name)
        source = EngineSource(
            file=onnx_path.name, sha256=hash_file(onnx_path), kept_fp32=sorted(keep_fp32) if keep_fp32 else None
        )
        audit = early.reuse(out, built) or _audit(onnx_path, out, built, axis_sizes)
        refuse_mislabelled(audit, precision, name, onnx_path)
        taken = built.inputs or inputs
        named = {d for spec in taken for d in spec.shape if isinstance(d, str)}
        meta = EngineMetadata(
            name=name,
            backend=backend,
            device=device,
            precision=precision,
            inputs=taken,
            outputs=outputs,
            source=source,
            files=built.files,
            flavour=built.flavour,
            versions=built.versions,
            batch_range=built.batch_range,
            axis_ranges={k: [min(v), max(v)] for k, v in (axis_sizes or {}).items() if k in named and v},
            axis_steps=built.builder_settings.get("axis_steps")
            or {k: v for k, v in (axis_steps or {}).items() if k in named},
            index_ranges=_index_ranges(graph, taken, int_ranges or {}),
            index_floors=_index_floors(graph, taken, int_ranges or {}),
            value_ranges={s.name: value_ranges[s.name] for s in taken if s.name in (value_ranges or {})},
            builder_settings=built.builder_settings,
            backend_info=built.info.model_dump(mode="json"),
            build_seconds=round(time.perf_counter() - t0, 3),
            audit=audit,
        )
        meta.settings_hash = inputs_hash or hash_json(
            {
                "backend": backend,
                "device": device,
                "precision": precision,
                "settings": settings.model_dump(mode="json"),
                "shapes": {"max_batch": max_batch, "axis_sizes": axis_sizes or {}},
                "source": source.sha256,
                "kept_fp32": sorted(keep_fp32 or []),
                "versions": meta.versions,
            }
        )
        files = sorted(f for f in out.iterdir() if f.is_file())
        meta.file_hashes = {f.name: hash_file(f) for f in files}
        meta.size_bytes = sum(f.stat().st_size for f in files)
        meta.write(out / SIDECAR)
        bar.advance()
    log.info("built %s in %.1fs (%.1f MB)", name, meta.build_seconds, meta.size_bytes / 1e6)
    return meta


def _index_ranges(graph: Any, taken: list[Any], data: dict[str, IntRange]) -> dict[str, IntRange]:
    """The values each integer input that indexes a table may hold (:func:`kiln.core.onnx_io.index_ranges`): 0 to
    the table's rows - 1 (an axis's size: a graph neural network's nodes), from as far below 0 as the data goes
    (down to -rows, where ONNX's index ops stop counting; data from 0, as ``torch.gather`` takes, keeps 0). An input
    whose columns index tables of their own keeps a range per column, each column's low from the data's own."""
    names = {s.name for s in taken}
    out: dict[str, IntRange] = {}
    for name, bounds in index_ranges(graph).items():
        if name not in names:
            continue
        columns = by_column(bounds, len(bounds))
        seen = data.get(name)
        if columns is None:
            out[name] = _from_data_low(whole_range(bounds), whole_range(seen) if seen else None)
            continue
        per_data = by_column(seen, len(columns)) if seen else None
        lows = per_data or [whole_range(seen) if seen else None] * len(columns)
        out[name] = [_from_data_low(column, low) for column, low in zip(columns, lows)]
    return out


def _index_floors(graph: Any, taken: list[Any], data: dict[str, IntRange]) -> dict[str, int]:
    """The smallest value each input that indexes an axis of no fixed size may hold
    (:func:`kiln.core.onnx_io.index_floors`: 0 for a graph neural network's node ids), or the data's own smallest
    where it goes lower (a model whose data counts from the end)."""
    names = {s.name for s in taken}
    floors = {name: floor for name, floor in index_floors(graph).items() if name in names}
    return {name: min(floor, whole_range(data[name])[0]) if data.get(name) else floor for name, floor in floors.items()}


def _from_data_low(bounds: list[int], data: list[int] | None) -> list[int]:
    """``bounds`` (one index range) reaching below its low as far as ``data`` (its values in the data) does, as far
    as ONNX's negative indices reach (-rows for a range from 0; a shifted column's reaches as far below its low)."""
    low, high = bounds
    return [max(2 * low - high - 1, min(low, data[0] if data else low)), high]


class MislabelledEngine(BuildError):
    """An engine whose precision label its own graph contradicts (an "FP16" engine that computes in FP32); ``audit``:
    the audit that contradicts it, whose ops in float say which fix applies (:func:`refusal_fix`)."""

    def __init__(self, message: str, hint: str | None = None, audit: dict[str, Any] | None = None) -> None:
        super().__init__(message, hint)
        self.audit = audit or {}


class UnsizedLabel(MislabelledEngine):
    """An engine whose label only compute nodes the audit could not size put in doubt: its fix (what sizes them)
    is its own, not the fixes of a runtime that computes another precision."""


class LowGraph(MislabelledEngine):
    """An engine labelled fp32 whose graph computes in ``low`` already (a quantization-aware model's Q/DQ, float16
    weights; ``found``: what in the graph says so). Every device has fp32 kernels: its fix is to build it as
    ``low``, never another device's kernels."""

    def __init__(self, message: str, low: str, found: str, audit: dict[str, Any]) -> None:
        said = f" ({found})" if found else ""
        super().__init__(message, hint=f"its graph is already {low}{said}: build it as {low}", audit=audit)
        self.low, self.found = low, found


def refuse_mislabelled(audit: dict[str, Any], precision: str, name: str, source: Path | None = None) -> None:
    """Raise :class:`MislabelledEngine` where the audit contradicts the engine's ``precision`` label (TensorRT's
    declared precision flags are not audited: it picks layers at build). Where only compute nodes the audit could
    not size put the label in doubt, the fix says what sizes them, not what contradicts the label; where an fp32
    label meets a graph (``source``) already in a lower precision, :class:`LowGraph` names what makes it so."""
    problem = label_problem(audit, precision)
    if not problem or audit["method"].startswith("declared by TensorRT"):
        return
    doubt = doubt_fix(audit, precision)  # only nodes it could not size put the label in doubt
    if doubt:
        raise UnsizedLabel(f"engine {name} is {problem}", hint=doubt, audit=audit)
    low = graph_low(audit, precision)
    if low is not None:
        raise LowGraph(f"engine {name} is {problem}", low, low_found(source, low), audit)
    raise MislabelledEngine(
        f"engine {name} is {problem}",
        hint=f"{MATCH_FIX}, or give the backend a graph in that precision (kiln precision makes them)",
        audit=audit,
    )


MATCH_FIX = "build it with --precision matching the graph (or none: the audit labels it)"


def graph_low(audit: dict[str, Any], precision: str) -> str | None:
    """The lower precision an engine labelled ``precision`` fp32 computes in by its audit (one holding
    :data:`~kiln.stages.precision.audit.MIN_SHARE` of the FLOPs by its floor, as the label's check judges); None
    for any other label or where fp32 holds."""
    if precision != "fp32":
        return None
    floor = audit.get("share_floor", audit.get("share") or {})
    return next((p for p in LOW if floor.get(p, 0.0) >= MIN_SHARE), None)


def low_found(source: Path | None, low: str) -> str:
    """What in the graph at ``source`` makes it ``low``, as a user can look it up: its Q/DQ and integer nodes (INT8,
    FP8), or its float16 weights and casts to float16 (FP16); '' where there is no file or none of them."""
    if source is None or not source.is_file():
        return ""
    graph = load_onnx(source, load_external_data=False).graph
    ops: Counter[str] = Counter(n.op_type for n in graph.node)
    if low == "fp16":
        half = sum(t.data_type == onnx.TensorProto.FLOAT16 for t in graph.initializer)
        casts = sum(n.op_type == "Cast" and _cast_to(n) == onnx.TensorProto.FLOAT16 for n in graph.node)
        said = [f"{half} float16 weights"] if half else []
        return ", ".join(said + ([f"{casts} Casts to float16"] if casts else []))
    qdq = " and ".join(f"{ops[q]} {q}" for q in ("QuantizeLinear", "DequantizeLinear") if ops[q])
    said = [f"{qdq} nodes"] if qdq else []
    return ", ".join(said + [f"{n} {op}" for op, n in sorted(ops.items()) if op in INTEGER])


def _cast_to(node: onnx.NodeProto) -> int | None:
    return next((a.i for a in node.attribute if a.name == "to"), None)


class EarlyAudit:
    """The audit of an engine graph as its backend writes it (``BuildRequest.check_graph``), refusing a mislabelled
    one before the backend opens or times it, and kept for the build's record while the file is unchanged (a
    load fallback may replace it)."""

    def __init__(self, source: Path, precision: str, name: str, axis_sizes: dict[str, list[int]] | None) -> None:
        self.source, self.precision, self.name = source, precision, name
        self.sizes = {k: max(v) for k, v in (axis_sizes or {}).items() if v}
        self.done: tuple[str, tuple[int, int], dict[str, Any]] | None = None

    def __call__(self, path: Path) -> None:
        audit = engine_audit(self.source, path, self.sizes)
        self.done = (path.name, _stamp(path), audit)
        refuse_mislabelled(audit, self.precision, self.name, self.source)

    def reuse(self, out: Path, built: Built) -> dict[str, Any] | None:
        """The early audit where the engine's graph is the file it read, unchanged; else None."""
        model = built.files.get("model", "")
        if self.done is None or self.done[0] != model or _stamp(out / model) != self.done[1]:
            return None
        return self.done[2]


def _stamp(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_mtime_ns, stat.st_size


def _audit(source: Path, out: Path, built: Built, axis_sizes: dict[str, list[int]] | None) -> dict[str, Any]:
    """The engine's precision audit (:func:`kiln.stages.precision.audit.engine_audit`), its FLOPs counted at the
    largest size of each dynamic axis it is built for."""
    sizes = {k: max(v) for k, v in (axis_sizes or {}).items() if v}
    model = built.files.get("model", "")
    if model.endswith(".onnx"):
        return engine_audit(source, out / model, sizes)
    settings = {**built.info.model_dump(mode="json"), **built.builder_settings}
    if "dtype" in settings:  # a PyTorch program cast to one dtype, its linear layers maybe FP8/INT8 GEMMs
        declared = {"float16": "fp16", "float32": "fp32", "float8_e4m3fn": "fp8", "int8": "int8"}[settings["dtype"]]
        return engine_audit(source, None, sizes, declared=declared, lowbit_share=settings.get("lowbit_linear_share"))
    if settings.get("strongly_typed", True):  # precision from the graph
        return engine_audit(source, None, sizes)
    audit = engine_audit(source, None, sizes)
    return {**audit, "method": "declared by TensorRT's precision flags (layers chosen at build, not audited)"}


def _check_choice(backend: str, device: str, precision: str) -> Any:
    chosen = backend_named(backend)
    if device not in chosen.devices:
        raise ConfigError(
            f"backend '{backend}' cannot build for device '{device}'",
            hint=f"use --device {' or '.join(chosen.devices)}",
        )
    if precision not in PRECISIONS:
        raise ConfigError(f"unknown precision '{precision}'", hint=f"use one of {', '.join(PRECISIONS)}")
    return chosen


def run(ctx: StageContext[BuildSettings]) -> BuildSummary:
    """Build every (backend, device, precision) engine the config plans for the precision stage's variants. An
    engine whose own inputs are those of an engine in the previous run's build folder is copied from it, not built
    again (:mod:`kiln.stages.engines.reuse`): a rerun caused by another engine's inputs costs that engine alone.
    The TensorRT builds share one pause of the garbage collector (:func:`gc_pause_held`): one full collection a
    stage, not one a build."""
    with gc_pause_held():
        return _build_all(ctx)


def _build_all(ctx: StageContext[BuildSettings]) -> BuildSummary:
    cfg = ctx.config.build
    root = ctx.inputs["precision"]
    record = Variants.read(root / "variants.json", hint="run `kiln run --from precision`")
    variants = record.variants
    max_batch = ctx.config.signature.max_batch
    # Dynamic axes besides batch: the sizes signature.shapes asks for, else those the precision stage saw in the data
    sizes = ctx.config.signature.axis_ranges(record.axis_sizes)
    # The trained model, for backends that compile PyTorch itself (torch): loaded only if one asks.
    torch_model = (lambda: load_trained(ctx.inputs["train"], ctx.config.model)) if "train" in ctx.inputs else None
    steps = read_axis_steps(ctx.inputs["export"]) if "export" in ctx.inputs else {}
    # the data's float ranges are no input of the engine, only recorded beside it (_record_ranges): not keyed
    shapes = {"max_batch": max_batch, "axis_sizes": sizes, "int_ranges": record.int_ranges, "axis_steps": steps}
    previous = PreviousBuild(ctx.workdir / ctx.name, ctx.key_parts, ctx.log, ctx.forced)  # unchanged engines: kept
    engines: list[EngineEntry] = []
    skipped: list[str] = []
    warned: dict[str, str] = {}  # a skip's reason said as a warning -> the engine it was said for
    for precision in variants:
        for backend in (BACKENDS[name] for name in cfg.backends):
            settings = backend.settings(cfg)
            plan = backend.plan(settings, precision)
            skipped += plan.skipped
            for device in plan.devices:
                name = backend.engine_name(device, precision)
                if plan.by_default and (why := _yields(backend, device, precision, cfg)):
                    # said aloud where the user named the backend: they asked for it and get none on this device
                    named = "backends" in cfg.model_fields_set
                    (ctx.log.warning if named else ctx.log.info)("not building %s: %s", name, why)
                    skipped.append(f"{name}: not built by default: {why}")
                    continue
                src, keep = backend.source_for(device, precision, variants, settings)
                # the variant's graph was not made: the engines that read it are not built (the torch backend's
                # compile the PyTorch model)
                unmade = variants[precision].unmade if backend.name in cfg.graph_readers else None
                if src == variants[precision].path and unmade:
                    ctx.log.info("not building %s: %s", name, variants[precision].unmade)
                    skipped.append(f"{name}: {variants[precision].unmade}")
                    continue
                graphs = [root / src] + ([root / variants[precision].path] if keep is not None else [])
                key = inputs_key(ctx, backend, device, precision, graphs, keep, shapes)
                if kept := previous.take(name, key, ctx.out / name):
                    _record_ranges(ctx.out / name, record.value_ranges)
                    engines.append(EngineEntry.model_validate(kept))
                    continue
                try:
                    meta = _build_with_fallback(
                        root,
                        src,
                        keep,
                        variants[precision].path,
                        name,
                        backend.name,
                        device,
                        precision,
                        ctx,
                        max_batch,
                        torch_model,
                        sizes,
                        record.int_ranges,
                        steps,
                        key,
                        value_ranges=record.value_ranges,
                    )
                except BuildError as exc:
                    if not backend.optional(settings) and not isinstance(exc, MislabelledEngine):
                        raise
                    fix, said = refusal_fix(exc, variants[precision], src, precision, device)
                    reason = exc.message + (f" (fix: {fix})" if fix else "")
                    say_skip(ctx.log, name, reason if said else exc.message, said, warned)
                    skipped.append(f"{name}: {reason}")
                    continue
                fields = {"name", "backend", "device", "precision", "size_bytes"}
                entry = {**meta.model_dump(include=fields), "build_seconds": meta.build_seconds}
                engines.append(EngineEntry.model_validate(entry))
    if not engines:  # failed here, where the reasons are known, not later as "nothing could be validated"
        raise BuildError(
            f"no engine was built: {'; '.join(skipped) or 'no backend plans one for these precisions'}",
            hint=nothing_built_fix(list(variants), cfg.backends),
        )
    return BuildSummary(engines=engines, skipped=skipped)


def say_skip(log: logging.Logger, name: str, reason: str, warn: bool, warned: dict[str, str]) -> None:
    """Log the skip of engine ``name`` for ``reason``: a warning where the user loses an engine they asked for
    (``warn``), else at info. A warning's reason said already for another engine of the run (TensorRT's parser
    failing at one node for every precision) names that engine instead of repeating it (``warned``: reason ->
    engine, filled here)."""
    if not warn:
        log.info("skipping %s: %s", name, reason)
    elif reason in warned:
        log.warning("skipping %s: the same failure as %s", name, warned[reason])
    else:
        warned[reason] = name
        log.warning("skipping %s: %s", name, reason)


def nothing_built_fix(precisions: list[str], backends: list[str]) -> str:
    """The fix for a build that made no engine: each skip's own, and the engine that builds on any machine (fp32 on
    ONNX Runtime) where the run did not try it (where it did, its skip says why it did not build)."""
    if "fp32" in precisions and "onnxruntime" in backends:
        return "each reason says what to change"
    return (
        "each reason says what to change; or add a precision and backend that build here (fp32 with "
        "build.backends: [onnxruntime] builds on any machine)"
    )


def refusal_fix(exc: BuildError, variant: Any, src: str, precision: str, device: str) -> tuple[str, bool]:
    """The fix for an optional engine the build skips after ``exc``, and whether the skip is said as a warning. An
    audit's refusal (:class:`MislabelledEngine`) is a measured fact, said at info, where its runtime has no kernels
    of ``precision`` on ``device`` at all or the graph left too little in ``precision``; where the runtime left
    quantized ops in float for want of their integer kernels (:func:`kernel_fix`), the precision the user asked for
    is lost to the runtime: a warning naming those ops. A label in doubt (:class:`UnsizedLabel`) and a failed build
    keep their own fixes. An fp32 engine whose graph is already in a lower precision (:class:`LowGraph`) is lost
    to the model, not to a runtime: a warning saying so."""
    if not isinstance(exc, MislabelledEngine):
        return exc.hint or "", True
    if isinstance(exc, UnsizedLabel):
        return exc.hint or "", False
    if isinstance(exc, LowGraph):
        return low_graph_fix(exc), True
    kernel = runtime_fix(exc.audit, precision, device)
    if kernel is not None:
        return kernel, True
    kept = _kept_in_float(variant, src)
    return (kept_fix(precision, kept) if kept else run_fix(precision, device)), False


def low_graph_fix(exc: LowGraph) -> str:
    """The fix in a run for an fp32 engine whose graph is already ``exc.low``: the model made it so (a
    quantization-aware model's fake-quant exports as Q/DQ; a float16 model keeps float16 weights), so the run's
    engines of it are ``exc.low`` ones."""
    made = "the model's float16 weights" if exc.low == "fp16" else "the model's fake-quant"
    found = f"{exc.found}, from {made}" if exc.found else f"from {made}"
    return f"the model's graph is already {exc.low} ({found}): build it as {exc.low} (precision.variants: [{exc.low}])"


def runtime_fix(audit: dict[str, Any], precision: str, device: str) -> str | None:
    """The fix for an engine whose runtime, with kernels of ``precision`` on ``device`` (:func:`has_kernels`), left
    its quantized ops in float (:func:`~kiln.stages.precision.audit.kernel_fix`); None where it did not."""
    return kernel_fix(audit, precision) if has_kernels(precision, device) else None


def run_fix(precision: str, device: str) -> str:
    """The fix for an engine of a run whose graph the audit finds not in its variant's precision, where the
    accuracy fallback kept no node in float. On the CPU, INT8 engines are ONNX Runtime's, which has INT8 kernels
    there (MatMulInteger, QLinearMatMul, ConvInteger): the float left is the graph's, which the precision settings
    change. Otherwise the backend's runtime has no such kernels on that device (ONNX Runtime's CPU provider runs
    FP16 graphs in FP32), which the run's settings, not a build flag, change."""
    if has_kernels(precision, device):
        return (
            "ONNX Runtime computes int8 on CPU (MatMul, Gemm and Conv as MatMulInteger, QLinearMatMul, "
            "ConvInteger): the compute nodes in float are those the precision stage kept in float or did not "
            "quantize (report.md, Precision, names the nodes kept and why): keep fewer (calibration.exclude_nodes, "
            "calibration.exclude_op_types, calibration.keep_output_layers), quantize their op types "
            "(calibration.op_types), or accept that this model has no int8 engine (precision.variants without "
            "int8 skips the variant)"
        )
    return (
        f"none needed where other engines are built: this backend runs {precision} in another precision on "
        f"{device.upper()}; {precision} engines come from a device with {precision} kernels (a GPU backend), and "
        f"precision.variants without {precision} skips the variant"
    )


def has_kernels(precision: str, device: str) -> bool:
    """Whether the engines Kiln builds in ``precision`` on ``device`` run it in kernels of that precision, where an
    audit refusal is the graph's doing: INT8 on the CPU, ONNX Runtime's alone (the torch backend's INT8 is for
    CUDA GPUs). ONNX Runtime's FP16 on the CPU runs in FP32 through casts."""
    return precision == "int8" and device == "cpu"


def _kept_in_float(variant: Any, src: str) -> list[str]:
    """The nodes the precision stage's accuracy fallback kept in float in the graph ``src`` an engine reads (the
    ONNX Runtime CPU graph's own fallback where ``src`` is that graph): not those kept by the config or by
    calibration (``calibration.keep_output_layers``, an unbounded tensor), which no gate asked for. The ONNX
    Runtime CPU graph starts from the nodes the Q/DQ graph's fallback kept: those it still keeps count too."""
    cpu = variant.report.get("ort_cpu") or {}
    own = src in variant.backend_paths.values() and src != variant.path
    fallback = list(((cpu if own else variant.report).get("fallback") or {}).get("nodes") or [])
    if own:
        inherited = (variant.report.get("fallback") or {}).get("nodes") or []
        fallback += [n for n in inherited if n in (cpu.get("kept_fp32") or []) and n not in fallback]
    return fallback


def kept_fix(precision: str, kept: list[str]) -> str:
    """The fix for an engine the audit finds short of its precision where the accuracy fallback kept nodes in
    float to pass the gates: that, not the runtime, is what left too little in ``precision``."""
    named = ", ".join(kept[:4]) + (", ..." if len(kept) > 4 else "")
    return (
        f"the precision stage kept {len(kept)} nodes in float ({named}) for the gates its {precision} graph "
        "failed without them (report.md, Precision): loosen the gate that failed for this precision "
        f"(validate.gates.per_precision.{precision}, or the metric's drop), calibrate otherwise (calibration.method), "
        f"or leave {precision} out of precision.variants"
    )


def _yields(backend: Backend, device: str, precision: str, cfg: Any) -> str | None:
    """Why ``backend`` leaves ``device`` to a rival that builds there in this run (``Backend.yields``), or None."""
    rival_name, why = backend.yields.get(device, (None, ""))
    if rival_name is None or rival_name not in cfg.backends:
        return None
    rival = BACKENDS[rival_name]
    if device not in rival.plan(rival.settings(cfg), precision).devices:
        return None
    return f"{why} (build it anyway: build.{backend.name}.devices: [{device}])"


def _record_ranges(engine_dir: Path, value_ranges: dict[str, list[float]]) -> None:
    """Record the data's float ranges (``value_ranges``) in a kept engine's ``kiln-engine.json`` where they moved:
    they are no input of the engine, so new data keeps it (a TensorRT engine's minutes of build), but ``kiln
    validate ENGINE`` draws its random inputs in them."""
    meta = read_metadata(engine_dir)
    ranges = {s.name: value_ranges[s.name] for s in meta.inputs if s.name in value_ranges}
    if meta.value_ranges != ranges:
        meta.value_ranges = ranges
        meta.write(engine_dir / SIDECAR)


def _build_with_fallback(
    root: Path,
    src: str,
    keep: list[str] | None,
    own_graph: str,
    name: str,
    backend: str,
    device: str,
    precision: str,
    ctx: StageContext[BuildSettings],
    max_batch: int,
    torch_model: Callable[[], Any] | None = None,
    sizes: dict[str, list[int]] | None = None,
    int_ranges: dict[str, IntRange] | None = None,
    axis_steps: dict[str, list[int]] | None = None,
    inputs_hash: str | None = None,
    value_ranges: dict[str, list[float]] | None = None,
) -> EngineMetadata:
    """Build from ``src``; an engine converted at build time (``keep`` given) that the backend's converter cannot
    convert is built from the precision stage's own graph instead, which passed the ONNX checker (ORT's FP16
    converter fails on control flow and sequences, e.g. an nn.EmbeddingBag)."""
    calibration = root / FEEDS_FILE  # saved by the precision stage where a backend calibrates the model itself
    shared = dict(
        max_batch=max_batch,
        axis_sizes=sizes,
        int_ranges=int_ranges,
        axis_steps=axis_steps,
        inputs_hash=inputs_hash,
        value_ranges=value_ranges,
    )

    def build(graph: str, **extra: Any) -> EngineMetadata:
        args = (ctx.out / name, backend, device, precision, ctx.config.build, ctx.cache_dir, ctx.progress)
        return build_engine(root / graph, *args, **shared, **extra)

    try:
        return build(
            src,
            keep_fp32=keep,
            torch_model=torch_model,
            calibration=calibration if calibration.is_file() else None,
        )
    except BuildError as exc:
        if keep is None or isinstance(exc, MislabelledEngine):
            raise
        ctx.log.warning("%s: %s; building it from the precision stage's %s graph instead", name, exc.message, precision)
        return build(own_graph)


@contextmanager
def naming_source(staging: Path, source: Path) -> Iterator[None]:
    """Errors raised inside the block name ``source`` where they named a file in ``staging``: a backend's library
    (ONNX Runtime's "Load model from X failed") names the copy it was handed in the staging folder, whose name
    means nothing to the user and is gone once the build fails."""
    try:
        yield
    except KilnError as exc:
        inside = re.compile(re.escape(str(staging)) + r"[/\\][^\s:'\"]*")
        if inside.search(exc.message):
            exc.message = inside.sub(lambda _: str(source), exc.message)
            exc.args = (exc.message, *exc.args[1:])
        raise


def default_device(backend: str) -> str:
    """The device ``kiln build --backend B`` builds for when none is given: the backend's only one (TensorRT:
    cuda, which TensorRT-RTX builds for on a machine without a GPU), else the CPU."""
    devices = backend_named(backend).devices
    return devices[0] if len(devices) == 1 else "cpu"


def build_direct(
    src: Path,
    out: Path,
    backend: str,
    device: str | None,
    precision: str | None,
    cfg: BuildConfig,
    axis_sizes: dict[str, list[int]] | None = None,
    max_batch: int = 32,
) -> EngineMetadata:
    """``kiln build model.onnx -o out/``: one engine from any ONNX file, no workdir (caches beside ``out``). ``src``
    may be a variant folder of ``kiln precision`` (``variants/int8``): the graph made for this engine kind is built,
    labelled with the variant's precision unless ``precision`` says otherwise; a graph of neither, with the precision
    it computes in (its audit). ``axis_sizes``: sizes of the graph's dynamic axes besides batch, by the names the
    graph gives them (``signature.shapes``), for the profiles and the recorded ranges; ``max_batch``: the largest
    batch (``signature.batch_sizes``), which bounds the profiles and autotuning as in the pipeline's build."""
    device = device or default_device(backend)
    src, made_as = variant_source(Path(src), backend, device)
    from_variant = not axis_sizes and made_as
    if from_variant:  # the sizes kiln precision recorded (signature.shapes, else its data's): the audit counts there
        axis_sizes = _variant_axis_sizes(Path(src))
    # clear errors for a missing or corrupt file, or one with a non-tensor input or output, before any builder runs
    model = load_onnx(src, load_external_data=False)  # the checks read no weights
    check_tensor_io(model, str(src))
    check_graph(model, Path(src), backend)
    given = precision
    precision = precision or made_as or audit_graph(src).label()  # unlabelled: what the graph computes in
    _check_choice(backend, device, precision)
    refuse_foreign_folder(out)
    ensure_writable(out.parent, "the -o folder's parent")
    ranges, steps = checked_ranges(probe_graphs(Path(src), made_as), dict(axis_sizes or {}), bool(from_variant))
    cache = out.parent / ".kiln-cache"
    try:
        with batch_tied(Path(src), axis_sizes or {}, out.parent) as graph:
            meta = build_engine(
                graph,
                out,
                backend,
                device,
                precision,
                cfg,
                cache,
                max_batch=max_batch,
                axis_sizes=axis_sizes,
                axis_steps=steps,
            )
    except UnsizedLabel:
        raise  # its fix sizes the nodes that put the label in doubt
    except MislabelledEngine as exc:
        if _relabel_here(exc, given or made_as, precision, device):  # no one labelled it: the engine's compute does
            others = [d for d in backend_named(backend).devices if d != device]
            there = f"build it with --device {' or --device '.join(others)}" if others else "use another --backend"
            log.warning(
                "%s is an %s graph; the %s backend computes it in fp32 on %s (no %s kernels there): labelled fp32 "
                "(%s for an %s engine)",
                Path(src).name,
                precision,
                backend,
                device.upper(),
                precision,
                there,
                precision,
            )
            return build_direct(src, out, backend, device, "fp32", cfg, axis_sizes, max_batch)
        # the graph is in that precision (a variant folder or the audit labels it; a label the user gave that the
        # graph's own audit agrees with): the runtime, not the label, computes it in another one
        in_precision = not given or audit_graph(src).label() == given
        exc.hint = direct_fix(exc, backend, device, precision, in_precision, bool(made_as and not given))
        raise
    return record_checked(out, meta, ranges)


def _relabel_here(exc: MislabelledEngine, labelled: str | None, precision: str, device: str) -> bool:
    """Whether ``kiln build`` relabels an engine its audit refused (``exc``) as fp32: no one gave its label (no
    ``--precision``, no variant folder: the graph's audit chose ``precision``), and the device has no kernels for
    that precision, so the engine computes in fp32 (:func:`lacks_kernels`): its label is then what it computes in,
    not an error for a choice the user never made."""
    return (
        not labelled
        and not isinstance(exc, (LowGraph, UnsizedLabel))
        and lacks_kernels(precision, device)
        and _computes_in(exc.audit) == "fp32"
    )


def direct_fix(
    exc: MislabelledEngine, backend: str, device: str, precision: str, in_precision: bool, variant: bool
) -> str:
    """The fix for ``kiln build`` of an engine its audit refused (``exc``): a graph already in a lower precision than
    fp32 is built as that; a precision the device has no kernels for (:func:`lacks_kernels`) that it computed in
    another is built in that one here, or on a device with the kernels, whoever labelled it; a graph in that
    precision (``in_precision``; ``variant``: a variant folder labels it) that the runtime computes otherwise gets the
    runtime's fix; else the label or the graph is to change (``exc``'s own fix)."""
    if isinstance(exc, LowGraph):
        found = f" ({exc.found})" if exc.found else ""
        return (
            f"its graph is already {exc.low}{found}: build it with --precision {exc.low} (or none: the audit labels it)"
        )
    ran = _computes_in(exc.audit)
    if lacks_kernels(precision, device) and ran == "fp32":
        return cpu_fix(backend, precision, device, variant)
    if not in_precision:  # no graph in that precision helps where the device lacks its kernels
        return MATCH_FIX if lacks_kernels(precision, device) else exc.hint or ""
    if has_kernels(precision, device):
        return runtime_fix(exc.audit, precision, device) or run_fix(precision, device)
    return (
        f"the {backend} backend runs {precision} in another precision on {device.upper()}: build this variant for a "
        f"device with {precision} kernels (another --device or --backend), or build the fp32 variant here"
    )


def lacks_kernels(precision: str, device: str) -> bool:
    """Whether the engines Kiln builds on ``device`` compute ``precision`` in another one for want of its kernels:
    FP16 and FP8 on the CPU (ONNX Runtime's CPU provider runs an FP16 graph in FP32 through casts)."""
    return device == "cpu" and precision in ("fp16", "fp8")


def cpu_fix(backend: str, precision: str, device: str, variant: bool) -> str:
    """The fix for an engine of ``precision`` that ``backend`` computes in FP32 on ``device`` (:func:`lacks_kernels`):
    that label here (the fp32 variant, for a variant folder), or a device of the backend with those kernels."""
    others = [d for d in backend_named(backend).devices if d != device]
    there = f"--device {' or --device '.join(others)}" if others else "another --backend"
    here = "build the fp32 variant here" if variant else "build it with --precision fp32 here"
    return (
        f"the {backend} backend runs {precision} in another precision on {device.upper()} (fp32 there): {here}, or "
        f"build it for a device with {precision} kernels ({there})"
    )


def _computes_in(audit: dict[str, Any]) -> str:
    """The precision an engine computes most of its FLOPs in, by its audit's share (fp32 where it counted none)."""
    share = audit.get("share") or {}
    return max(share, key=lambda p: share[p]) if share else "fp32"


@contextmanager
def batch_tied(src: Path, axis_sizes: dict[str, list[int]], scratch: Path) -> Iterator[Path]:
    """``src``, or where its inputs name their first axes apart and the graph takes them only in one count
    (tf2onnx's ``unk__42`` and ``unk__43`` joined by a Concat), a copy of it in a temporary folder with those axes
    under one name, as ``kiln run``'s export ties them (:func:`~kiln.stages.export.batch_axes.batch_ties`): the
    engine then takes those inputs as one batch and servers batch its requests. The user's file is never changed
    (the engine's ``source`` is the copy, its sha256 the tied graph's); errors inside the block that name the copy
    name ``src``. ``axis_sizes``: sizes of the other dynamic axes by
    name (``signature.shapes``), for the random rows the graph is run on; ``scratch``: the folder the copy is
    written in (beside the engine: a model's weights may not fit the system's temporary folder)."""
    renames = _batch_renames(src, axis_sizes)
    if not renames:
        yield src
        return
    with tempfile.TemporaryDirectory(prefix=".kiln-tied-", dir=scratch) as tmp:
        copy = Path(tmp) / src.name
        write_ties(src, copy, renames)
        with naming_source(Path(tmp), src):
            yield copy


def _batch_renames(src: Path, axis_sizes: dict[str, list[int]]) -> dict[str, str]:
    """The first-axis renames :func:`~kiln.stages.export.batch_axes.batch_ties` finds running ``src`` on two random
    rows of its inputs (integers within the tables they index; other dynamic axes at their largest given size, else
    8); none where the random rows do not fit the graph or ONNX Runtime cannot open it (the build says why)."""
    graph = load_onnx(src, load_external_data=False)
    if len(set(first_axis_names(graph.graph).values())) < 2:
        return {}
    specs, _ = io_specs(graph)
    try:
        feed = random_inputs(specs, 2, largest_sizes(specs, axis_sizes) or 8, int_ranges=index_ranges(graph))
        return batch_ties(src, feed)
    except KilnError as exc:
        log.info("first axes of %s not tied: %s", src.name, exc.message)
        return {}


def check_graph(model: onnx.ModelProto, src: Path, backend: str = "onnxruntime") -> None:
    """The ONNX checker on the file the user gave, as ``kiln run`` checks it: a broken graph (a node reading a
    tensor nothing makes) is said as one, naming the file, before any backend names the copy it builds from.
    ``model``: ``src`` as :func:`load_onnx` read it, without its external data (which it found); it is changed into
    what the checker can read (:func:`_as_checked`). Not the full check: its strict shape inference refuses graphs
    ONNX Runtime runs. The checker is stricter than the runtimes (nodes out of topological order, a graph
    without a name, a Constant's tensor in an external file): where ONNX Runtime loads the graph, and for any
    other ``backend`` (TensorRT's parser sorts nodes and takes plugin ops ONNX Runtime lacks), its verdict is a
    warning and the build goes on to the backend's own."""
    try:
        onnx.checker.check_model(_as_checked(model))
        return
    except Exception as exc:
        reason = short_reason(exc)
    if backend != "onnxruntime" or _onnxruntime_loads(src):
        goes_on = (
            f"the {backend} build goes on" if backend != "onnxruntime" else "ONNX Runtime loads it: the build goes on"
        )
        log.warning("%s fails the ONNX checker (%s); %s", src, reason, goes_on)
        return
    raise ModelError(
        f"{src} fails the ONNX checker: {reason}",
        hint="re-export with a supported opset, or report the model to Kiln",
    )


def _onnxruntime_loads(src: Path) -> bool:
    """Whether ONNX Runtime makes a CPU session of ``src`` (no graph optimisation: only whether the graph holds)."""
    try:
        ort_session(src, optimization="none")
    except KilnError:  # ORT's reason, wrapped: the graph is broken for the runtimes too
        return False
    return True


def _as_checked(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` changed in place for the checker: each weight kept in an external file becomes a graph input of
    its type and shape (the checker looks for the file from the working folder, not the model's), and an input
    or output declared without a shape, which ONNX Runtime runs and ``kiln run`` infers before its check, gets an
    empty one."""
    graph = model.graph
    inputs = {v.name for v in graph.input}
    for i in reversed(range(len(graph.initializer))):  # deleting in place: no copy of the weights held inline
        weight = graph.initializer[i]
        if weight.data_location != onnx.TensorProto.EXTERNAL:
            continue
        if weight.name not in inputs:
            graph.input.append(onnx.helper.make_tensor_value_info(weight.name, weight.data_type, list(weight.dims)))
        del graph.initializer[i]
    for value in (*graph.input, *graph.output):
        if value.type.HasField("tensor_type") and not value.type.tensor_type.HasField("shape"):
            value.type.tensor_type.shape.SetInParent()
    return model


def _variant_axis_sizes(graph: Path) -> dict[str, list[int]] | None:
    """The dynamic-axis sizes ``kiln precision`` recorded beside a variant's graph (``variants.json``): the sizes its
    own audit counted at, so the build's audit agrees with it (counted at size 1 an axis's attention matmuls, in FP32
    under INT8, shrink to nothing and the share comes out otherwise)."""
    try:
        return Variants.read(graph.parent.parent / "variants.json", hint="rerun `kiln precision`").axis_sizes or None
    except KilnError:
        return None


def variant_source(src: Path, backend: str, device: str) -> tuple[Path, str | None]:
    """The graph to build for this backend and device, and the precision it was made for, where ``src`` is a variant
    of ``kiln precision`` (its folder, or one of its graphs, beside ``variants.json``); else ``src`` as it is. A
    variant may hold a graph made for one engine kind (ONNX Runtime CPU's INT8): given the folder, that graph is
    built; given another of its graphs for that engine kind, a warning names the one made for it. A variant not made
    (listed ``unmade``, or a folder beside ``variants.json`` that it does not list) is refused: the graph it keeps is
    for inspection, and built as it is, it would be labelled by what it computes in, its failure unsaid."""
    folder = src if src.is_dir() else src.parent
    listing = folder.parent / "variants.json"
    if not listing.is_file():
        if src.is_dir():
            return src / "model.onnx", None
        return src, None
    try:
        variants = Variants.read(listing, hint="rerun `kiln precision`").variants
    except KilnError:
        return (src / "model.onnx" if src.is_dir() else src), None
    for name, variant in variants.items():
        if Path(variant.path).parent.name != folder.name:
            continue
        own = variant.backend_paths.get(f"{backend}-{device}")
        graph = folder.parent / own if own and src.is_dir() else (folder.parent / variant.path if src.is_dir() else src)
        if variant.unmade and graph.resolve() == (folder.parent / variant.path).resolve():
            raise ConfigError(
                f"{src}: kiln precision did not make the {name} variant ({variant.unmade}); its graph is kept for "
                "inspection, not for engines",
                hint="build another variant of that folder (fp32), or loosen the gates that failed and rerun kiln "
                "precision",
            )
        if src.is_dir():
            return graph, name
        if own and src.resolve() != (folder.parent / own).resolve():
            log.warning(
                "%s is the %s graph for other engine kinds; for %s-%s the precision stage made %s (build it, or the "
                "folder %s, for the kernels it was made for)",
                src,
                name,
                backend,
                device,
                folder.parent / own,
                folder,
            )
        return src, name
    made = ", ".join(n for n, v in variants.items() if not v.unmade or v.backend_paths)
    raise ConfigError(
        f"{src}: {listing} lists no variant in {folder.name}/: kiln precision did not make it (a variant it did not "
        "make may keep its graph there for inspection, not for engines)",
        hint=f"build a variant {listing.name} lists ({made}), or rerun kiln precision for this one",
    )


def refuse_foreign_folder(out: Path) -> None:
    """The engine replaces ``out`` as a whole (atomically): allowed only where ``out`` is new, empty, or an engine
    Kiln wrote (its sidecar lists every file). Anything else holds files Kiln did not create, never deleted."""
    if out.is_file():
        raise ConfigError(f"-o {out} is a file; an engine is a folder", hint="give a new or empty folder for -o")
    if not out.is_dir() or not any(out.iterdir()):
        return
    try:
        ours = set(read_metadata(out).file_hashes) | {SIDECAR}
    except KilnError:
        ours = set()
    foreign = sorted(p.name for p in out.iterdir() if p.name not in ours)
    if foreign:
        files = (f for name in foreign for f in _files_of(out / name))  # walked only as far as the message needs
        first = list(islice(files, 1))
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        what = held(out, chain(first, files)) if first else f"files Kiln did not write ({shown})"
        raise ConfigError(
            f"-o {out} already holds {what}; building there would replace them",
            hint="give a new or empty folder for -o (or one a previous `kiln build` wrote)",
        )


def _files_of(path: Path) -> Iterator[Path]:
    """``path`` if a file (or a link), else the files under it, in name order and lazily (a refusal looks at the
    first few only): what a refusal to replace it names, by whose."""
    if path.is_symlink() or not path.is_dir():
        yield path
        return
    try:
        entries = sorted(path.iterdir())
    except OSError:
        return
    for p in entries:
        yield from _files_of(p)
