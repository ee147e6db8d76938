"""Run a configured list of passes over an ONNX model, with the safety net and a per-pass report."""

from __future__ import annotations

import logging
import time
from collections import Counter
from pathlib import Path
from typing import Any

import onnx
import onnx_graphsurgeon as gs

from kiln.core.artifacts import ensure_writable
from kiln.core.errors import ModelError
from kiln.core.onnx_io import check_onnx, infer_shapes, load_onnx, save_onnx
from kiln.core.text import short_reason
from kiln.stages.optimize.catalog import resolve
from kiln.stages.optimize.config import OptimizeConfig
from kiln.stages.optimize.gs_io import EmptyAttrs, export_graph, import_graph
from kiln.stages.optimize.verify import DataSizes, IntRanges, Verifier

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


def optimize_model(
    model: onnx.ModelProto,
    cfg: OptimizeConfig,
    data_sizes: DataSizes | None = None,
    int_ranges: IntRanges | None = None,
) -> tuple[onnx.ModelProto, dict[str, Any]]:
    """Apply ``cfg.passes`` in order. With ``cfg.verify`` each changed graph is run in ONNX Runtime against the
    original (on random inputs, dynamic axes at ``data_sizes`` and integers within ``int_ranges`` where the data
    gave them); a pass that changes the outputs (or crashes) is rolled back and reported by name."""
    t_start = time.perf_counter()
    plan = [resolve(e) for e in cfg.passes]
    current = onnx.ModelProto()
    current.CopyFrom(model)  # shape inference refreshes value_info: leave the caller's model untouched
    current = infer_shapes(current, strict=False)
    verifier = None
    if cfg.verify:
        try:
            verifier = Verifier(current, cfg, data_sizes, int_ranges)
        except Exception as exc:  # unverified rewrites must never ship silently: the user decides
            raise ModelError(
                f"the optimizer's safety net cannot run the input model on random inputs ({short_reason(exc)})",
                hint="set optimize.int_high below the smallest vocabulary / index range, or "
                "optimize.verify_batch to a size every dynamic axis accepts (all take that one "
                "size); or optimize.verify: false to rewrite without checking",
            ) from None
    passes: list[dict[str, Any]] = []
    rounds = 0
    for rounds in range(1, cfg.rounds + 1):  # to a fixpoint: a fusion can expose a fold an earlier pass missed
        size = len(current.graph.node)
        for spec, params in plan:
            current, entry = _step(spec, params, current, verifier)
            passes.append(entry | {"round": rounds})
        if len(current.graph.node) >= size:
            break
    summary = {
        "nodes_before": len(model.graph.node),
        "nodes_after": len(current.graph.node),
        "ops_before": dict(histogram(model)),
        "ops_after": dict(histogram(current)),
        "verified": verifier is not None,
        "rounds": rounds,
        "rolled_back": list(dict.fromkeys(p["name"] for p in passes if p["rolled_back"])),
        "seconds": round(time.perf_counter() - t_start, 3),
        "passes": passes,
    }
    return current, summary


def _step(
    spec: Any, params: Any, current: onnx.ModelProto, verifier: Verifier | None
) -> tuple[onnx.ModelProto, dict[str, Any]]:
    """One pass over ``current``, checked by the safety net: (the model to carry on with, its report entry)."""
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
    changed = entry["nodes_before"] != entry["nodes_after"] or entry["rolled_back"]
    log.log(
        logging.INFO if changed else logging.DEBUG,
        "pass %-26s nodes %4d -> %4d%s",
        spec.name,
        entry["nodes_before"],
        entry["nodes_after"],
        "  ROLLED BACK" if entry["rolled_back"] else "",
    )
    return current, entry


def _uses_external_data(path: Path) -> bool:
    shell = onnx.load(str(path), load_external_data=False)
    return any(t.data_location == onnx.TensorProto.EXTERNAL for t in shell.graph.initializer)


def optimize_file(src: Path, dst: Path, cfg: OptimizeConfig) -> dict[str, Any]:
    """``kiln optimize src -o dst``: any ONNX file, including > 2 GB models whose weights live in external data
    (the result then keeps its weights in ``<dst>.data`` next to it)."""
    src, dst = Path(src), Path(dst)
    model = load_onnx(src)
    ensure_writable(dst.parent, "the -o file's folder")
    external = _uses_external_data(src)
    out, summary = optimize_model(model, cfg)
    if dst.resolve() == src.resolve():
        raise ModelError(f"refusing to overwrite the input model {src}", hint="choose another -o path")
    save_onnx(out, dst, external=external)
    check_onnx(dst, "optimized model")
    summary.update(src=str(src), dst=str(dst), external_data=external or (dst.with_name(dst.name + ".data")).exists())
    return summary
