"""Small graph helpers shared by the passes: constant lookup, consumers, safe rewiring."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kiln.core.lazy import lazy_import
from kiln.core.random_ops import RANDOM_OPS as RANDOM_OPS  # ops the passes never fold into constants nor merge

gs = lazy_import("onnx_graphsurgeon")  # loaded when a pass first runs, not when the config is read


def const(t: gs.Tensor | None) -> np.ndarray | None:
    """The value of a constant tensor (initializer or Constant-node output), else None."""
    if isinstance(t, gs.Constant):
        return np.asarray(t.values)
    if isinstance(t, gs.Variable) and len(t.inputs) == 1 and t.inputs[0].op == "Constant":
        val = t.inputs[0].attrs.get("value")
        if isinstance(val, gs.Constant):
            return np.asarray(val.values)
    return None


def producer(t: gs.Tensor, op: str | Sequence[str] | None = None) -> gs.Node | None:
    """The node writing ``t`` (optionally only if its op is ``op``)."""
    if not t.inputs:
        return None
    node = t.inputs[0]
    ops = (op,) if isinstance(op, str) else op
    return node if ops is None or node.op in ops else None


def only_consumer(graph: gs.Graph, t: gs.Tensor) -> gs.Node | None:
    """The single node reading ``t``, or None when it has several readers or is a graph output."""
    if len(t.outputs) != 1 or t in graph.outputs:
        return None
    return t.outputs[0]


def is_private(graph: gs.Graph, t: gs.Tensor) -> bool:
    """``t`` feeds exactly one node and is not a graph output, so rewriting its producer is invisible."""
    return only_consumer(graph, t) is not None


def replace_uses(graph: gs.Graph, old: gs.Tensor, new: gs.Tensor, via: gs.Node | None = None) -> bool:
    """Make every reader of ``old`` read ``new``; False if impossible (then nothing changed).

    Graph outputs keep their names: when ``old`` is one, the producer of ``new`` is made to write ``old``
    instead (``via`` is the node being bypassed, which the caller then drops). That needs ``new`` to be a
    variable with a producer and not itself a graph input or output; its other readers then read ``old``,
    which now holds the same value under the output's name."""
    if old is new:
        return False
    if old in graph.outputs:
        if not isinstance(new, gs.Variable) or not new.inputs or new in graph.outputs or new in graph.inputs:
            return False
        for prev in list(old.inputs):  # detach old's current writer without shifting its output slots
            prev.outputs[prev.outputs.index(old)] = gs.Variable(unique_name(graph, old.name + "_dead"))
        for reader in list(new.outputs):  # they would otherwise read a tensor nobody writes any more
            for i, t in enumerate(reader.inputs):
                if t is new and reader is not via:
                    reader.inputs[i] = old
        prod = new.inputs[0]
        prod.outputs[prod.outputs.index(new)] = old
        old.dtype, old.shape = old.dtype or new.dtype, old.shape if old.shape is not None else new.shape
        return True
    for node in list(old.outputs):
        for i, t in enumerate(node.inputs):
            if t is old:
                node.inputs[i] = new
    return True


def drop(node: gs.Node) -> None:
    """Disconnect a node so ``cleanup`` removes it."""
    node.outputs.clear()


def known_shape(t: gs.Tensor) -> list[int | str] | None:
    shape = getattr(t, "shape", None)
    return list(shape) if shape is not None else None


def static_shape(t: gs.Tensor) -> list[int] | None:
    shape = known_shape(t)
    if shape is None or not all(isinstance(d, int) and d >= 0 for d in shape):
        return None
    return [int(d) for d in shape]


def new_const(graph: gs.Graph, base: str, values: np.ndarray) -> gs.Constant:
    """A constant with a name unique in the graph."""
    return gs.Constant(unique_name(graph, base), np.ascontiguousarray(values))


def unique_name(graph: gs.Graph, base: str) -> str:
    names = graph.tensors()
    name, i = base, 0
    while name in names:
        i += 1
        name = f"{base}_{i}"
    return name


def node_name(graph: gs.Graph, base: str) -> str:
    """A node name not yet used in the graph (ONNX Runtime rejects duplicates)."""
    names = {n.name for n in graph.nodes}
    name, i = base, 0
    while name in names:
        i += 1
        name = f"{base}_{i}"
    return name
