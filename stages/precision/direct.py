"""``kiln precision model.onnx -o out/``: FP16/INT8 variants of any ONNX file, no workdir and no PyTorch model.

Calibration and the fallback's accuracy check read ``--calibration data.npz`` (one array per model input, rows
along axis 0). Without it, both would run on random inputs: calibration then warns loudly, and the
accuracy-driven fallback is switched off, because random data must never decide what passes. As in a run, the
data is calibrated at its own sizes and, one batch each, at every other shape of the sizes recorded for the build
(``signature.shapes``), and each variant is judged at every one of those shapes: an engine built from a variant
takes those sizes, so none of them goes unjudged.

A variant that fails does not take the others with it: those made are written, and the summary carries the error
the command ends with (:func:`missing_error`). One whose graph is too little in its precision keeps that graph for
inspection, listed in ``variants.json`` as not made (``unmade``), as a run lists it, so ``kiln build`` refuses it.
Only when none of the variants asked for is made is nothing written.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from kiln.calibration.data import Batch, batch_limit, batch_rows, split_batches
from kiln.core.errors import InputFileError, KilnError, ModelError
from kiln.core.feeds import fixed_batch, in_batches, read_feed
from kiln.core.inputs import random_inputs
from kiln.core.onnx_io import INDEX_HINT, check_tensor_io, index_ranges, io_specs, load_onnx, outside_index
from kiln.core.progress import SilentProgress
from kiln.core.records import IntRange, TensorSpec, Variants
from kiln.core.shapes import Axes, axis_names, graph_axes, refuse_unknown_axes, resize, shape_points, shapes_flag
from kiln.stages.accuracy.check import Reference, direct_top1, own_point
from kiln.stages.accuracy.refusal import refusing
from kiln.stages.precision.audit import refuse_low_precision
from kiln.stages.precision.gate import GateCheck, session_runner
from kiln.stages.precision.stage import (
    FEW_ROWS,
    RANDOM_OFF,
    TOO_LITTLE_HINT,
    PrecisionSettings,
    at_validated_shapes,
    build_variants,
    failure_hint,
    variant_record,
)
from kiln.stages.precision.tables import float_tables_hint
from kiln.stages.precision.variants import Source, carried_precision

log = logging.getLogger("kiln.precision")
RANDOM_OFF_HINT = f"give real inputs, --calibration FILE.npz (one array per input): {RANDOM_OFF}"
# Why the FP32 variant is written though --variants did not ask for it
BASELINE = (
    "not asked for: your model with its nodes named, the baseline the variants were calibrated and checked against; "
    "`kiln build` of a variant probes its sizes with it where the variant does not run on the CPU"
)


def precision_direct(
    src: Path, out: Path, variants: list[str], calibration: Path | None, cfg: PrecisionSettings
) -> dict[str, Any]:
    """Write ``out/<precision>/model.onnx`` for each variant and ``out/variants.json``; returns a summary. ``fp32``
    is written too, asked for or not (its summary entry then says why, :data:`BASELINE`): the graph the variants
    are measured against, which ``kiln build`` of a variant reads beside it."""
    graph = load_onnx(src)
    check_tensor_io(graph, str(src))
    refuse_low_precision(graph, str(src), "kiln precision")
    carried = carried_precision(graph)  # quantized or float16 in part: every variant but FP32 is left out
    inputs, outputs = io_specs(graph)
    ccfg, pcfg = cfg.calibration, cfg.precision.model_copy(deep=True)
    if calibration is not None:
        data = read_feed(calibration, inputs, "the model", batched=True)
        _refuse_outside_index(graph, data, calibration, src)
        _refuse_tied_mismatch(inputs, data, calibration)
        source = f"{calibration} ({len(next(iter(data.values())))} rows)"
    else:
        data = _random(inputs, cfg, index_ranges(graph))
        pcfg.fallback.enabled = False
        source = "RANDOM inputs"
        calibrated = sorted(set(variants) & {"int8", "fp8"})  # FP16 takes no ranges: only its fallback needs data
        log.warning(
            "no --calibration: %s on RANDOM inputs%s and the accuracy-driven fallback is off. Give --calibration "
            "data.npz (one array per input: %s)",
            "calibrating" if calibrated else "checking the variants",
            f"; {'/'.join(v.upper() for v in calibrated)} ranges will not match real data" if calibrated else "",
            ", ".join(i.name for i in inputs),
        )
    sizes, axes = recorded_sizes(inputs, data, cfg.signature.shapes), graph_axes(inputs)
    limit = batch_limit(cfg.signature.batch_sizes, inputs, outputs)  # at most the rows one call reads
    batches = _calibration_batches(data, inputs, ccfg.batch_size, ccfg.num_batches, limit)
    if calibration is not None:
        _warn_few_rows(batches, calibration, variants, min(FEW_ROWS, ccfg.batch_size * ccfg.num_batches))
    batches += at_validated_shapes(batches, axes, sizes)
    x_val = _whole_batches(data, inputs, pcfg.fallback.samples)  # the fallback's check runs them batch by batch
    names = [o.name for o in outputs]
    logits = direct_top1(names, cfg.signature.logits_output)
    wanted = list(dict.fromkeys(["fp32", *variants]))  # the FP32 graph is what calibration and the gates measure
    left: dict[str, KilnError] = dict(carried.left_out(wanted)) if carried is not None else {}
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kiln-precision-") as tmp:
        source_graph = Source.prepare(
            graph,
            out / "fp32" / "model.onnx",
            batches,
            out.parent / ".kiln-cache" if ccfg.cache else Path(tmp),
            names.index(logits) if logits is not None else None,
        )
        shown = (src.name, "--calibration" if calibration is not None else "random")
        check = shapes_check(source_graph.model, x_val, axes, sizes, logits, cfg, shown)
        off = None if calibration is not None else RANDOM_OFF_HINT
        built, failed = build_variants(
            source_graph,
            out,
            [p for p in wanted if p not in left],
            pcfg,
            ccfg,
            check,
            SilentProgress(),
            log,
            sizes,
            variants,
            off,
        )
        tables = float_tables_hint(source_graph.model, ccfg) if "int8" in built else None
        if tables:
            log.warning(tables)
    failed = {**left, **failed}
    for name, entry in built.items():  # no graph of it any engine can read: not made, here
        if entry.get("unmade") and not entry.get("backend_paths"):
            failed[name] = ModelError(entry["unmade"], hint=entry.get("unmade_hint", TOO_LITTLE_HINT))
    made = [k for k in built if k not in failed]
    if not set(variants) & set(made):  # none of those asked for: the FP32 copy alone is no answer
        raise ModelError(
            "precision variants failed: " + "; ".join(f"{p}: {e.message}" for p, e in failed.items()),
            hint=failure_hint(failed, "or drop the variant from --variants"),
        )
    # listed as not made, as a run lists it: `kiln build` refuses the graph its folder keeps for inspection
    Variants(variants={k: variant_record(v) for k, v in built.items()}, axis_sizes=sizes).write(out / "variants.json")
    return {
        "calibration": source,
        "variants": {
            k: _shown(out, built[k])
            | ({"baseline": BASELINE} if k not in variants else {})
            | ({"float_tables": tables} if tables and k == "int8" else {})
            for k in made
        },
        "failed": {k: e.message for k, e in failed.items()},
        "missing": missing_error(failed, made),
    }


def shapes_check(
    model: onnx.ModelProto,
    x_val: dict[str, np.ndarray],
    axes: Axes,
    sizes: dict[str, list[int]],
    logits: str | None,
    cfg: PrecisionSettings,
    shown: tuple[str, str],
) -> GateCheck:
    """The check variants are judged by: ``x_val`` resized to every shape of ``sizes``
    (:func:`kiln.core.shapes.shape_points`, the largest last) as a run resizes its held-out data, the FP32 ``model``
    run on each (a shape it cannot run is one error: :func:`kiln.stages.accuracy.refusal.reference_error`, naming
    the file and the inputs of ``shown``, and the rows' own sizes where they were resized), and ``validate.gates``;
    in batches of up to 64 rows and no more than :func:`~kiln.calibration.data.batch_limit` (the largest
    signature.batch_sizes, the rows one call reads), or of the batch the graph fixes."""
    feeds = [(p, resize(x_val, axes, p, repeat_floats=True)) for p in shape_points(sizes)]
    run = refusing(session_runner(model), shown[0], axes, feeds[-1][1], shown[1], own_point(x_val, axes))
    specs, outs = io_specs(model)
    most = batch_limit(cfg.signature.batch_sizes, specs, outs)[0]
    batch = fixed_batch(specs) or min(64, most, len(next(iter(x_val.values()))))
    ref = Reference(run, feeds, [None] * len(feeds), logits, batch, axes=axes)
    return GateCheck(model, ref, cfg.validate.gates, [batch])


def _calibration_batches(
    data: dict[str, np.ndarray], inputs: list[TensorSpec], size: int, count: int, limit: tuple[int, str]
) -> list[Batch]:
    """The first ``size * count`` rows of ``data`` in batches of ``size`` rows, or of the batch the graph fixes
    (:func:`~kiln.core.feeds.fixed_batch`; it takes no other), so as many rows calibrate either way; batches of
    a dynamic batch axis hold no more than ``limit`` (:func:`~kiln.calibration.data.batch_limit`), which the
    rows then fill in more batches."""
    fixed = fixed_batch(inputs)
    batches: list[Batch] = list(in_batches(_whole_batches(data, inputs, size * count), fixed or size))
    return batches if fixed is not None else split_batches(batches, *limit)


def _whole_batches(data: dict[str, np.ndarray], inputs: list[TensorSpec], rows: int) -> dict[str, np.ndarray]:
    """The first ``rows`` rows of ``data``, cut to whole batches where the graph fixes its batch axis (at least one
    batch)."""
    b = fixed_batch(inputs)
    kept = rows if b is None else max(b, rows - rows % b)
    return {k: v[:kept] for k, v in data.items()}


def missing_error(failed: dict[str, KilnError], made: list[str]) -> ModelError | None:
    """The error the command ends with, once the variants it made are written, where some asked for failed: a
    script that goes on to build ``out/int8`` must not be told all went well. None: every one was made."""
    if not failed:
        return None
    why = "; ".join(f"{p} failed: {e.message}" for p, e in failed.items())
    return ModelError(
        f"precision variant{'s' if len(failed) > 1 else ''} {why} (the others were written: {', '.join(made)})",
        hint=failure_hint(failed, "or drop the variant from --variants"),
    )


def _shown(out: Path, entry: dict[str, Any]) -> dict[str, Any]:
    """A made variant as the command reports it: the graph its engines run, its nodes kept in float and its
    accuracy, and for a variant whose Q/DQ graph was not made, the one backend whose own graph was (only its engines
    are built)."""
    only = entry.get("backend_paths") if entry.get("unmade") else None
    graph = entry["ort_cpu"] if only else entry
    return {
        "path": str(out / (next(iter(only.values())) if only else entry["path"])),
        # with the compute nodes inside control-flow bodies, which quantization leaves in float
        "kept_fp32": len(graph["kept_fp32"]) + len(entry.get("unreached") or {}),
        "only": next(iter(only)) if only else None,
        **(graph.get("vs_fp32") or {}),
    }


def recorded_sizes(
    inputs: list[TensorSpec], data: dict[str, np.ndarray], shapes: dict[str, list[int]]
) -> dict[str, list[int]]:
    """Each dynamic axis besides batch -> the sizes ``variants.json`` records for the build (its profiles, audit,
    and the ranges ``kiln build`` probes): those ``signature.shapes`` gives, else the one size the data holds."""
    seen = {d: [int(data[s.name].shape[i])] for s in inputs for i, d in (graph_axes([s]).get(s.name) or {}).items()}
    refuse_unknown_axes(shapes, sorted(seen))
    return {d: sorted(set(shapes.get(d) or v)) for d, v in seen.items()}


def _warn_few_rows(batches: list[Batch], calibration: Path, variants: list[str], few: int) -> None:
    """Warn where the calibration ``batches`` made of ``--calibration`` hold fewer than ``few`` rows (each batch
    no larger than the rows one call reads, so every row counted is one the model reads): INT8/FP8 scales are the
    ranges those rows reach, and the variants are judged on the same rows, so a handful of samples decides both."""
    rows = sum(batch_rows(b) for b in batches)
    if rows < few:
        scaled = "/".join(v.upper() for v in variants if v in ("int8", "fp8"))
        log.warning(
            "--calibration %s holds only %s: %s from that few samples. Give at least %d rows (up to "
            "calibration.batch_size x num_batches rows calibrate)",
            calibration,
            f"{rows} row" if rows == 1 else f"{rows} rows",
            f"{scaled} scales and the variants' accuracy check come"
            if scaled
            else "the variants' accuracy check comes",
            few,
        )


def _refuse_outside_index(graph: Any, data: dict[str, np.ndarray], calibration: Path, src: Path) -> None:
    """Calibration data whose indices run past a table of the graph (:func:`kiln.core.onnx_io.outside_index`):
    refused before calibration and the accuracy gates feed them to ONNX Runtime, which would stop with a traceback."""
    why = outside_index(graph, data, src.name, counted_from_end=False)  # as `kiln build` records its ranges
    if why is not None:
        raise InputFileError(f"--calibration {calibration}: {why}", hint=INDEX_HINT)


def _refuse_tied_mismatch(inputs: list[TensorSpec], data: dict[str, np.ndarray], calibration: Path) -> None:
    """Calibration arrays at one size on each axis the graph names alike (:func:`kiln.core.shapes.graph_axes`): the
    graph takes such axes at one size, so ONNX Runtime would stop mid-calibration with a traceback."""
    seen: dict[str, tuple[str, int]] = {}  # axis name -> (input, size) first seen
    for name, axes in graph_axes(inputs).items():
        for axis, dim in axes.items():
            size = int(data[name].shape[axis])
            first, had = seen.setdefault(dim, (name, size))
            if had != size:
                which = (
                    f"input '{name}' differs on its axes" if first == name else f"inputs '{first}' and '{name}' differ"
                )
                raise InputFileError(
                    f"--calibration {calibration}: {which} on axis {dim} ({had} against {size}); the model "
                    "takes them at one size",
                    hint=f"give every array of {calibration} one size on axis {dim} (pad or cut them to match)",
                )


def _random(inputs: list[TensorSpec], cfg: PrecisionSettings, ids: dict[str, IntRange]) -> dict[str, np.ndarray]:
    """Random calibration inputs; ``ids``: integer inputs drawn over the rows of the table each indexes."""
    sizes = [max(v) for v in cfg.signature.shapes.values() if v]
    names = axis_names(inputs)
    hint = "give --calibration data.npz" + (f", or {shapes_flag(names)} to size the dynamic axes" if names else "")
    rows = min(cfg.calibration.batch_size * cfg.calibration.num_batches, 256)
    return random_inputs(inputs, batch=rows, dynamic=max(sizes) if sizes else None, hint=hint, int_ranges=ids)
