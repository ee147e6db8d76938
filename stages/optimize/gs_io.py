"""ONNX <-> onnx-graphsurgeon for every valid model: typed constants in, empty list attributes back out.

Two gaps of onnx-graphsurgeon 0.6, filled here because no library does (onnx-graphsurgeon is the only one
the passes are written against):
- its constant folding lowers ``Constant(value_floats=...)`` and friends with ``np.array(attr)``, which makes
  float64 (or, for an empty list, untyped float64) tensors: the folded graph no longer type-checks. So every
  ``value_*`` attribute becomes the typed ``value`` tensor ONNX defines it as, before any pass sees the graph.
- its exporter rebuilds attributes with ``onnx.helper.make_attribute``, which cannot type an empty list
  (``Could not infer attribute value_ints type from empty iterator``). So empty list attributes are taken off
  before export and put back with the type they were read with.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import onnx
from onnx import AttributeProto, helper, numpy_helper
from onnx_graphsurgeon.exporters.onnx_exporter import dtype_to_onnx
from onnx_graphsurgeon.ir.tensor import LazyValues

from kiln.core.graphsurgeon import gs
from kiln.core.onnx_io import STRIP_BYTES, infer_shapes, stub_tensor

# Constant's value_* attribute -> numpy dtype of the tensor it stands for (ONNX spec of Constant).
_CONST_ATTRS: dict[str, object] = {
    "value_float": np.float32,
    "value_floats": np.float32,
    "value_int": np.int64,
    "value_ints": np.int64,
    "value_string": np.object_,
    "value_strings": np.object_,
}
_LISTS = {
    AttributeProto.FLOATS,
    AttributeProto.INTS,
    AttributeProto.STRINGS,
    AttributeProto.TENSORS,
    AttributeProto.GRAPHS,
    AttributeProto.SPARSE_TENSORS,
    AttributeProto.TYPE_PROTOS,
}
EmptyAttrs = dict[int, dict[str, int]]  # id(gs node) -> {attribute name: AttributeProto type}


def _graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """``graph`` and every subgraph (If/Loop/Scan bodies) inside it."""
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == AttributeProto.GRAPH:
                yield from _graphs(attr.g)
            elif attr.type == AttributeProto.GRAPHS:
                for g in attr.graphs:
                    yield from _graphs(g)


def normalize_constants(model: onnx.ModelProto) -> int:
    """Constant(value_float/value_floats/value_int/value_ints/value_string/value_strings) -> Constant(value=tensor
    of the spec's type), in place and in subgraphs too. Returns how many were rewritten."""
    n = 0
    for graph in _graphs(model.graph):
        for node in graph.node:
            if node.op_type != "Constant" or node.domain not in ("", "ai.onnx") or len(node.attribute) != 1:
                continue
            attr = node.attribute[0]
            if attr.name not in _CONST_ATTRS or attr.ref_attr_name:
                continue
            value = helper.get_attribute_value(attr)
            arr = np.array(value, dtype=_CONST_ATTRS[attr.name])
            del node.attribute[:]
            node.attribute.append(helper.make_attribute("value", numpy_helper.from_array(arr, name="")))
            n += 1
    return n


def import_graph(model: onnx.ModelProto) -> tuple[gs.Graph, EmptyAttrs]:
    """A graphsurgeon graph of ``model`` (constants normalized on a copy: the graph's constants are views of the
    copy's tensors, and exporting renames them in place) and the types of its empty list attributes."""
    typed = onnx.ModelProto()
    typed.CopyFrom(model)
    normalize_constants(typed)
    graph = gs.import_onnx(typed)
    empties: EmptyAttrs = {}
    _record_empty(typed.graph, graph, empties)
    return graph, empties


def refresh_shapes(graph: gs.Graph, empties: EmptyAttrs) -> None:
    """Give ``graph``'s variables the shapes and types ONNX infers for the graph as it is now: what an export,
    shape inference and a new import would give a pass, without copying the weights (big constants are exported
    as stubs with their dims and type). Variables inference finds nothing for lose a shape a rewrite made stale."""
    stubbed: list[tuple[gs.Constant, object]] = []
    for t in graph.tensors().values():
        if isinstance(t, gs.Constant) and _nbytes(t) > STRIP_BYTES:
            stubbed.append((t, t._values))  # the exporter reads this attribute too; .values would load the data
            t.values = LazyValues(stub_tensor(t.name, dtype_to_onnx(t.export_dtype), t.shape))
    try:
        light = export_graph(graph, empties)
    finally:
        for t, values in stubbed:
            t.values = values
    inferred = gs.import_onnx(infer_shapes(light, strict=False)).tensors()
    inputs = {id(t) for t in graph.inputs}
    for name, t in graph.tensors().items():
        if isinstance(t, gs.Variable) and id(t) not in inputs:
            found = inferred.get(name)
            t.dtype, t.shape = (found.dtype, found.shape) if isinstance(found, gs.Variable) else (None, None)


def _nbytes(t: gs.Constant) -> int:
    return int(t._values.nbytes)  # LazyValues and numpy arrays both know their size without loading


def _record_empty(proto: onnx.GraphProto, graph: gs.Graph, empties: EmptyAttrs) -> None:
    # import_onnx keeps node order, so the i-th NodeProto is the i-th gs node.
    for pnode, node in zip(proto.node, graph.nodes):
        for attr in pnode.attribute:
            if attr.type in _LISTS and not helper.get_attribute_value(attr):
                empties.setdefault(id(node), {})[attr.name] = attr.type
            elif attr.type == AttributeProto.GRAPH and isinstance(node.attrs.get(attr.name), gs.Graph):
                _record_empty(attr.g, node.attrs[attr.name], empties)


def export_graph(graph: gs.Graph, empties: EmptyAttrs) -> onnx.ModelProto:
    """``gs.export_onnx`` that also exports empty list attributes (typed as read, else as INTS)."""
    taken: list[tuple[gs.Graph, int, dict[str, int]]] = []
    _take_empty(graph, empties, taken)
    try:
        model = gs.export_onnx(graph)
    finally:
        for g, i, attrs in taken:  # the caller's graph is left as it was
            g.nodes[i].attrs.update({k: [] for k in attrs})
    for g, i, attrs in taken:
        pnode = _find(model.graph, graph, g).node[i]
        for name, kind in attrs.items():
            attr = pnode.attribute.add()
            attr.name, attr.type = name, kind
    return model


def _take_empty(graph: gs.Graph, empties: EmptyAttrs, taken: list) -> None:
    for i, node in enumerate(graph.nodes):
        gone = {
            k: empties.get(id(node), {}).get(k, AttributeProto.INTS)
            for k, v in node.attrs.items()
            if isinstance(v, (list, tuple)) and len(v) == 0
        }
        for k in gone:
            del node.attrs[k]
        if gone:
            taken.append((graph, i, gone))
        for v in node.attrs.values():
            if isinstance(v, gs.Graph):
                _take_empty(v, empties, taken)


def _find(proto: onnx.GraphProto, graph: gs.Graph, want: gs.Graph) -> onnx.GraphProto:
    """The exported GraphProto of the (sub)graph ``want`` (exported nodes keep the gs node order)."""
    if graph is want:
        return proto
    for pnode, node in zip(proto.node, graph.nodes):
        for attr in pnode.attribute:
            sub = node.attrs.get(attr.name)
            if attr.type == AttributeProto.GRAPH and isinstance(sub, gs.Graph):
                try:
                    return _find(attr.g, sub, want)
                except LookupError:
                    pass
    raise LookupError("subgraph not found in the exported model")
