"""Cast clean-up after mixed-precision conversion: one Cast per FP16/FP32 boundary, never a chain.

onnxconverter-common inserts a Cast at every boundary it creates, and with kept I/O types or neighbouring
FP32 islands that yields Cast->Cast pairs and no-op casts. Neither ONNX Runtime's session-time
CastElimination nor onnx-graphsurgeon rewrites the saved graph TensorRT reads, so this small pass does.
"""

from __future__ import annotations

import onnx
from onnx import helper

from kiln.core.graphsurgeon import gs

FLOAT_ONNX = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE}


def _onnx_type(t: gs.Tensor) -> int | None:
    if t.dtype is None:
        return None
    try:
        return int(helper.np_dtype_to_tensor_dtype(t.dtype))
    except (KeyError, TypeError, ValueError):
        return None


def _rewire(graph: gs.Graph, old: gs.Tensor, new: gs.Tensor) -> None:
    for consumer in list(old.outputs):
        for i, t in enumerate(consumer.inputs):
            if t is old:
                consumer.inputs[i] = new


def remove_cast_chains(model: onnx.ModelProto, original: set[str] | None = None) -> tuple[onnx.ModelProto, int]:
    """Collapse float Cast(a->b)->Cast(b->c) into Cast(a->c) and drop casts to the type they already have.

    Dropping an FP32->FP16->FP32 round trip removes a rounding, never adds one: both sides already run in
    FP32, so the FP16 step was a conversion artefact. Integer casts are left alone (they truncate), except where
    ``original`` (the node names of the graph before conversion) shows the float step was the converter's: a model's
    own FP32->INT64 cast behind a kept-FP32 node gets an FP16 cast put in front of it, and collapsing that pair
    restores the model's own cast.
    """
    graph = gs.import_onnx(_typed_empty_constants(model))
    total = 0
    while True:  # a removal can expose another (a cast made dead only goes away in cleanup)
        changed = _one_pass(graph, original)
        graph.cleanup().toposort()
        total += changed
        if not changed:
            break
    out = gs.export_onnx(graph)
    out.ir_version = model.ir_version
    return out, total


# A Constant's list attribute -> the element type of the tensor that says the same (an empty list carries no type)
_LIST_TYPES = {"value_ints": onnx.TensorProto.INT64, "value_floats": onnx.TensorProto.FLOAT}


def _typed_empty_constants(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with each Constant whose ``value_ints``/``value_floats`` is empty holding an empty typed ``value``
    tensor instead (the same constant, rewritten in place): onnx-graphsurgeon cannot write an empty list attribute
    back, its type being inferred from the elements, and exporters (torch.export's) write such Constants."""
    for node in model.graph.node:
        if node.op_type != "Constant" or len(node.attribute) != 1:
            continue
        attr = node.attribute[0]
        if attr.name in _LIST_TYPES and not attr.ints and not attr.floats:
            empty = helper.make_tensor("value", _LIST_TYPES[attr.name], [0], [])
            node.ClearField("attribute")
            node.attribute.append(helper.make_attribute("value", empty))
    return model


def _one_pass(graph: gs.Graph, original: set[str] | None = None) -> int:
    outputs = {id(t) for t in graph.outputs}
    inputs = {id(t) for t in graph.inputs}
    changed = 0
    for node in list(graph.nodes):
        if node.op != "Cast" or not node.inputs:
            continue
        src, dst = node.inputs[0], node.outputs[0]
        to = int(node.attrs["to"])
        prev = src.inputs[0] if src.inputs else None
        if prev is not None and prev.op == "Cast" and int(prev.attrs["to"]) in FLOAT_ONNX and to in FLOAT_ONNX:
            origin = prev.inputs[0]
            # From an int/bool origin only int -> FP32 -> FP16 collapses exactly (FP32 holds every int below
            # 2**24 exactly, and above FP16's range both give inf); int -> FP16 -> FP32 keeps its rounding.
            widening = (
                int(prev.attrs["to"]) in (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE)
                and to == onnx.TensorProto.FLOAT16
            )
            if _onnx_type(origin) in FLOAT_ONNX or (_onnx_type(origin) is not None and widening):
                node.inputs[0] = origin  # one cast from the origin; the first cast dies if nobody else reads it
                src, changed = origin, changed + 1
        elif prev is not None and prev.op == "Cast" and original is not None and prev.name not in original:
            origin = prev.inputs[0]
            if int(prev.attrs["to"]) in FLOAT_ONNX and to not in FLOAT_ONNX and _float_or_unknown(origin, prev):
                node.inputs[0] = origin  # the converter's float step in front of the model's own cast
                src, changed = origin, changed + 1
        if _onnx_type(src) == to and id(dst) not in outputs:
            _rewire(graph, dst, src)
            node.outputs.clear()
            changed += 1
        elif _onnx_type(src) == to and id(dst) in outputs and id(src) not in inputs and id(src) not in outputs:
            producer = src.inputs[0] if src.inputs else None
            if producer is not None:  # let the producer write the output directly; src's other readers read it
                _rewire(graph, src, dst)
                producer.outputs[producer.outputs.index(src)] = dst
                node.outputs.clear()
                changed += 1
    return changed


def _float_or_unknown(origin: gs.Tensor, cast: gs.Node) -> bool:
    """Whether a tensor the converter cast to float is float: typed so, or untyped (a kept-FP32 node's output the
    converter read as float, which is why it put a float cast there)."""
    kind = _onnx_type(origin)
    return kind in FLOAT_ONNX or (kind is None and origin.inputs and origin.inputs[0].op != "Cast")


def cast_chains(model: onnx.ModelProto) -> list[tuple[str, str]]:
    """(first, second) names of every Cast to a float type that feeds straight into another Cast (a cast to an
    integer type truncates: the model's own step), except those starting from an integer or bool tensor: int ->
    FP16 -> FP32 is kept on purpose (its FP16 rounding is real, see ``_one_pass``; an attention mask cast to float
    and then to FP16 makes one)."""
    producers = {o: n for n in model.graph.node for o in n.output}
    types = {v.name: v.type.tensor_type.elem_type for v in [*model.graph.input, *model.graph.value_info]}
    types |= {t.name: t.data_type for t in model.graph.initializer}

    def from_float(cast: onnx.NodeProto) -> bool:
        return types.get(cast.input[0]) not in NON_FLOAT if cast.input else True

    def to_float(cast: onnx.NodeProto) -> bool:  # float -> int -> float truncates on purpose: the model's own
        return next((a.i for a in cast.attribute if a.name == "to"), None) in FLOAT_ONNX

    return [
        (producers[n.input[0]].name, n.name)
        for n in model.graph.node
        if n.op_type == "Cast"
        and n.input
        and n.input[0] in producers
        and producers[n.input[0]].op_type == "Cast"
        and from_float(producers[n.input[0]])
        and to_float(producers[n.input[0]])
    ]


NON_FLOAT = {
    onnx.TensorProto.BOOL,
    onnx.TensorProto.INT8,
    onnx.TensorProto.INT16,
    onnx.TensorProto.INT32,
    onnx.TensorProto.INT64,
    onnx.TensorProto.UINT8,
    onnx.TensorProto.UINT16,
    onnx.TensorProto.UINT32,
    onnx.TensorProto.UINT64,
}
