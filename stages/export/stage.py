"""Export stage: the trained PyTorch model to ONNX with a dynamic batch axis, checked and shape-inferred,
and proven to compute the same function (ONNX Runtime vs PyTorch on held-out data).

This module runs the stage (:func:`run`) and ``kiln export -o`` (:func:`export_direct`); the export and each check
they run live in the modules beside it."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kiln.core.artifacts import ensure_writable
from kiln.core.data import feed_for_graph, fixed_columns, integer_ranges, rows, take
from kiln.core.errors import KilnError
from kiln.core.onnx_io import index_ranges, io_specs, load_onnx, refuse_random_graph
from kiln.core.shapes import graph_axes
from kiln.core.stage import StageContext
from kiln.models.determinism import built_layout, module_layout, refuse_changed_layout, refuse_random
from kiln.models.model_io import (
    load_trained,
    load_weights,
    on_random_inputs,
    random_axis_size,
    read_state_dict,
    torch_model_named,
)
from kiln.models.registry import build_model
from kiln.stages.export.batch_axes import tie_batch_axes
from kiln.stages.export.declaration import (
    AXIS_STEPS,
    DYNAMIC_SIZES,
    INT_RANGES,
    ExportSettings,
    ExportSummary,
    check_dynamic_batch,
)
from kiln.stages.export.input_specs import direct_example, example_source, parse_input_shapes
from kiln.stages.export.model_checks import refuse_nothing_finite, warn_wide_inputs
from kiln.stages.export.onnx_file import refuse_other_output_names, refuse_outside_index, take_onnx
from kiln.stages.export.other_axes import tie_other_axes
from kiln.stages.export.output_axes import name_output_axes
from kiln.stages.export.parity import PARITY_ROWS, batch_parity, exported_session, require_parity, warn_empty_masks
from kiln.stages.export.size_steps import GraphAt, record_graph_steps, size_steps, steps_over
from kiln.stages.export.sizes import (
    TorchRefs,
    check_sizes_of,
    check_validated_sizes,
    checked_spans,
    export_at_sizes,
)
from kiln.stages.export.torch_export import export_with_fallback, input_axes

log = logging.getLogger("kiln.export")


def _data_feed(ctx: StageContext[ExportSettings], path: Path) -> tuple[dict[str, Any] | None, str]:
    """The data's first two held-out rows as a feed of the graph at ``path``, the one the taken file is checked and
    probed with; None and why where they do not fit it."""
    names = [i.name for i in io_specs(load_onnx(path, load_external_data=False))[0]]
    try:
        return feed_for_graph(take(ctx.dataset().val_x, slice(0, 2)), names), ""
    except KilnError as exc:
        return None, exc.message


def _probe_taken(feed: dict[str, Any] | None, why: str, path: Path) -> dict[str, dict[int, str]]:
    """:func:`name_output_axes` on a taken ``model.onnx`` at ``path``, with ``feed`` (the data's first held-out rows:
    :func:`_data_feed`), over the axes the file declares dynamic under the file's own names (a two-tower model's
    ``texts`` and ``images`` are probed apart, and its outputs keep them); nothing where the data does not fit the
    file (``why``; the stages that run it say more)."""
    if feed is None:
        log.info("output axes of %s not probed: %s", path.name, why)
        return {}
    inputs, _ = io_specs(load_onnx(path, load_external_data=False))
    # axes named apart by their exporter that the graph takes at one size: one axis (both ties run)
    if tie_batch_axes(path, feed) | tie_other_axes(path, feed):
        inputs, _ = io_specs(load_onnx(path, load_external_data=False))
    axes = {s.name: {0: str(s.shape[0])} for s in inputs if s.shape and isinstance(s.shape[0], str)}
    for name, dims in graph_axes(inputs).items():
        axes.setdefault(name, {}).update(dims)
    return name_output_axes(path, feed, axes)


def _taken_sizes(
    ctx: StageContext[ExportSettings], path: Path, feed: dict[str, Any] | None
) -> dict[str, dict[int, list[int]]]:
    """:data:`DYNAMIC_SIZES` of a taken ``model.onnx`` at ``path``, written as an export writes it: the sizes the
    data gives each dynamic axis besides batch the file declares (:func:`dynamic_sizes`), at which the optimizer's
    safety net draws its random inputs. Axes tied by an offset (a decoder step's total_sequence_length =
    past_sequence_length + 1) meet only at the data's sizes. Nothing where the data does not fit the file
    (``feed`` None: :func:`_data_feed`)."""
    if feed is None:
        return {}
    inputs, _ = io_specs(load_onnx(path, load_external_data=False))
    axes = {n: {a: d for a, d in dims.items() if a < feed[n].ndim} for n, dims in graph_axes(inputs).items()}
    names = [s.name for s in inputs]
    sizes = dynamic_sizes(ctx.dataset(), names, {n: dims for n, dims in axes.items() if dims})
    if sizes:
        (ctx.out / DYNAMIC_SIZES).write_text(json.dumps(sizes, indent=2, sort_keys=True) + "\n")
    return sizes


def run(ctx: StageContext[ExportSettings]) -> ExportSummary:
    cfg = ctx.config.export
    if ctx.config.model.onnx:
        if on_random_inputs(ctx.config.model, ctx.config.data):  # said now, not after optimize
            specs, _ = io_specs(load_onnx(ctx.config.model.onnx, load_external_data=False))
            random_axis_size(Path(ctx.config.model.onnx), specs, ctx.config.signature)
        src = Path(ctx.config.model.onnx)
        feed, why = _data_feed(ctx, src)
        summary = take_onnx(src, ctx.out / "model.onnx", ctx.config.signature.dynamic_axes, feed)
        if not on_random_inputs(ctx.config.model, ctx.config.data):
            refuse_outside_index(ctx.dataset(), ctx.out / "model.onnx", src.name, ctx.config.data.name or "the data")
        if torch_model_named(ctx.config.model) and "train" in ctx.inputs:
            model = load_trained(ctx.inputs["train"], ctx.config.model)
            example = take(ctx.dataset().val_x, slice(0, 2))
            refuse_other_output_names(
                model, example, summary.outputs, Path(ctx.config.model.onnx).name, ctx.config.model.name
            )
        followed = _probe_taken(feed, why, ctx.out / "model.onnx")
        random = on_random_inputs(ctx.config.model, ctx.config.data)  # sizes drawn, not the data's
        sizes = {} if random else _taken_sizes(ctx, ctx.out / "model.onnx", feed)
        return summary.model_copy(update={"output_axes": followed, "dynamic_sizes": sizes})
    check_dynamic_batch(ctx.config)  # checked before training too; here for a stage run on its own
    model = load_trained(ctx.inputs["train"], ctx.config.model)
    data = ctx.dataset()
    path = ctx.out / "model.onnx"
    axes = ctx.config.signature.dynamic_axes
    example, x = take(data.val_x, slice(0, 2)), take(data.val_x, slice(0, PARITY_ROWS))
    layout = built_layout(ctx.config.model.name, ctx.config.model.params)  # a model that rebuilds itself when run
    refuse_random(model, example)
    refuse_changed_layout(layout, model)  # said now, not after the export's minutes
    warn_wide_inputs(model, example)
    refs: TorchRefs = {}  # PyTorch at the size check's sizes, run before the export and not again after
    proto, dynamo = export_at_sizes(model, example, path, cfg.opset, data, axes, ctx.config.signature.shapes, refs)
    refuse_random_graph(proto, f"the exported graph {path.name}")  # draws too small for refuse_random to see
    session = exported_session(path, dynamo)  # for the parity check and the output-axis probe
    check = batch_parity(model, path, example, x, cfg.parity_atol, session, cfg.parity_rtol, dynamo)
    require_parity(check, cfg.parity_atol, cfg.parity_rtol, f"{path.name}, on the data's first {check['samples']} rows")
    warn_empty_masks(model, session, x)
    log.info(
        "exported %d nodes, opset %d, parity max abs err %.2e",
        len(proto.graph.node),
        proto.opset_import[0].version,
        check["max_abs_err"],
    )
    names = [i.name for i in proto.graph.input]
    shapes, atol, rtol = ctx.config.signature.shapes, cfg.parity_atol, cfg.parity_rtol
    check_validated_sizes(model, path, session, data, names, axes or {}, shapes, atol, rtol, dynamo, refs)
    steps = size_steps(model, data, names, axes or {}, shapes, GraphAt(path, session, atol, rtol))
    refuse_changed_layout(layout, model)  # after the last forward of the export
    if steps:
        (ctx.out / AXIS_STEPS).write_text(json.dumps(steps, indent=2, sort_keys=True) + "\n")
    feed = feed_for_graph(take(data.val_x, slice(0, 2)), names)
    followed = name_output_axes(path, feed, input_axes(names, cfg.dynamic_batch, axes or {}), session)
    record_graph_steps(path, steps)  # the file carries them too, for `kiln build` of it outside the run
    sizes = dynamic_sizes(data, names, axes)
    if sizes:
        (ctx.out / DYNAMIC_SIZES).write_text(json.dumps(sizes, indent=2, sort_keys=True) + "\n")
    ranges = integer_ranges(data, names, fixed_columns(io_specs(proto)[0], index_ranges(proto)))  # packed: per column
    if ranges:
        (ctx.out / INT_RANGES).write_text(json.dumps(ranges, indent=2, sort_keys=True) + "\n")
    return ExportSummary(
        nodes=len(proto.graph.node),
        opset=max(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")),
        parity=check,
        dynamic_sizes=sizes,
        int_ranges=ranges,
        axis_steps=steps,
        output_axes=followed,
    )


def dynamic_sizes(
    data: Any, names: list[str], axes: Mapping[str, Mapping[int, str]]
) -> dict[str, dict[int, list[int]]]:
    """Input name -> axis -> [smallest, largest] size in the data, for each axis of ``signature.dynamic_axes``:
    sizes the model is known to take, for the optimizer's safety net (its random inputs)."""
    feeds = [feed_for_graph(take(x, slice(0, 1)), names) for x in (data.train_x, data.val_x) if rows(x)]
    if not feeds:
        return {}
    seen = {name: {int(a): [f[name].shape[int(a)] for f in feeds] for a in dims} for name, dims in axes.items()}
    return {name: {a: [min(v), max(v)] for a, v in dims.items()} for name, dims in seen.items()}


# ------------------------------------------------------------------------ direct mode: `kiln export -o model.onnx`
def export_direct(
    cfg: ExportSettings, checkpoint: str | None, input_shapes: tuple[str, ...], output: Path
) -> dict[str, Any]:
    """Export ``cfg.model`` to ``output`` without a workdir. The example inputs are ``input_shapes``
    (``--input-shape``, random arrays of those shapes) or the first rows of the configured data; a model that takes
    neither is a ConfigError asking for each input's shape. The graph is checked as the pipeline checks it: at
    another batch, and at other sizes of ``signature.dynamic_axes`` (:func:`check_sizes_of`), so a graph that holds
    the example's length (a Python loop unrolled to it) is an error, not a file declaring that axis dynamic. Across
    the sizes checked, the graph is then held to PyTorch size by size (:func:`steps_over`): where it is right at some
    steps only (a branch on the size the exporter fixed), that is warned of, and the steps are written into the
    file's metadata (:func:`record_graph_steps`) and returned as ``axis_steps``."""
    ensure_writable(output.parent, "the -o file's folder")  # before minutes of work, not after
    specs = parse_input_shapes(input_shapes) if input_shapes else None
    model = build_model(cfg.model.name, cfg.model.params)
    given = "--checkpoint" if checkpoint else "model.checkpoint"  # what a missing file's message names
    checkpoint = checkpoint or cfg.model.checkpoint  # --checkpoint wins over the config's model.checkpoint
    if checkpoint:
        load_weights(model, read_state_dict(Path(checkpoint), given), checkpoint)
    else:
        log.warning(
            "exporting '%s' with its initial weights: no --checkpoint and no model.checkpoint given", cfg.model.name
        )
    model.eval()
    x = direct_example(cfg, model, specs)
    example = take(x, slice(0, 2))  # traced with two rows, like the pipeline's export
    layout = module_layout(model)  # before its first forward: a model that rebuilds itself when run is refused
    refuse_random(model, example)
    refuse_nothing_finite(model, x if cfg.export.dynamic_batch else example, example_source(specs), bool(specs))
    proto, dynamo = export_with_fallback(
        model, example, output, cfg.export.opset, cfg.export.dynamic_batch, cfg.signature.dynamic_axes
    )
    refuse_random_graph(proto, f"the exported graph {output.name}")  # draws too small for refuse_random to see
    atol, rtol = cfg.export.parity_atol, cfg.export.parity_rtol
    session = exported_session(output, dynamo)
    # at another batch too: a graph that holds the traced one gets those rows right; a fixed batch at its own only
    checked = x if cfg.export.dynamic_batch else example
    check = batch_parity(model, output, example, checked, atol, session, rtol, dynamo)
    random = (
        "random inputs can be far from what the model meets (masks, ids): give the config's data instead of "
        "--input-shape; "
        if specs
        else ""
    )
    # held to the tolerance the pipeline holds it to
    require_parity(check, atol, rtol, f"{output.name}, on {example_source(specs)}", random)
    warn_empty_masks(model, session, checked)
    steps: dict[str, list[int]] = {}
    names = [i.name for i in proto.graph.input]
    if cfg.signature.dynamic_axes:
        on = x if cfg.export.dynamic_batch else example  # a fixed batch takes the traced rows only
        seen = [feed_for_graph(take(on, slice(0, 1)), names)]
        feed, axes = feed_for_graph(on, names), dict(cfg.signature.dynamic_axes)
        shapes = cfg.signature.shapes
        points = check_sizes_of(
            model, output, session, on, feed, seen, axes, shapes, atol, rtol, direct=True, dynamo=dynamo
        )
        one = take(on, slice(0, 1)) if cfg.export.dynamic_batch else on
        sizes = checked_spans(feed, axes, points)
        steps = steps_over(model, one, example, names, axes, sizes, GraphAt(output, session, atol, rtol))
    followed = _direct_output_axes(output, feed_for_graph(example, names), cfg, session)
    record_graph_steps(output, steps)
    refuse_changed_layout(layout, model)  # after the last forward of the export
    return {
        "path": str(output),
        "nodes": len(proto.graph.node),
        **check,
        "axis_steps": steps,
        "output_axes": followed,
    }


def _direct_output_axes(
    path: Path, feed: dict[str, Any], cfg: ExportSettings, session: Any
) -> dict[str, dict[int, str]]:
    """:func:`name_output_axes` on ``kiln export -o``'s file, as the pipeline's export runs it: output axes that
    follow a dynamic input axis but were exported at a fixed size or under a symbol of the exporter's own (a
    time-major output's steps, a 3-D U-Net's depth) are declared by that axis's name, probed on ``feed`` (the
    example's rows), so the file says what an engine built from it takes. Nothing where no axis is dynamic."""
    if not cfg.export.dynamic_batch and not cfg.signature.dynamic_axes:
        return {}
    axes = input_axes(list(feed), cfg.export.dynamic_batch, cfg.signature.dynamic_axes or {})
    return name_output_axes(path, feed, axes, session)
