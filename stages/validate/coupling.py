"""Outputs whose rows may mix across the batch, read from the exported graph.

The runtime probe (:func:`kiln.stages.accuracy.check.batch_coupled`) sees coupling the held-out data shows: an
output whose shape follows the batch. A graph that selects with a boolean mask over batched values (``NonZero``:
BART's end-of-sequence pooling, ``hidden[eos_mask].view(batch, -1, hidden)``) mixes rows only when requests differ
in what the mask selects, which validation data of one kind never shows, while a server batching two users'
requests does: one gets the other's answer. Such outputs are served one request per engine call.
"""

from __future__ import annotations

import onnx

# ops whose output's length is decided by the values over the whole batch
VALUE_SIZED = {"NonZero", "Compress", "Unique"}


def rows_may_mix(graph: onnx.GraphProto) -> list[str]:
    """The graph's outputs computed through a :data:`VALUE_SIZED` op on values that come from a batched input
    (one whose first axis is not a fixed size), in the graph's output order."""
    batched = {i.name for i in graph.input if _first_dim_free(i)}
    mixed: set[str] = set()
    for node in graph.node:  # topological order, as the checker requires
        ins = set(node.input)
        if node.op_type in VALUE_SIZED and ins & batched:
            mixed.update(node.output)
        if ins & batched:
            batched.update(node.output)
        if ins & mixed:
            mixed.update(node.output)
    return [o.name for o in graph.output if o.name in mixed]


def _first_dim_free(value: onnx.ValueInfoProto) -> bool:
    dims = value.type.tensor_type.shape.dim
    return bool(dims) and not dims[0].HasField("dim_value")
