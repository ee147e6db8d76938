"""Sequences: ``SplitToSequence`` read only at constant positions becomes one ``Split``.

The dynamo exporter writes ``torch.split`` / ``Tensor.split`` (a `transformers` GPT-2's query/key/value split) as
``SplitToSequence`` followed by ``SequenceAt`` per piece. TensorRT's ONNX parser has no sequence ops, so such a model
built no TensorRT engine at all; ``Split`` computes the same pieces as plain tensors.
"""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel

from kiln.core.lazy import lazy_import
from kiln.stages.optimize.passes.util import const, drop, known_shape, new_const, node_name, replace_uses, unique_name
from kiln.stages.optimize.registry import register

gs = lazy_import("onnx_graphsurgeon")  # loaded when a pass first runs, not when the config is read


def _sizes(node: gs.Node, dim: int | str) -> tuple[list[int], bool] | None:
    """The pieces' sizes along the axis and whether they are squeezed, for constant or absent ``split``."""
    split = const(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1].name else None
    if split is None:
        if len(node.inputs) > 1 and node.inputs[1].name:
            return None  # a split computed at run time
        if not isinstance(dim, int):
            return None
        return [1] * dim, int(node.attrs.get("keepdims", 1)) == 0  # one piece per element; keepdims applies
    if split.ndim == 0:  # pieces of this size, the last one shorter
        if not isinstance(dim, int) or int(split) <= 0:
            return None
        whole, rest = divmod(dim, int(split))
        return [int(split)] * whole + ([rest] if rest else []), False
    return [int(v) for v in split.ravel()], False


@register("split_to_sequence")
def split_to_sequence(graph: gs.Graph, p: BaseModel) -> int:
    """SplitToSequence read only by SequenceAt at constant positions -> one Split (TensorRT has no sequence ops)."""
    if graph.opset < 13:  # Split and Squeeze take their sizes and axes as inputs from opset 13 on
        return 0
    n = 0
    for node in list(graph.nodes):
        if node.op != "SplitToSequence" or not node.outputs or node.outputs[0] in graph.outputs:
            continue
        readers = list(node.outputs[0].outputs)
        shape = known_shape(node.inputs[0])
        if not readers or any(r.op != "SequenceAt" for r in readers) or shape is None:
            continue
        axis = int(node.attrs.get("axis", 0)) % len(shape)
        found = _sizes(node, shape[axis])
        positions = [const(r.inputs[1]) for r in readers]
        if found is None or any(pos is None for pos in positions):
            continue
        sizes, squeeze = found
        picks = [int(pos) + (len(sizes) if int(pos) < 0 else 0) for pos in positions]
        if not all(0 <= i < len(sizes) for i in picks):
            continue  # out of range: ONNX Runtime's error to give, not ours to hide
        x = node.inputs[0]
        pieces = [gs.Variable(unique_name(graph, f"{x.name}_piece_{i}"), dtype=x.dtype) for i in range(len(sizes))]
        graph.nodes.append(
            gs.Node(
                "Split",
                node_name(graph, f"{node.name}_split"),
                {"axis": axis},
                [x, new_const(graph, f"{node.name}_sizes", np.array(sizes, np.int64))],
                pieces,
            )
        )
        replaced = 0
        for reader, i in zip(readers, picks):
            piece = pieces[i]
            if squeeze:
                piece = gs.Variable(unique_name(graph, f"{pieces[i].name}_squeezed"), dtype=x.dtype)
                graph.nodes.append(
                    gs.Node(
                        "Squeeze",
                        node_name(graph, f"{node.name}_squeeze"),
                        {},
                        [pieces[i], new_const(graph, f"{node.name}_axis", np.array([axis]))],
                        [piece],
                    )
                )
            if replace_uses(graph, reader.outputs[0], piece, via=reader):
                drop(reader)
                replaced += 1
        if replaced == len(readers):  # else the sequence still has a reader, and cleanup drops the unused pieces
            drop(node)
        n += 1
    return n
