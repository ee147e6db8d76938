"""What the exported graph does with the data's inputs, checked once the export has made it.

A forward that takes ``**kwargs`` (nearly every ``transformers`` model) accepts any dict key of the data, so
:func:`kiln.core.data.check_forward_takes` cannot tell an ignored key from a used one; the graph can. An input no
node reads (a BERT tokenizer's ``token_type_ids`` beside a DistilBERT), or reads only for the sizes another input
has too (a CLIPModel's, through the Shape the dynamo exporter takes its batch size with), is still an input of
every engine, and a label among the inputs (Hugging Face's ``labels``) turns the model into a loss: a scalar no
engine can answer per sample.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping

import onnx

from kiln.core.data import DataContractError
from kiln.core.labels import is_label_name, is_loss_name

log = logging.getLogger("kiln.export")


# Ops that read only their input's shape, never its values: an input read only by these changes no output but
# the sizes its axes give (the dynamo exporter takes the batch size from whichever input carries it, read or not)
SHAPE_OPS = frozenset({"Shape", "Size"})


def _read(node: onnx.NodeProto, values: bool = False) -> Iterator[str]:
    """The values ``node`` reads: its inputs and, for If/Loop/Scan, those its subgraphs read (outer-scope names);
    with ``values``, only those whose contents it reads (not the input of a Shape or Size)."""
    if not (values and node.op_type in SHAPE_OPS):
        yield from node.input
    for attr in node.attribute:
        for graph in [attr.g] if attr.HasField("g") else list(attr.graphs):
            for inner in graph.node:
                yield from _read(inner, values)
            yield from (o.name for o in graph.output)


def unused_inputs(graph: onnx.GraphProto) -> list[str]:
    """The graph's inputs that no node reads and no output is: inputs of the engine that change nothing."""
    read = {name for node in graph.node for name in _read(node)} | {o.name for o in graph.output}
    return [i.name for i in graph.input if i.name not in read]


def unread_inputs(graph: onnx.GraphProto) -> list[str]:
    """The graph's inputs whose values no node reads and no output is: :func:`unused_inputs`, and those read only
    by Shape or Size nodes whose every axis is fixed or named like an axis of an input whose values are read (the
    dynamo exporter takes the batch size from any input that has it): their values change nothing, and their sizes
    come with another input. One whose shape alone carries a size (a length no other input has) is read."""
    read = {name for node in graph.node for name in _read(node, values=True)} | {o.name for o in graph.output}
    tied = {d for i in graph.input if i.name in read for d in _dims(i) if isinstance(d, str)}
    unused = set(unused_inputs(graph))
    return [
        i.name
        for i in graph.input
        if i.name in unused or (i.name not in read and all(isinstance(d, int) or d in tied for d in _dims(i)))
    ]


def _dims(value: onnx.ValueInfoProto) -> list[int | str | None]:
    """A value's axes: a fixed size, a name, or None (a size neither fixed nor named)."""
    return [d.dim_value or d.dim_param or None for d in value.type.tensor_type.shape.dim]


def warn_unused_inputs(graph: onnx.GraphProto) -> list[str]:
    """One warning naming the inputs whose values the graph never reads (:func:`unread_inputs`; one read only for
    its shape is said so): each engine still declares them, so every client would send a tensor that changes
    nothing. Returns them; the graph keeps them (its sizes may come from one of them)."""
    unread, unused = unread_inputs(graph), set(unused_inputs(graph))
    if unread:
        said = ", ".join(f"'{n}'" + ("" if n in unused else " (only its shape is read)") for n in unread)
        log.warning(
            "the model never reads input%s %s: the exported graph and every engine still take %s, so each client "
            "must send %s; drop %s from the data's inputs (the keys of x the data function returns)",
            "s" if len(unread) > 1 else "",
            said,
            "them" if len(unread) > 1 else "it",
            "them" if len(unread) > 1 else "it",
            ", ".join(f"'{n}'" for n in unread),
        )
    return unread


def _reached_from(graph: onnx.GraphProto, start: str, values: bool = False) -> set[str]:
    """The values computed from ``start`` (the graph's nodes are in topological order, as the checker requires);
    with ``values``, only from its values (not through the Shape or Size that reads its sizes alone)."""
    reached = {start}
    for node in graph.node:
        if any(name in reached for name in _read(node, values)):
            reached.update(node.output)
    return reached


def _loss_label(graph: onnx.GraphProto, name: str, unbatched: Mapping[str, tuple[int, ...]]) -> str | None:
    """The scalar loss (:func:`kiln.core.labels.is_loss_name`, 0-d) computed from the values of input ``name``
    where no output with a batch axis is (``unbatched``: the outputs without one, by shape): a model returns such an
    output only from its labels. None where there is none."""
    reached = _reached_from(graph, name, values=True)
    if any(o.name in reached and o.name not in unbatched for o in graph.output):
        return None
    return next((o for o, shape in unbatched.items() if o in reached and not shape and is_loss_name(o)), None)


def _label_output(graph: onnx.GraphProto, name: str, unbatched: Mapping[str, tuple[int, ...]]) -> str | None:
    """The output without a batch axis (``unbatched``) that makes input ``name`` the labels: one computed from it
    where it is named like labels (:func:`kiln.core.labels.is_label_name`), else :func:`_loss_label`."""
    if is_label_name(name):
        reached = _reached_from(graph, name)
        return next((o.name for o in graph.output if o.name in reached and o.name in unbatched), None)
    return _loss_label(graph, name, unbatched)


def refuse_label_outputs(graph: onnx.GraphProto, shapes: Mapping[str, tuple[int, ...]], batch: int) -> None:
    """A DataContractError where an output without a batch axis (a scalar, or a first axis other than the
    ``batch`` rows of the example it came out of: ``shapes``) is computed from labels among the inputs: an input
    named like labels, or one whose values only a scalar ``loss`` is computed from (Hugging Face's forecasters'
    ``future_values`` by any name). The data puts its labels among the model's inputs, and the model returns its
    loss. An engine answers one row per sample, and its clients have no labels to send; outputs without a batch
    axis are otherwise served unbatched."""
    unbatched = {o.name: shapes[o.name] for o in graph.output if shapes.get(o.name, (batch,))[:1] != (batch,)}
    if not unbatched:
        return
    named = sorted(graph.input, key=lambda i: not is_label_name(i.name))  # labels by name first, as they were
    for label in (i.name for i in named):
        out = _label_output(graph, label, unbatched)
        if out is None:
            continue
        shape = unbatched[out]
        what = "a scalar" if not shape else f"shaped {list(shape)} at a batch of {batch}, with no batch axis"
        raise DataContractError(
            f"the model's output '{out}' is {what}, computed from its input '{label}' (a loss): an engine "
            "answers one row per sample, and its clients have no labels to send",
            hint=f"keep '{label}' out of the data's inputs (x): return the labels as y (train_y/val_y), from "
            "which training computes the loss (train.loss); or return only per-sample outputs from forward",
        )
