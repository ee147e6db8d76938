"""Run a configured list of passes over an ONNX model, with the safety net and a per-pass report."""

from __future__ import annotations

import json
import logging
import re
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import onnx

from kiln.core.artifacts import ensure_writable
from kiln.core.errors import ModelError
from kiln.core.graphsurgeon import gs
from kiln.core.inputs import check_batch_axis, named_sizes
from kiln.core.onnx_io import (
    check_onnx,
    check_tensor_io,
    index_ranges,
    infer_shapes,
    io_specs,
    load_onnx,
    metadata_value,
    save_onnx,
)
from kiln.core.records import IntRange, TensorSpec
from kiln.core.shapes import axis_names, graph_axes, shapes_flag
from kiln.core.text import short_reason
from kiln.stages.optimize.catalog import resolve
from kiln.stages.optimize.config import OptimizeConfig
from kiln.stages.optimize.gs_io import EmptyAttrs, export_graph, import_graph, refresh_shapes
from kiln.stages.optimize.verify import DataSizes, IntRanges, Verifier, drawn_ranges

log = logging.getLogger("kiln.optimize")


def histogram(model: onnx.ModelProto) -> Counter[str]:
    return Counter(n.op_type for n in model.graph.node)


def _delta(before: Counter[str], after: Counter[str]) -> dict[str, int]:
    return {op: after[op] - before[op] for op in sorted(set(before) | set(after)) if after[op] != before[op]}


def _export(graph: gs.Graph, like: onnx.ModelProto, empties: EmptyAttrs) -> onnx.ModelProto:
    out = export_graph(graph, empties)
    out.ir_version = like.ir_version
    out.producer_name, out.producer_version = like.producer_name, like.producer_version
    del out.metadata_props[:]
    out.metadata_props.extend(like.metadata_props)
    return out


def _apply(spec: Any, params: Any, model: onnx.ModelProto) -> tuple[onnx.ModelProto | None, int]:
    """Run one pass on a fresh graph of ``model``. (None, 0) when it matched nothing."""
    graph, empties = import_graph(model)
    changes = spec.fn(graph, params)
    if not changes:
        return None, 0
    graph.cleanup().toposort()
    return infer_shapes(_export(graph, model, empties), strict=False), changes


FIXED_SIZE_HINT = (
    "the graph fixes the size of an axis its inputs declare dynamic (a Reshape to constant sizes, as the TorchScript "
    "exporter writes one): re-export it with that axis static, or with the dynamo exporter; or set "
    "optimize.verify_batch to the one size it takes"
)


def unrunnable_hint(
    model: onnx.ModelProto, why: str, sizes: DataSizes | None, by_shapes: bool, int_ranges: IntRanges | None = None
) -> str:
    """The fix for a safety net that cannot run ``model`` on its random inputs, naming only the settings that
    change them: ``optimize.int_high`` where the graph has integer inputs it draws from [0, int_high] (not those
    drawn from a recorded range, :func:`~kiln.stages.optimize.verify.drawn_ranges`, which the fix names apart),
    ``signature.shapes`` for its named axes besides batch where the caller sizes them from it (``by_shapes``:
    ``kiln optimize FILE``), and ``optimize.verify_batch``, which sizes the batch and every axis ``sizes`` leaves
    out. An index past a table (ONNX Runtime's Gather "out of data bounds") is the integers' alone
    (:func:`_past_table_hint`). Inputs without a common batch axis come first (:func:`_no_batch_hint`)."""
    specs = io_specs(model)[0]
    no_batch = _no_batch_hint(specs)
    if no_batch:
        return no_batch
    if "cannot be reshaped" in why:
        named = axis_names(specs)
        if by_shapes and named:  # a size the model's own arithmetic refuses (time // 4 frames of 2) is likelier
            return f"give sizes the model takes on {_axes(named)}: {shapes_flag(named)}; or, if {FIXED_SIZE_HINT}"
        return FIXED_SIZE_HINT
    axes = graph_axes(specs)
    fixes = []
    integers = [s.name for s in specs if s.dtype.startswith(("int", "uint"))]
    if integers and any(m in why.lower() for m in _PAST_TABLE):
        return _past_table_hint(model, integers, int_ranges)
    ranged = [n for n in integers if n in drawn_ranges(model, int_ranges)]
    if _table_indices(model, [n for n in integers if n not in ranged]):
        fixes.append("set optimize.int_high below the smallest vocabulary / index range")
    named = axis_names(specs)
    if by_shapes and named:
        sized = f"give the sizes the model takes on {_axes(named)}: {shapes_flag(named)}"
        fixes.insert(0 if _SIZE_OPS.search(why) else len(fixes), sized)
    unsized = sorted({d for n, dims in axes.items() for a, d in dims.items() if a not in (sizes or {}).get(n, {})})
    takes = f"a size the batch and {_axes(unsized)} all take" if unsized else "a batch size the model takes"
    fixes.append(f"set optimize.verify_batch to {takes}")
    hint = "; or ".join([*fixes, "set optimize.verify: false to rewrite without checking"])
    if ranged:
        seen = any(n in (int_ranges or {}) for n in ranged)
        source = "the values the data holds, export/int_ranges.json" if seen else "the rows of the tables indexed"
        hint += f" (optimize.int_high does not change {', '.join(repr(n) for n in ranged)}: drawn from {source})"
    return hint


def _no_batch_hint(specs: list[TensorSpec]) -> str:
    """The fix where the graph's inputs have no common batch axis (a graph network's ``x [nodes, 16]`` beside
    ``edge_index [2, edges]``, :func:`kiln.core.inputs.check_batch_axis`): the safety net sizes every input's axis 0
    as the batch, so its random inputs pair sizes the graph cannot take, and no setting of the random draw (a lower
    ``optimize.int_high`` only checks a graph of a node or two) fixes that; the batch-of-one layout does. Empty where
    the inputs share a batch axis."""
    try:
        check_batch_axis(specs, "the graph")
    except ModelError as exc:
        return (
            f"{exc.message}, so the safety net's random inputs (batch on axis 0) pair sizes the graph cannot take: "
            f"{exc.hint}; or set optimize.verify: false to rewrite without checking"
        )
    return ""


# ONNX Runtime's error at an op that refuses an axis's size (a convolution or pooling window longer than the input)
_SIZE_OPS = re.compile(r"running \w*(Conv|Pool)\w* node")

# The ops that read positions given by their input 1 (indices)
_INDEX_OPS = frozenset({"Gather", "GatherElements", "GatherND", "ScatterElements", "ScatterND"})


def _table_indices(model: onnx.ModelProto, names: list[str]) -> set[str]:
    """The inputs of ``names`` whose values index a table: those :func:`kiln.core.onnx_io.index_ranges` gives a
    range, and those that reach, through any op but Shape/Size, the indices of an op reading a constant (an
    embedding's ids, doubled or offset on the way). An integer mask, whose values the graph sums or compares, is not
    one: a lower ``optimize.int_high`` does nothing for a model that fails on a size."""
    graph = model.graph
    consts = {i.name for i in graph.initializer} | {o for n in graph.node if n.op_type == "Constant" for o in n.output}
    producer = {o: n for n in graph.node for o in n.output}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for value in node.input:
            readers.setdefault(value, []).append(node)
    tables = index_ranges(model)
    return {n for n in names if n in tables or _reaches_table(n, readers, lambda v: _constant(v, consts, producer))}


def _reaches_table(start: str, readers: dict[str, list[onnx.NodeProto]], constant: Callable[[str], bool]) -> bool:
    """Whether the values of ``start`` reach, through any op but Shape/Size, the indices (input 1) of an op of
    :data:`_INDEX_OPS` whose data (input 0) is ``constant``."""
    reached, todo = {start}, [start]
    while todo:
        value = todo.pop()
        for node in readers.get(value, []):
            if node.op_type in _INDEX_OPS and node.input[1:2] == [value] and constant(node.input[0]):
                return True
            new = [] if node.op_type in {"Shape", "Size"} else [o for o in node.output if o and o not in reached]
            reached.update(new)
            todo.extend(new)
    return False


def _constant(name: str, consts: set[str], producer: dict[str, onnx.NodeProto]) -> bool:
    """Whether ``name`` is a constant of the graph, read through Cast, DequantizeLinear and Identity (an FP16 or INT8
    table)."""
    node = producer.get(name)
    while name not in consts and node is not None and node.op_type in {"Cast", "DequantizeLinear", "Identity"}:
        name = node.input[0]
        node = producer.get(name)
    return name in consts


def _axes(names: list[str]) -> str:
    return ("axes " if len(names) > 1 else "axis ") + ", ".join(f"'{n}'" for n in names)


# ONNX Runtime's errors for an index past the axis it reads (Gather and ScatterElements, GatherElements, GatherND)
_PAST_TABLE = ("out of data bounds", "out of range value in index tensor", "invalid index found")


def _past_table_hint(model: onnx.ModelProto, integers: list[str], int_ranges: IntRanges | None) -> str:
    """The fix for random ``integers`` that index past a table of ``model``: the batch size has no part in it. An
    input drawn from [0, int_high] takes a lower int_high. One drawn from the data's one range
    (export/int_ranges.json) whose fixed last axes the graph gives no range (an index computed in ways not
    followed) takes a rerun of the export, which records a range per column or cell. One the graph gives one range,
    the largest table's of those it packs, is kept whole by a rerun: Kiln ranges its tables one by one only where
    they are taken apart along one axis with every axis after it fixed (:func:`kiln.core.onnx_io.index_ranges`)."""
    drawn, tables = drawn_ranges(model, int_ranges), index_ranges(model)
    fixed = {s.name for s in io_specs(model)[0] if len(s.shape) >= 2 and isinstance(s.shape[-1], int)}
    free = [n for n in integers if n not in drawn]
    rerun = [n for n in integers if n in fixed and n not in tables and _one_range((int_ranges or {}).get(n))]
    packed = [n for n in integers if _one_range(tables.get(n))]
    fixes = [f"set optimize.int_high below the rows of the smallest table {_quoted(free)} index"] if free else []
    if rerun:
        fixes.append(
            f"rerun the export (kiln run --force export) to record the data's range of each column of {_quoted(rerun)} "
            "in export/int_ranges.json, one [low, high] per column"
        )
    if packed:
        fixes.append(
            f"where {_quoted(packed)} {'packs' if len(packed) == 1 else 'pack'} ids for tables of their own, Kiln "
            "ranges the tables one by one only where every axis after the one they are taken apart along is fixed "
            f"({packed[0]} [batch, tables, ids] read as {packed[0]}[:, i]): fix the size of those axes at export, or "
            "give one input per table"
        )
    fixes.append("set optimize.verify: false to rewrite without checking")
    drew = f"the integers the safety net drew for {_quoted(integers)} index past a table of the graph"
    return f"{drew}: " + "; or ".join(fixes)


def _one_range(bounds: IntRange | None) -> bool:
    """Whether ``bounds`` is one [low, high] over a whole input (not None, nor one per column or cell)."""
    return bool(bounds) and not isinstance(bounds[0], list)  # type: ignore[index]


def _quoted(names: list[str]) -> str:
    return ", ".join(f"'{n}'" for n in names)


def optimize_model(
    model: onnx.ModelProto,
    cfg: OptimizeConfig,
    data_sizes: DataSizes | None = None,
    int_ranges: IntRanges | None = None,
    by_shapes: bool = False,
) -> tuple[onnx.ModelProto, dict[str, Any]]:
    """Apply ``cfg.passes`` in order, in rounds to a fixpoint. With ``cfg.verify`` the result is run in ONNX Runtime
    against the original (on random inputs, dynamic axes at ``data_sizes`` and integers within ``int_ranges`` where
    the data gave them); when it differs, each pass is checked on its own, and a pass that changes the outputs (or
    crashes) is rolled back and reported by name. ``by_shapes``: ``data_sizes`` come from ``signature.shapes``,
    which the fix for a model the safety net cannot run then names."""
    t_start = time.perf_counter()
    plan = [resolve(e) for e in cfg.passes]
    current = onnx.ModelProto()
    current.CopyFrom(model)  # shape inference refreshes value_info: leave the caller's model untouched
    current = infer_shapes(current, strict=False)
    verifier = _safety_net(current, cfg, data_sizes, int_ranges, by_shapes) if cfg.verify else None
    fast, spent = _fast(plan, current, cfg.rounds, verifier)
    if fast is not None:
        current, passes, rounds, checks = fast
    else:  # a pass crashed or changed the outputs: every pass again, each checked, to name it and keep the others
        current, passes, rounds, checks = _careful(plan, current, cfg.rounds, verifier)
        checks += spent
    summary = {
        "nodes_before": len(model.graph.node),
        "nodes_after": len(current.graph.node),
        "ops_before": dict(histogram(model)),
        "ops_after": dict(histogram(current)),
        "verified": verifier is not None,
        "rounds": rounds,
        "checks": checks,
        "rolled_back": rolled_back(passes),
        "seconds": round(time.perf_counter() - t_start, 3),
        "passes": passes,
    }
    if verifier is not None and verifier.unrecorded:  # ship the graph as it was checked: ORT fails on those shapes
        del current.graph.value_info[:]
    _set_record(current, [spec.name for spec, _ in plan], summary["rolled_back"])
    return current, summary


def _safety_net(
    model: onnx.ModelProto,
    cfg: OptimizeConfig,
    data_sizes: DataSizes | None,
    int_ranges: IntRanges | None,
    by_shapes: bool,
) -> Verifier:
    """The :class:`Verifier` of ``model`` (which carries ONNX's inferred shapes). Where ONNX Runtime fails on those
    shapes but runs the graph without them, the net runs every graph without them (``unrecorded``): the inputs and
    the sizes are not at fault then. Where the graph fails either way, a :class:`ModelError` names the settings that
    change the random inputs (:func:`unrunnable_hint`)."""
    try:
        return Verifier(model, cfg, data_sizes, int_ranges)
    except Exception:  # noqa: BLE001 - ORT's own error types; the run without the inferred shapes decides
        pass
    try:
        verifier = Verifier(model, cfg, data_sizes, int_ranges, unrecorded=True)
    except Exception as exc:  # unverified rewrites must never ship silently: the user decides
        why = short_reason(exc)
        raise ModelError(
            f"the optimizer's safety net cannot run the input model on random inputs ({why})",
            hint=unrunnable_hint(model, why, data_sizes, by_shapes, int_ranges),
        ) from None
    log.info("optimize: ONNX Runtime fails on the graph's inferred shapes but runs it without them; checking so")
    return verifier


# The key of an optimized graph's own metadata (``metadata_props``) that says, as JSON, which passes made it and
# which the safety net undid: a later stage or command reading the file alone (the precision stage's advice on
# weights left unfolded) tells a graph never optimized from one whose folding was rolled back.
OPTIMIZE_RECORD_KEY = "kiln.optimize"


def _set_record(model: onnx.ModelProto, names: list[str], undone: list[str]) -> None:
    """Write :data:`OPTIMIZE_RECORD_KEY` into ``model`` (replacing the one an earlier optimization left)."""
    record = json.dumps({"passes": list(dict.fromkeys(names)), "rolled_back": undone})
    kept = [p for p in model.metadata_props if p.key != OPTIMIZE_RECORD_KEY]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    model.metadata_props.add(key=OPTIMIZE_RECORD_KEY, value=record)


def optimize_record(model: onnx.ModelProto) -> dict[str, list[str]] | None:
    """What :data:`OPTIMIZE_RECORD_KEY` says of ``model`` (``passes``, ``rolled_back``), or None where it has no
    readable record: a graph that did not come out of ``kiln optimize`` or the optimize stage."""
    text = metadata_value(model, OPTIMIZE_RECORD_KEY)
    try:
        record = json.loads(text) if text is not None else None
    except ValueError:
        return None
    if not isinstance(record, dict):
        return None
    return {k: [str(v) for v in record.get(k, []) if isinstance(v, str)] for k in ("passes", "rolled_back")}


def rolled_back(passes: list[dict[str, Any]]) -> list[str]:
    """The passes the safety net undid, by name in the order they ran, and the parts of passes it undid while
    keeping the rest (``fold_constants (onnx-graphsurgeon's folding)``)."""
    undone = (
        p["name"] if p["rolled_back"] else f"{p['name']} ({p['fallback']['left_out']})"
        for p in passes
        if p["rolled_back"] or "fallback" in p
    )
    return list(dict.fromkeys(undone))


Plan = list[tuple[Any, Any]]
Rounds = tuple[onnx.ModelProto, list[dict[str, Any]], int, int]  # model, pass entries, rounds, checks


def _fast(plan: Plan, start: onnx.ModelProto, max_rounds: int, verifier: Verifier | None) -> tuple[Rounds | None, int]:
    """Every round unchecked on one graph (:func:`_chained`), exported once, then the safety net once on the
    result: every check compares with the original model, so a result that matches it needs no other. (None,
    checks run) when a pass crashed or the result does not match: then :func:`_careful` finds the pass at fault."""
    graph, empties = import_graph(start)
    passes, rounds = [], 0
    for rounds in range(1, max_rounds + 1):  # to a fixpoint: a fusion can expose a fold an earlier pass missed
        size = len(graph.nodes)
        entries = _chained(plan, graph, empties)
        if entries is None:
            log.info("optimize: a pass crashed; running the passes one by one")
            return None, 0
        passes += [entry | {"round": rounds} for entry in entries]
        if len(graph.nodes) >= size:
            break
    changed = [e for e in passes if e["changes"]]
    if not changed:
        return (start, passes, rounds, 0), 0
    current = infer_shapes(_export(graph, start, empties), strict=False)
    if verifier is None:
        return (current, passes, rounds, 0), 0
    verdict = verifier.check(current)
    if not verdict.ok:
        log.info("optimize: the passes changed the outputs (%s); checking them one by one", verdict.reason)
        return None, 1
    for entry in changed:
        entry["max_abs_err"] = verdict.max_abs_err  # against the original model, after all the passes
    return (current, passes, rounds, 1), 1


def _careful(plan: Plan, start: onnx.ModelProto, max_rounds: int, verifier: Verifier | None) -> Rounds:
    """Every pass checked on its own (one export and one check per pass that changed the graph); a pass that
    crashes or changes the outputs is rolled back by name (or narrowed: :func:`_step_or_fallback`) and not tried
    again in later rounds."""
    current, passes, rounds = start, [], 0
    for rounds in range(1, max_rounds + 1):
        size = len(current.graph.node)
        entries, kept = [], []
        for spec, params in plan:
            current, entry, params = _step_or_fallback(spec, params, current, verifier)
            entries.append(entry)
            kept += [] if entry["rolled_back"] else [(spec, params)]
        passes += [entry | {"round": rounds} for entry in entries]
        plan = kept
        if len(current.graph.node) >= size:
            break
    checks = sum(("max_abs_err" in e) + ("max_abs_err" in e.get("fallback", {})) for e in passes)
    return current, passes, rounds, checks


def _step_or_fallback(
    spec: Any, params: Any, current: onnx.ModelProto, verifier: Verifier | None
) -> tuple[onnx.ModelProto, dict[str, Any], Any]:
    """:func:`_step`; where it rolls the pass back and the pass's params offer a narrower form of it (their
    ``fallback()``: (params, what they leave out), as fold_constants leaves onnx-graphsurgeon's folding out), that
    form is checked too, so one part that breaks the graph takes none of the rest down with it. Returns the model,
    the entry (the narrower run's, with the full run under ``fallback``) and the params later rounds run."""
    current, entry = _step(spec, params, current, verifier)
    offer = getattr(params, "fallback", None)
    narrower = offer() if entry["rolled_back"] and offer is not None else None
    if narrower is None:
        return current, entry, params
    weaker, left_out = narrower
    log.warning("optimize pass %s: running it again without %s", spec.name, left_out)
    current, retry = _step(spec, weaker, current, verifier)
    full = {k: entry[k] for k in ("params", "reason", "max_abs_err") if k in entry}
    return current, retry | {"fallback": full | {"left_out": left_out}}, weaker


def _chained(plan: Plan, graph: gs.Graph, empties: EmptyAttrs) -> list[dict[str, Any]] | None:
    """Every pass of ``plan`` on ``graph`` in place, unchecked: each pass's report entry, or None when a pass
    crashed. After a pass that changed the graph, its shapes are inferred again (:func:`refresh_shapes`): the next
    pass matches on them, as if the graph had been exported and re-read."""
    entries = []
    for spec, params in plan:
        t0 = time.perf_counter()
        before = Counter(n.op for n in graph.nodes)
        try:
            changes = spec.fn(graph, params)
            if changes:
                graph.cleanup().toposort()
                refresh_shapes(graph, empties)
        except Exception:
            log.debug("optimize pass %s crashed", spec.name, exc_info=True)
            return None
        after = Counter(n.op for n in graph.nodes) if changes else before
        entry = {"name": spec.name, "params": params.model_dump(), "nodes_before": before.total(), "changes": changes}
        entry |= {"rolled_back": False, "nodes_after": after.total(), "ops_delta": _delta(before, after)}
        entries.append(entry | {"seconds": round(time.perf_counter() - t0, 4)})
        _log_pass(entries[-1])
    return entries


def _step(
    spec: Any, params: Any, current: onnx.ModelProto, verifier: Verifier | None
) -> tuple[onnx.ModelProto, dict[str, Any]]:
    """One pass over ``current``, checked by the safety net when one is given: (the model to carry on with, its
    report entry)."""
    t0 = time.perf_counter()
    hist = histogram(current)
    entry: dict[str, Any] = {
        "name": spec.name,
        "params": params.model_dump(),
        "nodes_before": len(current.graph.node),
        "changes": 0,
        "rolled_back": False,
    }
    try:
        cand, entry["changes"] = _apply(spec, params, current)
    except Exception as exc:  # a crashing pass is a Kiln bug; ship the graph without it, say so loudly
        log.warning("optimize pass %s failed and was skipped: %s", spec.name, exc, exc_info=True)
        cand, entry["rolled_back"], entry["reason"] = None, True, f"{type(exc).__name__}: {short_reason(exc)}"
    if cand is not None and verifier is not None:
        verdict = verifier.check(cand)
        entry["max_abs_err"] = verdict.max_abs_err
        if not verdict.ok:
            log.warning(
                "optimize pass %s changed the model's outputs and was rolled back: %s", spec.name, verdict.reason
            )
            cand, entry["rolled_back"], entry["reason"] = None, True, verdict.reason
    if cand is not None:
        current = cand
    entry.update(
        nodes_after=len(current.graph.node),
        ops_delta=_delta(hist, histogram(current)),
        seconds=round(time.perf_counter() - t0, 4),
    )
    _log_pass(entry)
    return current, entry


def _log_pass(entry: dict[str, Any]) -> None:
    changed = entry["nodes_before"] != entry["nodes_after"] or entry["rolled_back"]
    log.log(
        logging.INFO if changed else logging.DEBUG,
        "pass %-26s nodes %4d -> %4d%s",
        entry["name"],
        entry["nodes_before"],
        entry["nodes_after"],
        "  ROLLED BACK" if entry["rolled_back"] else "",
    )


def _uses_external_data(path: Path) -> bool:
    shell = onnx.load(str(path), load_external_data=False)
    return any(t.data_location == onnx.TensorProto.EXTERNAL for t in shell.graph.initializer)


def optimize_file(
    src: Path, dst: Path, cfg: OptimizeConfig, axis_sizes: dict[str, list[int]] | None = None
) -> dict[str, Any]:
    """``kiln optimize src -o dst``: any ONNX file, including > 2 GB models whose weights live in external data
    (the result then keeps its weights in ``<dst>.data`` next to it). ``axis_sizes``: sizes of the graph's dynamic
    axes besides batch, by the names the graph gives them (``signature.shapes``, as ``kiln build FILE`` takes
    them), for the safety net's random inputs: a convolution over audio takes no input of ``verify_batch``
    samples."""
    src, dst = Path(src), Path(dst)
    model = load_onnx(src)
    check_tensor_io(model, str(src), sequence_outputs=True)  # its rewrites keep sequences of tensors, not maps
    ensure_writable(dst.parent, "the -o file's folder")
    external = _uses_external_data(src)
    sizes = named_sizes(io_specs(model)[0], axis_sizes or {})
    out, summary = optimize_model(model, cfg, sizes, by_shapes=True)
    if dst.resolve() == src.resolve():
        raise ModelError(f"refusing to overwrite the input model {src}", hint="choose another -o path")
    save_onnx(out, dst, external=external)
    check_onnx(dst, "optimized model")
    summary.update(src=str(src), dst=str(dst), external_data=external or (dst.with_name(dst.name + ".data")).exists())
    return summary


def checks_line(summary: dict[str, Any]) -> str:
    """One line on whether the result was checked against the input model, and which passes were undone: what
    ``kiln optimize -o`` prints under the file it wrote, so that an unchecked result is never silent."""
    rolled = summary["rolled_back"]
    undone = f"; rolled back: {', '.join(rolled)}" if rolled else ""
    if not summary["verified"]:
        return f"not verified (optimize.verify is off): outputs not compared with the input model's{undone}"
    checks = summary["checks"]
    if not checks:
        return f"nothing to verify: no pass changed the graph{undone}"
    runs = f"{checks} check{'s' if checks != 1 else ''}"
    return f"verified: outputs match the input model's on random inputs ({runs}){undone}"
