"""Outputs whose rows may mix across the batch, read from the exported graph.

The runtime probe (:func:`kiln.stages.accuracy.check.batch_coupled`) sees coupling the held-out data shows: an
output whose shape follows the batch. A graph that selects with a boolean mask over batched values (``NonZero``:
BART's end-of-sequence pooling, ``hidden[eos_mask].view(batch, -1, hidden)``) mixes rows only when requests differ
in what the mask selects, which validation data of one kind never shows, while a server batching two users'
requests does: one gets the other's answer. Such outputs are served one request per engine call. A masked fill
(``hidden[~mask] = 0``: the selected positions written with constants) moves no value between rows and is batched.
"""

from __future__ import annotations

import onnx

# ops whose output's length is decided by the values over the whole batch
VALUE_SIZED = {"NonZero", "Compress", "Unique"}


# ops that pass a NonZero's positions on unchanged in what they index
POSITIONS = {"Transpose", "Cast", "Identity"}
# inputs that give only a shape, not values: a fill of constants sized by the selection carries no row's values
SHAPE_INPUTS = {"Reshape": 1, "Expand": 1, "Tile": 1}
SHAPE_ONLY = {"Shape", "Size", "ConstantOfShape"}  # results that carry sizes, no values


def rows_may_mix(graph: onnx.GraphProto) -> list[str]:
    """The graph's outputs computed through a :data:`VALUE_SIZED` op on values that come from a batched input
    (one whose first axis is not a fixed size), in the graph's output order. A masked fill (``hidden[~mask] = 0``:
    the positions a NonZero selects written with constants by a ScatterND, :func:`masked_fills`) mixes nothing: each
    position keeps its own row."""
    batched = {i.name for i in graph.input if _first_dim_free(i)}
    fills = masked_fills(graph, batched)
    mixed: set[str] = set()
    for node in graph.node:  # topological order, as the checker requires
        ins = set(node.input)
        if node.op_type in VALUE_SIZED and ins & batched and node.output[0] not in fills:
            mixed.update(node.output)
        if ins & batched:
            batched.update(node.output)
        if ins & mixed:
            mixed.update(node.output)
    return [o.name for o in graph.output if o.name in mixed]


def masked_fills(graph: onnx.GraphProto, batched: set[str]) -> set[str]:
    """The first outputs of the NonZero nodes whose positions (through :data:`POSITIONS` ops) are only the indices
    of ScatterND nodes whose updates carry no batched values (constants, sized by the selection at most)."""
    consumers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for node in graph.node:
        for slot, name in enumerate(node.input):
            consumers.setdefault(name, []).append((node, slot))
    carries = _value_carriers(graph, batched)
    fills = set()
    for node in (n for n in graph.node if n.op_type == "NonZero"):
        uses, todo = [], list(node.output)
        while todo:
            for user, slot in consumers.get(todo.pop(), []):
                if user.op_type in POSITIONS:
                    todo += list(user.output)
                elif user.op_type not in SHAPE_ONLY:  # the selection's count, read as a size, is no row's value
                    uses.append((user, slot))
        if uses and all(u.op_type == "ScatterND" and slot == 1 and u.input[2] not in carries for u, slot in uses):
            fills.add(node.output[0])  # by its result: nodes need no name
    return fills


def _value_carriers(graph: onnx.GraphProto, batched: set[str]) -> set[str]:
    """Tensors whose values come from a batched input, not counting inputs that only give a shape
    (:data:`SHAPE_INPUTS`) or ops whose results are sizes (:data:`SHAPE_ONLY`)."""
    carries = set(batched)
    for node in graph.node:
        if node.op_type in SHAPE_ONLY:
            continue
        skip = SHAPE_INPUTS.get(node.op_type)
        if any(name in carries for slot, name in enumerate(node.input) if slot != skip):
            carries.update(node.output)
    return carries


def _first_dim_free(value: onnx.ValueInfoProto) -> bool:
    dims = value.type.tensor_type.shape.dim
    return bool(dims) and not dims[0].HasField("dim_value")
