"""A ``model.onnx`` the user gives in place of an export: taken, checked and shape-inferred like an export (a
fixed batch axis freed once shown not to matter), and checked against the run before any stage runs it: the PyTorch
model's output names, and the data's indices against the tables the graph indexes."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnx
from torch import nn

from kiln.core.compare import within_tolerance
from kiln.core.data import DataContractError, DatasetSplits, Inputs, feed_for_graph, rows
from kiln.core.errors import KilnError, ModelError
from kiln.core.inputs import random_inputs
from kiln.core.onnx_io import (
    INDEX_HINT,
    check_onnx,
    check_tensor_io,
    fixed_batch,
    free_batch,
    infer_shapes,
    io_specs,
    load_onnx,
    ort_run,
    ort_session,
    outside_index,
    refuse_random_graph,
    save_onnx,
)
from kiln.core.random_ops import RANDOM_HINT
from kiln.core.text import first_line
from kiln.stages.export.declaration import ExportSummary
from kiln.stages.export.output_axes import runnable_inferred
from kiln.stages.export.parity import torch_outputs

log = logging.getLogger("kiln.export")


def take_onnx(
    src: Path,
    path: Path,
    axes: Mapping[str, Mapping[int, str]] | None = None,
    feed: dict[str, np.ndarray] | None = None,
) -> ExportSummary:
    """``model.onnx``: the user's file in place of an export, checked and shape-inferred like one. A file whose batch
    axis is a number (published files often fix it at 1) gets a symbolic one, once the graph is shown to compute the
    same rows at twice that batch (:func:`free_checked`): the batch sizes are the run's to choose. The axes ``axes``
    (``signature.dynamic_axes``) names take those names in the copy (:func:`name_axes`). A graph whose outputs are
    random draws is refused first (:func:`kiln.core.onnx_io.refuse_random_graph`): every check after would compare
    two runs of it and blame the batch, the precision or the engine. ``feed``: the data's first rows, on which the
    copy must run where the file does (:func:`runnable_inferred`: ONNX's inferred shapes can mislead ORT)."""
    proto = load_onnx(src)
    check_tensor_io(proto, f"model.onnx {src.name}")
    refuse_random_graph(proto, f"model.onnx {src.name}", hint=f"{RANDOM_HINT}; then export {src.name} again")
    fixed = fixed_batch(proto)
    proto = free_checked(proto, src, *fixed) if fixed else infer_shapes(proto, strict=False)
    proto = runnable_inferred(proto, feed, f"model.onnx {src.name}")
    name_axes(proto, axes or {}, src.name)
    save_onnx(proto, path)
    check_onnx(path, f"model.onnx {src.name}")
    inputs, outputs = io_specs(proto)
    log.info("took %s (%d nodes) instead of exporting", src, len(proto.graph.node))
    return ExportSummary(
        nodes=len(proto.graph.node),
        source=str(src),
        inputs=[i.name for i in inputs],
        outputs=[o.name for o in outputs],
        opset=max((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), default=0),
        freed_batch=fixed[0] if fixed else None,
    )


def name_axes(proto: onnx.ModelProto, axes: Mapping[str, Mapping[int, str]], shown: str) -> dict[str, str]:
    """Give each input axis besides the batch that ``axes`` (``signature.dynamic_axes``) names that name in
    ``proto``, and every other place of the file's old name for it (outputs, inferred values) where the old name
    gets one new name: the stages after the export size an axis by the name the graph gives it (an engine's
    profiles, its recorded ranges), and the config's names are those the user gave its sizes and will read in the
    report, so both must be the graph's. An axis the file fixes is left as it is (the run's check refuses it);
    an axis the file left unnamed gets its name. Returns the renames (old name -> new; ``''`` for unnamed)."""
    graph = proto.graph
    values = {v.name: v for v in graph.input}
    batch = {v.type.tensor_type.shape.dim[0].dim_param for v in graph.input if v.type.tensor_type.shape.dim}
    renames: dict[str, set[str]] = {}
    for name, dims in axes.items():
        shape = values[name].type.tensor_type.shape.dim if name in values else []
        for axis, label in dims.items():
            dim = shape[int(axis)] if 0 < int(axis) < len(shape) else None
            if dim is None or dim.HasField("dim_value") or dim.dim_param == label:
                continue
            renames.setdefault(dim.dim_param, set()).add(label)
            dim.dim_param = label
    elsewhere = {old: next(iter(new)) for old, new in renames.items() if old and old not in batch and len(new) == 1}
    for value in [*graph.input, *graph.output, *graph.value_info]:
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param in elsewhere:  # only there: setting dim_param clears a dim_value
                dim.dim_param = elsewhere[dim.dim_param]
    said = {old: ", ".join(sorted(new)) for old, new in renames.items()}
    if said:
        log.info(
            "model.onnx %s: input axes named as signature.dynamic_axes names them (%s)",
            shown,
            "; ".join(f"'{old}' -> '{new}'" if old else f"unnamed -> '{new}'" for old, new in said.items()),
        )
    return said


def free_checked(proto: onnx.ModelProto, src: Path, batch: int, example: str) -> onnx.ModelProto:
    """``proto`` with a symbolic batch axis (:func:`kiln.core.onnx_io.free_batch`), checked: two random batches of
    ``batch`` rows run through the file as it is, and as one batch through the freed graph, must give the same rows.
    Where they do not (a Reshape to a fixed ``[1, -1]``), a ModelError says to export it with a dynamic batch, the
    way of the exporter that wrote it (:func:`_dynamic_batch_hint`)."""
    inputs, _ = io_specs(proto)
    original = ort_session(src)
    parts = [
        random_inputs(inputs, batch, dynamic=8, seed=seed, hint="export it with a dynamic batch axis")
        for seed in (1, 2)
    ]
    want = [ort_run(original, part) for part in parts]
    freed = free_batch(proto, batch)
    hint = _dynamic_batch_hint(proto.producer_name)
    try:
        got = ort_run(ort_session(freed), {k: np.concatenate([p[k] for p in parts]) for k in parts[0]})
    except Exception as exc:  # ONNX Runtime's own error: a node that takes the fixed size only
        raise ModelError(
            f"model.onnx {src.name} fixes the batch at {batch} (input {example}) and does not run at batch "
            f"{2 * batch}: {first_line(exc)}",
            hint=hint,
        ) from None
    for (name, out), first, second in zip(enumerate(got), *want):
        ref = np.concatenate([first, second]) if first.ndim and len(first) == batch else first
        ok, _, why = within_tolerance(ref, out, atol=1e-5, rtol=1e-4)
        if not ok:
            raise ModelError(
                f"model.onnx {src.name} fixes the batch at {batch} (input {example}) and its graph depends on it: "
                f"at batch {2 * batch} output {proto.graph.output[name].name} {why}",
                hint=hint,
            )
    log.info(
        "model.onnx %s fixed the batch at %d: its batch axis is now symbolic (checked at %d)",
        src.name,
        batch,
        2 * batch,
    )
    return freed


# how each exporter, by the producer_name it writes into the file, makes the batch axis dynamic
_KERAS_WAY = "a None batch dimension in the Keras Input or the input_signature, tf.TensorSpec((None, ...))"
_DYNAMIC_BATCH = {
    "pytorch": "(torch.onnx.export(..., dynamic_axes={'<input>': {0: 'batch'}})), or let Kiln export it from PyTorch "
    "(model.name)",
    "tf2onnx": f"(tf2onnx: {_KERAS_WAY})",
    "keras2onnx": f"(keras2onnx: {_KERAS_WAY})",
    "skl2onnx": "(skl2onnx: initial_types=[('<input>', FloatTensorType([None, ...]))])",
}


def _dynamic_batch_hint(producer: str) -> str:
    """The fix for a file whose graph holds its fixed batch: export it again with a dynamic batch axis, the way of
    the exporter that wrote it (``producer``, the file's producer_name) where it is one Kiln knows (Kiln's own
    export takes PyTorch models alone), or take the file as it is with the direct commands, which feed a fixed
    batch one batch at a time."""
    producer = producer.strip()
    way = _DYNAMIC_BATCH.get(producer.lower()) or (f"from {producer}" if producer else "")
    again = " ".join(filter(None, ["export it again with a dynamic batch axis", way]))
    return f"{again}; kiln precision FILE, kiln build FILE and kiln validate ENGINE take the file as it is"


def refuse_other_output_names(model: nn.Module, x: Inputs, outputs: list[str], shown: str, name: str) -> None:
    """The PyTorch model ``name`` (validation's reference) against the outputs of the taken ``model.onnx`` (``shown``):
    validation compares outputs by name, so each of PyTorch's must be one of the file's. Told here, where the file
    is taken, with both lists: no export Kiln runs can rename the user's file. A model that fails on the data's
    first rows ``x`` is left to the stages that run it, which say why."""
    try:
        named = list(torch_outputs(model, x))
    except KilnError:
        raise
    except Exception as exc:  # the model's own error on the data: validation names it with its fix
        log.debug("outputs of model '%s' not compared with %s: %s", name, shown, first_line(exc))
        return
    missing = [n for n in named if n not in outputs]
    if not missing:
        return
    raise ModelError(
        f"model '{name}' returns outputs {named}, model.onnx {shown} has {outputs}: validation compares them by name "
        f"and finds no {missing} in the file",
        hint=_rename_hint(named, outputs, shown),
    )


def _rename_hint(named: list[str], outputs: list[str], shown: str) -> str:
    """The fix for outputs named apart: name the file's outputs as PyTorch's, or return a dict of the file's."""
    if len(named) == len(outputs) == 1:
        renamed = f"rename the output '{outputs[0]}' of {shown} to '{named[0]}'"
    else:
        renamed = f"name the outputs of {shown} {named}"
    keys = ", ".join(f"'{o}': ..." for o in outputs)
    return (
        f"{renamed} (torch.onnx.export(..., output_names={named})), or have forward return a dict with the file's "
        f"names, {{{keys}}}"
    )


def refuse_outside_index(data: DatasetSplits, path: Path, shown: str, name: str) -> None:
    """Each split of ``data`` (``name``: the data function) against the tables the taken graph at ``path`` (the
    user's ``shown``) indexes (:func:`kiln.core.onnx_io.outside_index`), before any stage runs it on them: ONNX
    Runtime would stop at a token id past an embedding's rows with a traceback naming a node, not the input. Data
    that do not fit the graph's inputs are left to the stages that run it, which say why."""
    graph = load_onnx(path, load_external_data=False)
    names = [i.name for i in io_specs(graph)[0]]
    for split, x in (("training", data.train_x), ("validation", data.val_x)):
        try:
            feed = feed_for_graph(x, names) if rows(x) else {}
        except KilnError:
            return
        why = outside_index(graph, feed, shown)
        if why is not None:
            raise DataContractError(f"the {split} data of '{name}': {why}", hint=INDEX_HINT)
