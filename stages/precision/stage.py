"""Pipeline entry of the precision stage: one graph per configured precision, listed in variants.json.

variants.json is a :class:`kiln.core.records.Variants` record; before typing, each entry reads
``{variant: {"path": "<variant>/model.onnx", "kept_fp32": [...], "reasons": {node: why},
"vs_fp32": {...}, "fallback": {...}, ...}}``; the build stage reads ``path``, the report the rest.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import tempfile
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from kiln.calibration.config import CalibrationConfig
from kiln.calibration.data import Batch, batch_limit, batch_rows, calibration_batches, dataset_batches
from kiln.calibration.feeds import FILE as FEEDS_FILE
from kiln.calibration.feeds import save_feeds
from kiln.calibration.quantize import DYNAMIC_RECURRENT, check_exclusions, quantizable_op_types
from kiln.core.cpu_int8 import slow_integer_convs
from kiln.core.data import DatasetSplits, feed_for_graph, fixed_columns, integer_ranges, rows, take, value_ranges
from kiln.core.errors import KilnError, ModelError
from kiln.core.onnx_io import index_ranges, io_specs, load_onnx
from kiln.core.output_names import class_logits
from kiln.core.progress import Progress
from kiln.core.records import PrecisionVariant, TensorSpec, Variants
from kiln.core.sample_counts import FEW_ROWS
from kiln.core.shapes import Axes, axis_sizes, graph_axes_with, resize, shape_points
from kiln.core.stage import StageContext
from kiln.models.model_io import on_random_inputs, torch_model_named
from kiln.stages.accuracy.check import REFERENCE_NAN_FIX, held_out, held_out_reference, nonfinite_rows, own_point
from kiln.stages.accuracy.refusal import refusing
from kiln.stages.precision.audit import FLOAT_ONLY, MIN_SHARE, RECURRENT, Audit, audit_graph
from kiln.stages.precision.compare import Samples
from kiln.stages.precision.config import PrecisionConfig
from kiln.stages.precision.declaration import PrecisionSettings, PrecisionSummary
from kiln.stages.precision.emulate import emulate_fp16
from kiln.stages.precision.fallback import MetricGap, round_notes
from kiln.stages.precision.fp16_select import check_fp32_nodes
from kiln.stages.precision.gate import GateCheck, session_runner
from kiln.stages.precision.node_errors import (
    DIVERGENCE,
    first_divergence,
    graph_order,
    node_error_curves,
    plot_node_errors,
)
from kiln.stages.precision.provenance import torch_modules
from kiln.stages.precision.report import ort_cpu_left, vs_fp32_text
from kiln.stages.precision.tables import float_tables_hint
from kiln.stages.precision.variants import (
    Carried,
    NotMade,
    Source,
    build_fp8,
    build_fp16,
    build_int8,
    carried_precision,
    quantized_nothing,
)

ORT_CPU_ENGINE = "onnxruntime-cpu"  # the one engine kind that loads an INT8 variant's own ONNX Runtime CPU graph


def run(ctx: StageContext[PrecisionSettings]) -> PrecisionSummary:
    cfg, ccfg = ctx.config.precision, ctx.config.calibration
    random = on_random_inputs(ctx.config.model, ctx.config.data)
    if random and cfg.fallback.enabled:
        # random inputs (a run from model.onnx without data): as `kiln precision` without --calibration, they
        # never decide which nodes stay in float
        ctx.log.warning("precision: the accuracy-driven fallback is off on random inputs; give data.name for it")
        cfg = cfg.model_copy(update={"fallback": cfg.fallback.model_copy(update={"enabled": False})})
    wanted = list(dict.fromkeys(cfg.variants))
    # FP8 graphs (Q/DQ) are for TensorRT; the torch backend compiles FP8 from the PyTorch model itself
    readers = ctx.config.graph_readers
    converted = [p for p in wanted if p != "fp8" or "tensorrt" in readers] if readers else []
    converted = converted or [p for p in wanted if p == "fp32"]
    data = ctx.dataset()
    graph = load_onnx(ctx.inputs["optimize"] / "model.onnx")
    carried = carried_precision(graph)  # a QAT model's own Q/DQ pairs: its low variant is the graph as it is
    left = left_out(carried, wanted, converted, ctx.log)
    as_given = carried.low if carried is not None and carried.low in converted else None
    made = [p for p in converted if p not in left and p != as_given]
    inputs, outputs = io_specs(graph)
    names = [i.name for i in inputs]  # the export's order: the data's inputs in call order
    # FP8/INT8 engines of the torch backend calibrate the PyTorch model on the same batches, saved for the build
    lowbit = bool({"fp8", "int8"} & set(wanted))
    needs_data = "int8" in made or ("fp16" in made and cfg.fp16.range_check) or lowbit
    # at most the rows a call reads (a batch-of-one graph network reads row 0 only): every calibration row is read
    limit = batch_limit(ctx.config.signature.batch_sizes, inputs, outputs)
    batches = calibration_batches(data, ccfg, ctx.config.seed, names, inputs, limit) if needs_data else []
    if needs_data and not random:
        warn_few_calibration_rows(ctx.log, batches, ccfg, wanted, data)
    save_samples(ctx, data, names, batches, lowbit)
    sizes = _axis_sizes(data, names, ctx)
    if not ccfg.reader:  # the user's reader gives the sizes it means to; the data's batches take validation's too
        batches += at_validated_shapes(batches, validated_axes(ctx, inputs), sizes)
    logits = class_logits([o.name for o in outputs], ctx.config.signature.logits_output, data.val_y, data.num_classes)
    logits_index = [o.name for o in outputs].index(logits) if logits is not None else None
    with tempfile.TemporaryDirectory(prefix="kiln-precision-") as tmp:
        # The FP32 variant is the optimized graph with every node named and shapes inferred: the names are
        # how kept nodes are reported, and the same file is what calibration hashes for its cache key.
        # unconverted variants point at the FP32 graph
        kept = ("fp32" in wanted and "fp32" not in left) or converted != wanted
        fp32_path = ctx.out / "fp32" / "model.onnx" if kept else Path(tmp) / "fp32.onnx"
        src = Source.prepare(
            graph,
            fp32_path,
            batches,
            ctx.cache_dir if ccfg.cache else Path(tmp),  # no cache: ranges live only this run
            logits_index,
        )
        cache_dir = src.cache_dir if ccfg.cache else None
        check = held_out_check(ctx, data, src, inputs) if set(made) - {"fp32"} else None
        cfg = without_futile_fallback(cfg, check, ctx.log)
        off = f"give data.name, a data function of real inputs: {RANDOM_OFF}; or drop it from precision.variants"
        variants, errors = build_variants(
            src,
            ctx.out,
            made,
            cfg,
            ccfg,
            check,
            ctx.progress,
            ctx.log,
            sizes,
            wanted,
            off if random else None,
            required=cfg.required,
            qdq_read=reads_qdq(ctx.config.graph_engines),
        )
        if carried is not None and as_given is not None:
            variants[as_given] = carried.as_given(src, ctx.out / as_given / "model.onnx")
        errors = {**left, **errors}
        failed = {p: e.message for p, e in errors.items()}
        tables = float_tables_hint(src.model, ccfg) if "int8" in variants else None
        if tables:
            ctx.log.warning(tables)
        x_val = check.samples if check is not None else {}
        modules = torch_modules(src.model, *_export_graph(ctx))
        node_report = (
            _node_error_report(ctx, src, variants, x_val, modules)
            if cfg.node_errors and check is not None and set(variants) - {"fp32"}
            else {}
        )
    for precision in wanted:
        if precision not in converted:
            variants[precision] = _unconverted(precision, ctx.log)
    variants = {p: variants[p] for p in wanted if p in variants}
    if not variants:
        raise ModelError(
            "no precision variant could be built: " + "; ".join(f"{p}: {m}" for p, m in failed.items()),
            hint=failure_hint(errors, "or add fp32 to precision.variants"),
        )
    for e in variants.values():  # which PyTorch module each kept node came from, beside its ONNX name
        e["kept_fp32_modules"] = _modules_of(e["kept_fp32"], modules)
        if "ort_cpu" in e:
            e["ort_cpu"]["kept_fp32_modules"] = _modules_of(e["ort_cpu"]["kept_fp32"], modules)
    Variants(
        variants={name: variant_record(entry) for name, entry in variants.items()},
        axis_sizes=sizes,
        int_ranges=integer_ranges(data, names, fixed_columns(inputs, index_ranges(graph))),
        value_ranges=value_ranges(data, names),
    ).write(ctx.out / "variants.json")
    summary = {
        v: {
            # with the compute nodes inside control-flow bodies, which quantization leaves in float
            "kept_fp32": len(e["kept_fp32"]) + len(e.get("unreached") or {}),
            "kept_fp32_nodes": {**e["reasons"], **(e.get("unreached") or {})},
            "kept_fp32_modules": e["kept_fp32_modules"],
            **(e.get("vs_fp32") or {}),
            "fallback_passed": e.get("fallback", {}).get("passed", True),
            **(_ort_cpu_summary(e["ort_cpu"]) if "ort_cpu" in e else {}),
            **({"reduce_range": True} if e.get("calibration", {}).get("reduce_range") else {}),
            **({"graph": e["graph"]} if "graph" in e else {}),
            **({"float_tables": tables} if tables and v == "int8" else {}),
            **{k: e[k] for k in ("unmade", "ort_cpu_unmade", "backend_paths") if e.get(k)},
            # the report says which engines an unmade graph leaves: the torch backend's need a PyTorch model
            **({"pytorch_model": True} if e.get("unmade") and torch_model_named(ctx.config.model) else {}),
        }
        for v, e in variants.items()
    }
    return PrecisionSummary(
        variants=summary,
        failed=failed,
        **node_report,
        calibration_cache=str(cache_dir / "calibration") if cache_dir else None,
    )


def reads_qdq(engines: Collection[str]) -> bool:
    """Whether any of ``engines`` (``build.graph_engines``) loads an INT8 variant's Q/DQ graph: every engine kind
    but ONNX Runtime CPU's, which loads its own graph (where one is made)."""
    return any(e != ORT_CPU_ENGINE for e in engines)


def warn_few_calibration_rows(
    log: logging.Logger, batches: list[Batch], ccfg: CalibrationConfig, variants: list[str], data: DatasetSplits
) -> None:
    """Warn where calibration reads fewer than :data:`FEW_ROWS` rows though more were asked (calibration.num_batches
    x batch_size): INT8/FP8 scales are the ranges those rows reach (FP16's range check, its float kept nodes), so a
    handful of samples decides them, as ``kiln precision`` warns of a short ``--calibration``."""
    got, asked = sum(batch_rows(b) for b in batches), ccfg.batch_size * ccfg.num_batches
    if got >= min(FEW_ROWS, asked):
        return
    scaled = "/".join(v.upper() for v in variants if v in ("int8", "fp8"))
    split = "training" if rows(data.train_x) else "held-out"  # the split dataset_batches draws from
    source, fix = (
        (f"calibration.reader {ccfg.reader} gave no more", "more batches from calibration.reader")
        if ccfg.reader
        else (
            f"the data's {split} split holds {rows(data.train_x) or rows(data.val_x)}",
            f"a larger {split} split (data.name)",
        )
    )
    log.warning(
        "calibration reads only %s (calibration.num_batches %d x batch_size %d = %d asked; %s): %s from that few "
        "samples. Give at least %d rows: %s",
        f"{got} row" if got == 1 else f"{got} rows",
        ccfg.num_batches,
        ccfg.batch_size,
        asked,
        source,
        f"{scaled} scales come" if scaled else "FP16's range check comes",
        FEW_ROWS,
        fix,
    )


def left_out(
    carried: Carried | None, wanted: list[str], converted: list[str], log: logging.Logger
) -> dict[str, KilnError]:
    """The ``converted`` variants a graph that carries a low precision of its own (:class:`Carried`) is not made
    into, each with why: beside a QAT model's INT8 variant, which is the graph as exported, the others (said at
    info, as the outcome asked for); beside an FP32 graph quantized or in float16 in part, every one but FP32 (a
    warning each, where a variant goes on; else the run's error says it). A graph already low in a precision
    ``wanted`` (precision.variants) leaves out is refused: every variant of it would be mislabelled."""
    if carried is None:
        return {}
    carried.refuse_without_low(wanted)
    left: dict[str, KilnError] = dict(carried.left_out(converted))
    if carried.low is not None and carried.low in converted:
        log.info(
            "%s: its %s variant is the graph as exported%s",
            carried.said,
            carried.low,
            f"; {', '.join(left)} left out (that {carried.low} graph, mislabelled)" if left else "",
        )
    elif set(converted) - set(left):
        for exc in left.values():
            log.warning("%s; the other variants go on", exc.message)
    return left


def save_samples(
    ctx: StageContext[PrecisionSettings], data: DatasetSplits, names: list[str], batches: list[Batch], lowbit: bool
) -> None:
    """The calibration batches as feeds for the torch backend (:mod:`kiln.calibration.feeds`), which compiles the
    PyTorch model itself: its FP8/INT8 engines calibrate on them (``lowbit``), and every engine's build runs the
    model on their rows, not on random inputs that can break what the model assumes of them (a box's ``x1 >= x0``).
    Saved wherever a PyTorch model is named: this stage is not told which backends build (a stage reads only the
    config it declares). Without a low-bit variant only the rows a build runs (the largest batch) are saved, taken
    from ``batches`` where the variants needed them, else from the dataset (no calibration.reader call); ``batches``
    itself, which the variants are made from, is not touched."""
    if lowbit:
        if batches:
            save_feeds(batches, names, ctx.out / FEEDS_FILE)
        return
    if not torch_model_named(ctx.config.model):
        return
    samples = batches or dataset_batches(data, ctx.config.calibration, ctx.config.seed, names)
    if samples:
        most = min(max(*ctx.config.signature.batch_sizes, 2), SAMPLE_ROWS)
        save_feeds(samples, names, ctx.out / FEEDS_FILE, max_rows=most)


SAMPLE_ROWS = 128  # at most, saved for the torch backend's own runs of the model (rows are taken in turn past it)


def build_variants(
    src: Source,
    root: Path,
    wanted: list[str],
    cfg: PrecisionConfig,
    ccfg: CalibrationConfig,
    x_val: Samples | GateCheck | None,
    progress: Progress,
    log: logging.Logger,
    sizes: dict[str, list[int]] | None = None,
    asked: Collection[str] | None = None,
    off_hint: str | None = None,
    required: Collection[str] | None = None,
    qdq_read: bool = True,
) -> tuple[dict[str, Any], dict[str, KilnError]]:
    """Each wanted variant into ``root/<precision>/model.onnx`` (FP32: ``src.path``, already there), judged by
    ``x_val`` (validation's check, or samples to check on); a variant that fails, that no fallback round got
    through the gates, or that is too little in its precision at the largest ``sizes`` of its dynamic axes (where
    the build audits its engines) is listed with why (variant -> message) and the others go on. A failure is
    logged when it happens only while another variant of ``asked`` (those the user asked for; None: ``wanted``)
    goes on: else the error the caller ends with is the one line that says it. It is logged as a warning where the
    variant is not made for its gates (:class:`NotMade`), as an error where its build failed (:func:`_log_dropped`).
    ``off_hint``: the fix for a variant no round passed while ``cfg.fallback`` is off (random inputs switch it off:
    real data is the fix there). ``required``: a run's precision.required, said beside a variant not made (None:
    outside a run, where the command's own error names it). ``qdq_read``: some engine loads the INT8 Q/DQ graph
    (False: ONNX Runtime CPU engines alone, :func:`~kiln.stages.precision.variants.build_int8`)."""
    if {"int8", "fp8"} & set(wanted):  # the Q/DQ variants keep what calibration.exclude_* name in float
        check_exclusions(src.model, ccfg)
    if "fp16" in wanted:  # a name fp16.fp32_nodes gives that the graph lacks would keep nothing in FP32
        check_fp32_nodes(src.model, cfg.fp16)
    largest = {k: max(v) for k, v in (sizes or {}).items() if v}
    hint = UNMADE_HINT if cfg.fallback.enabled else off_hint or FALLBACK_OFF_HINT
    variants: dict[str, Any] = {}
    failed: dict[str, KilnError] = {}
    with progress.task("precision variants", total=len(wanted)) as bar, round_notes(lambda n: bar.advance(0, n)):
        for precision in wanted:
            out = root / precision / "model.onnx"
            try:
                if precision == "fp32":
                    variants["fp32"] = {"path": "fp32/model.onnx", "kept_fp32": [], "reasons": {}}
                elif precision == "fp16":
                    variants["fp16"] = build_fp16(src, out, cfg.fp16, cfg.fallback, x_val, ccfg)
                elif precision == "fp8":
                    variants["fp8"] = build_fp8(src, out, ccfg, cfg.fallback, x_val)
                else:
                    variants["int8"] = build_int8(src, out, ccfg, cfg.fallback, x_val, qdq_read)
                unmade = not_made(precision, variants[precision])
                shapes = uncalibrated(x_val, precision, variants[precision], src.batches)
                if unmade is None:
                    if shapes and variants[precision].get("unmade"):
                        variants[precision]["unmade"] += f" ({shapes})"
                    mark_too_little(precision, variants[precision], root, largest, quantizable_op_types(ccfg))
                if unmade:
                    fix = QUANTIZED_NOTHING_HINT if _quantized_nothing(variants.pop(precision)) else hint
                    raise NotMade(unmade, hint=f"{shapes}; else {fix}" if shapes else fix)
            except KilnError as exc:  # one variant's failure must not take the others with it
                failed[precision] = outside(root, exc)
                if any(p != precision and p not in failed for p in (wanted if asked is None else asked)):
                    _log_dropped(log, precision, exc, required)
                shutil.rmtree(root / precision, ignore_errors=True)
            else:
                _log_variant(log, precision, variants[precision])
                _warn_slow_convs(log, root, precision, variants[precision])
            bar.advance(1, note=precision)
    return variants, failed


def _warn_slow_convs(log: logging.Logger, root: Path, precision: str, entry: dict[str, Any]) -> None:
    """Said once for an INT8 variant whose graph for ONNX Runtime CPU (its own, else the Q/DQ graph where that was
    made) quantizes 3-D convolutions (:func:`~kiln.core.cpu_int8.slow_integer_convs`): ORT's CPU QLinearConv has no
    fast path for them, so its engine likely runs slower than FP32, which validation would only say at the end.
    Nothing built changes. The fix it gives is precision.require_speedup, which drops that engine alone: excluding
    Conv from calibration takes INT8 from every backend, TensorRT's too, whose 3-D INT8 convolutions are fast."""
    path = (entry.get("backend_paths") or {}).get("onnxruntime-cpu") or (None if entry.get("unmade") else entry["path"])
    if precision != "int8" or path is None:
        return
    convs = slow_integer_convs(load_onnx(root / path, load_external_data=False))
    if convs:
        log.warning(
            "%s: %d 3-D convolution%s (%s) run in INT8 on ONNX Runtime CPU as QLinearConv, which has no fast path "
            "over 3 spatial dims: expect its ONNX Runtime CPU engine to run slower than FP32; set "
            "precision.require_speedup: true to leave an INT8 engine slower than FP32 out of the package (TensorRT's "
            "INT8 engines, fast on 3-D convolutions, stay); calibration.exclude_op_types: [Conv] would instead remove "
            "INT8 from every backend",
            *(precision, len(convs), "" if len(convs) == 1 else "s"),
            ", ".join(convs[:4]) + (", ..." if len(convs) > 4 else ""),
        )


def _log_dropped(log: logging.Logger, precision: str, exc: KilnError, required: Collection[str] | None) -> None:
    """A variant dropped while others go on, said when it happens: one not made for its gates as a warning, with
    what a run's ``required`` (precision.required; None: not a run) makes of it; an error of its build as an
    error."""
    if not isinstance(exc, NotMade):
        log.error("precision variant %s failed, the others go on: %s", precision, exc.message)
        return
    if required is None:
        then = ""
    elif precision in required:
        then = f", but precision.required lists {precision}: the run fails at validation without it"
    else:
        then = f", and so does the run ({precision} in precision.required would make it fail the run)"
    log.warning("%s; the other variants go on%s", exc.message, then)


def outside(root: Path, exc: KilnError) -> KilnError:
    """``exc`` with ``root`` left out of the paths its message quotes (ONNX Runtime's "Load model from <path>
    failed"): the variants are written into a staging folder that becomes the output folder only at the end, so its
    name is no path the user can open; ``int8/model.onnx`` is, inside the output folder."""
    for folder in dict.fromkeys([str(root), str(root.resolve())]):
        exc.message = exc.message.replace(folder + os.sep, "")
    exc.args = (exc.message,)
    return exc


def failure_hint(errors: dict[str, KilnError], otherwise: str) -> str:
    """One fix for the failed variants: each error's own fix (said once), then ``otherwise``."""
    hints = list(dict.fromkeys(e.hint for e in errors.values() if e.hint))
    return "; ".join([*hints, otherwise]) if hints else otherwise


TOO_LITTLE_HINT = (
    "where the fallback kept most of the compute in float to pass the gates, loosen validate.gates.per_precision for "
    "it if that accuracy is acceptable; where the compute is in op types it does not reach (named above), quantize "
    "them (calibration.op_types) if they can be, else drop it from the variants"
)
KEPT_HINT = (
    "the fallback kept most of the compute in float to pass the gates: loosen validate.gates.per_precision for it if "
    "that accuracy is acceptable, or drop it from the variants (fp16 keeps more of a model in low precision)"
)
UNMADE_HINT = (
    "loosen validate.gates.per_precision for it if that accuracy is acceptable, raise precision.fallback.max_rounds, "
    "or drop it from precision.variants"
)
QUANTIZED_NOTHING_HINT = (
    "no gate or fallback round decides it: the graph's compute is kept in float by the settings named above "
    "(calibration.keep_output_layers: off, calibration.exclude_*) or lies in op types the quantizer leaves in float "
    "(named above: rewrite them as MatMul/Conv layers, or add them to calibration.op_types if they can be "
    "quantized); else drop it from precision.variants"
)


def _quantized_nothing(entry: dict[str, Any]) -> bool:
    """Whether a variant was not made because calibration quantized nothing (its own graph's fallback record says
    :data:`~kiln.stages.precision.variants.QUANTIZED_NOTHING`): no gate was missed, so the gates' fix is no fix."""
    fallback = entry.get("fallback")
    return fallback is not None and "passed" in fallback and quantized_nothing(fallback)


FALLBACK_OFF_HINT = (
    "set precision.fallback.enabled: true (the accuracy-driven fallback keeps in float the nodes that miss the gates), "
    "loosen validate.gates.per_precision for it if that accuracy is acceptable, or drop it from precision.variants"
)
RANDOM_OFF = "on random inputs the accuracy-driven fallback, which keeps in float the nodes that miss the gates, is off"


FAILED_GATES = "failed its gates"  # a graph of a variant that is made, kept for inspection (not "not made")


def not_made(precision: str, entry: dict[str, Any]) -> str | None:
    """Why a variant is not made: no fallback round of its graph passed the gates its engines will face (an INT8
    variant whose ONNX Runtime CPU graph passed is made for ONNX Runtime CPU alone, the reverse keeps the Q/DQ graph
    for every backend). None: made. The graph of such a made variant that failed its gates stays in its folder for
    inspection, said so (:data:`FAILED_GATES`), not as a graph that was not made."""
    own, cpu = entry.get("fallback"), (entry.get("ort_cpu") or {}).get("fallback")
    if own is None:  # FP32: nothing to pass
        return None
    if cpu is not None and own["passed"] != cpu["passed"]:
        if own["passed"]:  # the ORT CPU graph missed: ORT CPU engines run the Q/DQ graph, which passed
            entry["ort_cpu_unmade"] = _why(precision + " (onnxruntime-cpu graph)", cpu, precision, FAILED_GATES)
            entry.pop("backend_paths", None)
        else:
            entry["unmade"] = _why(precision + " (Q/DQ graph)", own, precision, FAILED_GATES)
        return None
    return None if own["passed"] else _why(precision, own, precision)


def mark_too_little(
    precision: str, entry: dict[str, Any], root: Path, sizes: dict[str, int], quantized: Collection[str] = ()
) -> None:
    """A graph of the variant with under :data:`MIN_SHARE` of its FLOPs in ``precision`` (counted at ``sizes``, as
    the build audits its engines), because the fallback kept much in float or the precision covers few of the
    model's ops (ONNX Runtime CPU's INT8 leaves attention's matmuls in FP32; no runtime computes an LSTM in INT8 from
    Q/DQ): no engine read from it could be labelled ``precision``. ONNX Runtime CPU's own graph that is short is
    dropped (its engines then read the Q/DQ graph); a short Q/DQ graph is marked ``unmade``, so the engines that read
    it are not built, said with the share and its cause (:func:`too_little`; ``quantized``: the op types
    calibration quantizes), while those built from the PyTorch model (the torch backend) still are. The fix for
    the Q/DQ graph's cause goes to ``unmade_hint``."""
    if precision == "fp32" or "path" not in entry:
        return

    def short(label: str, path: Path, record: dict[str, Any]) -> tuple[str, str] | None:
        audit = audit_graph(path, sizes)
        share = audit.share().get(precision, 0.0)
        if share >= MIN_SHARE:
            return None
        why, hint = too_little(audit, precision, record["kept_fp32"], quantized, record.get("reasons"))
        counted = "FLOPs" if audit.total else "compute node runs"
        return (
            f"{label} not made: {share_under(share, MIN_SHARE)} of its {counted} run in {precision} ({why}), under "
            f"the {MIN_SHARE:.0%} an engine labelled {precision} must run (the precision audit)",
            hint,
        )

    cpu = entry.get("ort_cpu") or entry
    for backend, path in list((entry.get("backend_paths") or {}).items()):
        if found := short(f"{precision} ({backend} graph)", root / path, cpu):
            entry["ort_cpu_unmade"] = found[0]
            entry["backend_paths"].pop(backend)
            for file in (root / path, root / f"{path}.data"):  # no engine reads it, nothing lists it: not left behind
                file.unlink(missing_ok=True)
    if not entry.get("unmade"):
        label = f"{precision} (Q/DQ graph)" if entry.get("backend_paths") else precision
        if found := short(label, root / entry["path"], entry):
            entry["unmade"], entry["unmade_hint"] = found


def share_under(share: float, limit: float) -> str:
    """``share`` as a percentage that reads below ``limit`` where it is below it: whole percents, or one decimal
    cut (not rounded) where whole percents would print the limit itself (49.96% beside a 50% limit: 49.9%)."""
    said = f"{share:.0%}"
    if share >= limit or said != f"{limit:.0%}":
        return said
    return f"{math.floor(share * 1000) / 10:.1f}%"


def too_little(
    audit: Audit,
    precision: str,
    kept: list[str],
    quantized: Collection[str],
    reasons: Mapping[str, str] | None = None,
) -> tuple[str, str]:
    """Why a graph computes little in ``precision``, and the fix: the ``kept`` nodes where they hold most of the
    FLOPs left in float, said by who kept them (``reasons``, node -> why: the settings of calibration.exclude_* and
    keep_output_layers, whose fix is the setting, apart from the fallback's, kept to pass the gates), else the op
    types that do, said as ops no runtime computes in integers from Q/DQ (:data:`FLOAT_ONLY`: a GRU; an LSTM, which
    ONNX Runtime CPU's dynamically quantized graph computes in INT8: :data:`DYNAMIC_RECURRENT`), ops outside
    ``quantized`` (calibration.op_types), or ops the quantizer left in float."""
    held, by_op = audit.elsewhere(precision, kept)
    groups = kept_by(kept, reasons or {})
    kept_said = ", ".join(f"{_nodes(n)} {KEPT_SAID.get(g, f'excluded by {g}')}" for g, n in groups.items())
    kept_said = kept_said or "0 nodes kept in float"
    if not by_op or held >= sum(by_op.values()):
        return kept_said, _kept_hint(audit, precision, groups)
    ops = [op for op, _ in by_op.most_common()]
    carry = ", ".join(f"{op} {by_op[op] / audit.total:.0%}" for op in ops[:4])
    lowbit = precision in ("int8", "fp8")
    never = [op for op in ops if lowbit and op in FLOAT_ONLY]
    left_out = [op for op in ops if lowbit and quantized and op not in FLOAT_ONLY and op not in quantized]
    said = [f"{kept_said}; the FLOPs outside {precision} are in {carry}"]
    said_never, fixes, nowhere = _no_qdq_kernel(never, precision) if never else ([], [], [])
    said += said_never
    if left_out:
        said.append(f"{'/'.join(left_out)} {'is' if len(left_out) == 1 else 'are'} not in calibration.op_types")
        fixes.append(f"add {', '.join(left_out)} to calibration.op_types")
    if nowhere or not (left_out or fixes):
        fixes.append(
            f"drop {precision} from precision.variants for this model: {'/'.join(nowhere or ops[:2])} "
            f"cannot run in {precision}" + (" (on a GPU backend, fp16 keeps it in low precision)" if lowbit else "")
        )
    return "; ".join(said), "; or ".join(fixes)


FALLBACK, OTHER = "fallback", "other"  # kept_by's groups besides the settings it names
KEPT_SAID = {FALLBACK: "kept in float to pass the gates", OTHER: "kept in float (their reasons are in variants.json)"}
SETTING_FIX = {
    "calibration.exclude_first_last": "set calibration.exclude_first_last: false",
    "calibration.keep_output_layers": "set calibration.keep_output_layers: off",
}


def kept_by(kept: list[str], reasons: Mapping[str, str]) -> dict[str, list[str]]:
    """The ``kept`` nodes grouped by who kept them in float, from ``reasons`` (node -> why): the setting a reason
    names (``calibration.exclude_op_types``), :data:`FALLBACK` for the fallback's (its rounds', also where inherited
    from the Q/DQ graph; a node without a reason), :data:`OTHER` for the rest (ranges not finite, a Sin/Cos phase).
    A user's setting is no gate: saying its nodes were kept "to pass the gates" sends them to loosen gates none
    missed."""
    groups: dict[str, list[str]] = {}
    for node in kept:
        why = reasons.get(node, "fallback round")
        setting = re.search(r"calibration\.(?:exclude_\w+|keep_output_layers)", why)
        group = FALLBACK if "fallback round" in why else setting.group(0) if setting else OTHER
        groups.setdefault(group, []).append(node)
    return groups


def _nodes(nodes: list[str]) -> str:
    return f"{len(nodes)} node{'' if len(nodes) == 1 else 's'}"


def _kept_hint(audit: Audit, precision: str, groups: dict[str, list[str]]) -> str:
    """The fix for kept nodes that hold most of the FLOPs left in float: that of the group holding most of them
    (the fallback's: :data:`KEPT_HINT`; a setting's: take the nodes out of it)."""
    held = {g: audit.elsewhere(precision, n)[0] for g, n in groups.items()}
    top = max(held, key=held.__getitem__, default=FALLBACK)
    if top in (FALLBACK, OTHER):
        return KEPT_HINT
    fix = SETTING_FIX.get(top, f"take those nodes out of {top}")
    return (
        f"{top} keeps most of the compute in float, in every backend's {precision} graph: {fix} for an {precision} "
        f"engine (to drop only an {precision} engine that runs slower than FP32, set precision.require_speedup: true "
        f"instead), or drop {precision} from precision.variants"
    )


def _no_qdq_kernel(never: list[str], precision: str) -> tuple[list[str], list[str], list[str]]:
    """What is said of ``never``, the ops of :data:`FLOAT_ONLY` that carry FLOPs outside ``precision``, the fixes
    there are, and those of them no runtime computes in ``precision`` at all: ONNX Runtime CPU's own INT8 graph,
    dynamically quantized, computes an LSTM in INT8 (:data:`DYNAMIC_RECURRENT`); nothing computes a GRU, an RNN or
    a DFT in INT8."""
    dynamic = [op for op in never if precision == "int8" and op in DYNAMIC_RECURRENT]
    nowhere = [op for op in never if op not in dynamic]
    said = [
        f"no runtime computes {'/'.join(never)} in {precision} from Q/DQ (quantized, it runs on the dequantized "
        "values in float)"
    ]
    if precision == "int8" and set(nowhere) & RECURRENT:
        said.append("nor through ONNX Runtime's dynamic quantization, whose one int8 recurrent kernel is LSTM's")
    if dynamic:
        said.append(f"ONNX Runtime CPU computes {'/'.join(dynamic)} in int8 through dynamic quantization only")
    return said, [DYNAMIC_HINT.format(ops="/".join(dynamic))] if dynamic else [], nowhere


DYNAMIC_HINT = (
    "ONNX Runtime CPU engines run {ops} in int8 from their own graph, dynamically quantized (DynamicQuantizeLSTM: "
    "calibration.ort_cpu_graph true, calibration.ort_cpu_scheme auto or dynamic, {ops} not in "
    "calibration.exclude_op_types); for other backends drop int8 from precision.variants for this model"
)


def _why(label: str, fallback: dict[str, Any], precision: str, outcome: str = "not made") -> str:
    """The fallback's failure in a line: ``label`` and its ``outcome``, the gates missed, the nodes tried, and why
    the search stopped early where it did (rounds that kept more nodes in float without a measured gain); where
    the task metric's gate was missed, the setting that allows it in ``precision`` (:func:`_metric_allowance`)."""
    tried = fallback.get("tried") or []
    nodes = f"tried keeping {len(tried)} nodes in float ({', '.join(tried[:6])}{', ...' if len(tried) > 6 else ''})"
    stopped = [r["stopped"] for r in fallback.get("rounds") or [] if r.get("stopped")]
    failures = "; ".join(fallback.get("failures") or ["?"])
    allowance = _metric_allowance(precision, fallback)
    if "passed" in fallback and quantized_nothing(fallback):  # no graph of that precision to judge: no gate missed
        return f"{label} not made: {failures}"
    if fallback.get("not_searched"):  # checked once: no engine of the run reads it
        return f"{label} {outcome}: it misses the gates at round 0 ({failures}); {fallback['not_searched']}{allowance}"
    if fallback.get("enabled") is False:  # one graph, checked once: no round kept anything in float
        return (
            f"{label} {outcome}: it misses the gates its engines face ({failures}); the accuracy fallback is off"
            + allowance
        )
    return (
        f"{label} {outcome}: no fallback round passed the gates its engines face "
        f"({failures}); {nodes if tried else 'no node was tried in float'}"
        + "".join(f"; {s}" for s in stopped)
        + allowance
    )


def _metric_allowance(precision: str, fallback: dict[str, Any]) -> str:
    """Where the graph with every node in ``precision`` (round 0) missed the task metric's gate by a measured amount
    (its ``metric_gap``, a :class:`~kiln.stages.precision.fallback.MetricGap`'s fields), the setting that allows that
    drop: validate.gates.per_precision.<precision>.max_metric_drop, in the metric's own units (a relative metric's:
    a share of the reference's value). The default per-precision gates loosen the accuracy drop, not the metric's,
    so a drop too small to matter otherwise drops the variant with no setting named. Empty where the metric's gate
    was not missed or its drop is not finite."""
    rounds = fallback.get("rounds") or []
    record = rounds[0].get("metric_gap") if rounds else None
    gap = MetricGap(**record) if record else None
    if gap is None or not gap.missed:
        return ""
    relative = gap.said != "drop"
    units = "a share of the reference's value" if relative else f"in {gap.name}'s own units"
    others = len(rounds[0].get("failures") or []) > 1  # the metric's gate is one failure of round 0's
    allows = "would pass that gate, not the others it misses" if others else "allows it"
    return (
        f"; {gap.name}'s {gap.said} with every node in {precision} is {gap.drop:.4g} ({units}): "
        f"validate.gates.per_precision.{precision}.max_metric_drop: {_rounded_up(gap.drop)} {allows}, if that "
        f"{'rise' if relative else 'drop'} is acceptable"
    )


def _rounded_up(value: float) -> float:
    """``value`` rounded up to two significant digits: a limit that holds it, readable."""
    step = 10.0 ** (math.floor(math.log10(value)) - 1) if value > 0 else 1e-6
    return float(f"{math.ceil(value / step - 1e-9) * step:.2g}")


def held_out_check(
    ctx: StageContext[PrecisionSettings], data: DatasetSplits, src: Source, inputs: list[TensorSpec]
) -> GateCheck:
    """Validation's check on the FP32 graph's outputs: its held-out data at every validated shape, its labels and
    metric, its batch sizes and the gates of ``validate.gates``."""
    names = [i.name for i in inputs]
    sig, vcfg = ctx.config.signature, ctx.config.validate
    axes = validated_axes(ctx, inputs)
    feeds = held_out(data, lambda x: feed_for_graph(x, names), axes, sig.shapes, vcfg.max_samples)
    out_names = [o.name for o in src.model.graph.output]
    logits = out_names[src.logits] if src.logits is not None else None
    named = sig.logits_output is not None  # the user's class-logit output: held to top-1 agreement in any case
    run = refusing(session_runner(src.model), _reference_named(ctx), axes, feeds[-1][1])
    ref = held_out_reference(run, feeds, data, logits, vcfg, sig.batch_sizes, axes, named)
    return GateCheck(src.model, ref, vcfg.gates, sig.batch_sizes)


def without_futile_fallback(cfg: PrecisionConfig, check: GateCheck | None, log: logging.Logger) -> PrecisionConfig:
    """``cfg`` with the accuracy fallback off where the FP32 graph itself answers NaN/inf on held-out rows
    (:func:`fp32_nonfinite`), which is said once: every candidate graph is measured against the FP32 graph's
    outputs, and no node kept in float changes those, so each round would fail as the first did."""
    said = fp32_nonfinite(check) if check is not None and cfg.fallback.enabled else None
    if said is None:
        return cfg
    log.warning("precision: %s", said)
    return cfg.model_copy(update={"fallback": cfg.fallback.model_copy(update={"enabled": False})})


def fp32_nonfinite(check: GateCheck) -> str | None:
    """Where a gated float output of the FP32 graph holds NaN/inf on the held-out rows (padding left out, as the
    gates compare them): which output, at how many rows, the first of them and why the fallback does not search
    then; None where every such output is finite."""
    ref, gated = check.ref, check.gates.gated_outputs
    for point, feed, out in ((p, f, o) for (p, f), o in zip(ref.feeds, ref.outputs)):
        for name, a in ref.unpadded(feed, out).items():
            a = np.asarray(a)
            if (gated is not None and name not in gated) or a.dtype.kind != "f" or a.ndim < 1 or not a.size:
                continue
            bad = np.flatnonzero(nonfinite_rows(a))
            if bad.size:
                at = f" at {', '.join(f'{k}={v}' for k, v in point.items())}" if point else ""
                return (
                    f"the FP32 graph answers NaN/inf in output '{name}' at {bad.size} of {len(a)} held-out rows "
                    f"(first: {bad[0]}){at}; every lower-precision graph is measured against it, and no node kept "
                    f"in float changes the FP32 graph's own answer, so the accuracy fallback is not run; "
                    f"{REFERENCE_NAN_FIX}"
                )
    return None


def _reference_named(ctx: StageContext[PrecisionSettings]) -> str:
    """The FP32 graph as an error names it: the ONNX file a run starts from, as validation names its reference."""
    onnx_file = ctx.config.model.onnx
    return f"model.onnx {Path(onnx_file).name}" if onnx_file else "the exported FP32 graph (optimize/model.onnx)"


def validated_axes(ctx: StageContext[PrecisionSettings], inputs: list[TensorSpec]) -> Axes:
    """The dynamic axes validation varies: ``signature.dynamic_axes``; on a run from an ONNX file, those over the
    axes the graph names itself (:func:`~kiln.core.shapes.graph_axes_with`), so naming one axis leaves the file's
    other names in place."""
    axes = ctx.config.signature.dynamic_axes
    return (axes or {}) if torch_model_named(ctx.config.model) else graph_axes_with(axes, inputs)


def at_validated_shapes(batches: list[Batch], axes: Axes, sizes: dict[str, list[int]]) -> list[Batch]:
    """One calibration batch at each validated shape (:func:`kiln.core.shapes.shape_points` of ``sizes``) that no
    batch has, the batches taken in turn and resized as validation resizes the held-out data (cut, or grown by
    repeating the inputs' values along the axis): an activation whose range follows a
    dynamic axis (attention probabilities over 8 encoder steps are 4 times those over 32) then gets a scale that
    holds at every size the variant is judged and served at, not only at the data's own."""
    feeds = [b for b in batches if isinstance(b, dict)]
    if not axes or not feeds:
        return []
    had = [own_point(b, axes) for b in feeds]
    points = [p for p in shape_points(sizes) if p and not any(_within(p, h) for h in had)]
    return [resize(feeds[i % len(feeds)], axes, p, repeat_floats=True) for i, p in enumerate(points)]


def _within(point: dict[str, int], sizes: dict[str, int]) -> bool:
    """Whether ``sizes`` (a batch's) are those of ``point`` on every axis it names."""
    return all(sizes.get(k) == v for k, v in point.items())


def uncalibrated(
    check: Samples | GateCheck | None, precision: str, entry: dict[str, Any], batches: list[Batch]
) -> str | None:
    """Where the ``precision`` variant's Q/DQ graph misses its gates only at validated shapes that none of the
    calibration ``batches`` has (a user's reader at one length): said with the fix, since its activation scales were
    measured at other sizes. None otherwise."""
    own = entry.get("fallback")
    if precision not in ("int8", "fp8") or not isinstance(check, GateCheck) or own is None or own["passed"]:
        return None
    points = check.missed_at(own.get("failures") or [])
    had = [own_point(b, check.ref.axes) for b in batches if isinstance(b, dict)]
    if not points or any(_within(p, h) for p in points for h in had):
        return None
    at = "; ".join(", ".join(f"{k}={v}" for k, v in p.items()) for p in points)
    return (
        f"the {precision} Q/DQ graph misses the gates only at {at}, sizes its calibration data does not "
        "have: calibrate at those sizes too (a calibration.reader yielding batches at them), or narrow "
        "signature.shapes to sizes it was calibrated at"
    )


def _unconverted(precision: str, log: logging.Logger) -> dict[str, Any]:
    """A variant whose engines are all compiled from the PyTorch model: no graph of its own, the FP32 one stands
    in (the engines read their inputs and outputs from it)."""
    why = (
        f"not converted: the backends in build.backends build {precision} from the PyTorch model, not from an "
        "ONNX graph (add onnxruntime or tensorrt to build.backends for a converted graph)"
        if precision != "fp8"
        else "not converted: FP8 graphs (Q/DQ) are made for TensorRT (add tensorrt to build.backends); the torch "
        "backend compiles its FP8 engines from the PyTorch model"
    )
    log.info("%s: %s", precision, why)
    return {"path": "fp32/model.onnx", "kept_fp32": [], "reasons": {}, "graph": why}


def _axis_sizes(data: DatasetSplits, names: list[str], ctx: StageContext[PrecisionSettings]) -> dict[str, list[int]]:
    """The sizes of each dynamic axis besides batch the engines must take (build sizes its profiles by them)."""
    inputs = io_specs(load_onnx(ctx.inputs["optimize"] / "model.onnx", load_external_data=False))[0]
    axes = graph_axes_with(ctx.config.signature.dynamic_axes, inputs)
    if not axes:
        return {}
    feeds = [feed_for_graph(take(x, slice(0, 1)), names) for x in (data.train_x, data.val_x) if rows(x)]
    return axis_sizes(feeds, axes, ctx.config.signature.shapes)


def _ort_cpu_summary(ort: dict[str, Any]) -> dict[str, Any]:
    """The ORT CPU graph's own accuracy check: ORT CPU engines run it, not the Q/DQ graph."""
    return {
        "ort_cpu_scheme": ort["scheme"],
        **{
            f"ort_cpu_{k}": ort["vs_fp32"].get(k)
            for k in ("top1_agreement", "agreement", "cosine", "sample_cosine", "rel_err")
        },
        "ort_cpu_kept_fp32": len(ort["kept_fp32"]),
        "ort_cpu_fallback_passed": ort["fallback"]["passed"],
        "ort_cpu_kept_fp32_nodes": ort["reasons"],
        "ort_cpu_kept_fp32_modules": ort["kept_fp32_modules"],
    }


def _modules_of(nodes: list[str], modules: dict[str, str]) -> dict[str, str]:
    return {n: modules[n] for n in nodes if n in modules}


def _export_graph(ctx: StageContext[PrecisionSettings]) -> list[Any]:
    """The exported graph, for node metadata only: graph passes (onnx-graphsurgeon) drop the metadata that
    names each node's PyTorch module, while surviving nodes keep their names. Not an input of the stage: it
    only labels nodes in the report, and the optimized graph it precedes is."""
    path = ctx.workdir / "export" / "model.onnx"
    return [load_onnx(path, load_external_data=False)] if path.is_file() else []


def _node_error_report(
    ctx: StageContext[PrecisionSettings],
    src: Source,
    variants: dict[str, Any],
    x_val: Samples,
    modules: dict[str, str],
) -> dict[str, Any]:
    """Per-node error of each reduced-precision graph vs FP32 along the graph: a plot and the first node where
    each diverges. FP16 is judged on its emulation (ORT's CPU provider hides FP16 rounding, see emulate.py)."""
    graphs: dict[str, Any] = {}
    kept: dict[str, set[str]] = {}
    if "fp16" in variants:
        graphs["fp16"] = emulate_fp16(src.model, set(variants["fp16"]["kept_fp32"]))
        kept["fp16"] = set(variants["fp16"]["kept_fp32"])
    if "int8" in variants:
        graphs["int8"], kept["int8"] = ctx.out / variants["int8"]["path"], set(variants["int8"]["kept_fp32"])
        cpu_graph = (variants["int8"].get("backend_paths") or {}).get("onnxruntime-cpu")
        if cpu_graph:  # ONNX Runtime CPU's own graph, where it was made
            label = "int8 onnxruntime-cpu"
            graphs[label] = ctx.out / cpu_graph
            kept[label] = set(variants["int8"]["ort_cpu"]["kept_fp32"])
    try:
        order = graph_order(src.model)
        curves = node_error_curves(src.model, graphs, x_val)
        plot_node_errors(order, curves, ctx.out / "node_errors.png", kept)
    except Exception as exc:  # noqa: BLE001 - a diagnostic plot must never cost the variants already built
        ctx.log.warning("per-node error plot skipped: %s: %s", type(exc).__name__, exc)
        return {"node_errors_skipped": f"{type(exc).__name__}: {exc}"}
    first = {}
    for label, curve in curves.items():
        hit = first_divergence(order, curve)
        first[label] = hit and {**hit, "module": modules.get(hit["node"])}
    return {"node_error_plot": "node_errors.png", "first_divergence": first, "node_error_threshold": DIVERGENCE}


def _log_variant(log: logging.Logger, precision: str, entry: dict[str, Any]) -> None:
    vs = entry.get("vs_fp32") or {}
    inside = entry.get("unreached") or {}  # compute nodes in control-flow bodies: float, though no fallback kept them
    if vs:
        kept = len(entry["kept_fp32"]) + len(inside)
        log.info("%s vs FP32 graph: %s, %d nodes kept FP32", precision, vs_fp32_text(vs), kept)
    if inside:
        log.warning(
            "%s: %d compute nodes stay FP32 inside control-flow bodies, which quantization does not reach: %s",
            precision,
            len(inside),
            ", ".join(list(inside)[:4]) + (", ..." if len(inside) > 4 else ""),
        )
    if entry.get("unmade"):  # the graph at "path" stays in its folder, where kiln build refuses it
        # a Q/DQ graph no engine of the run reads, not searched: said, but nothing the user asked for is missing
        say = log.info if (entry.get("fallback") or {}).get("not_searched") else log.warning
        say(
            "%s; its graph is kept for inspection as %s beside variants.json, which lists it unmade: no engine is "
            "built from it",
            entry["unmade"],
            entry["path"],
        )
    if entry.get("ort_cpu_unmade"):
        log.warning("%s; %s", entry["ort_cpu_unmade"], ort_cpu_left(entry))


def variant_record(entry: dict[str, Any]) -> PrecisionVariant:
    """A variant's entry as the typed record; what only people read goes into ``report`` as plain JSON."""
    typed = {"path", "kept_fp32", "reasons", "backend_paths", "vs_fp32", "unmade"}
    report = json.loads(json.dumps({k: v for k, v in entry.items() if k not in typed}, default=_jsonable))
    return PrecisionVariant(
        **{k: v for k, v in entry.items() if k in typed},
        fallback_passed=entry.get("fallback", {}).get("passed", True),
        report=report,
    )


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    return str(obj)
