"""A tiny ONNX graph of token ids, as a user brings one exported elsewhere: ``input_ids`` int64 ``[batch, seq]`` ->
an embedding (plus, with ``table``, a position embedding of that many rows, looked up at ``0 .. seq - 1`` as an
exporter writes ``pos(torch.arange(seq))``, so the graph runs up to ``seq == table`` only) -> the mean over ``seq``
-> ``score`` ``[batch, 3]``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

VOCAB = 20


def token_graph(path: Path, table: int | None = None, offset: float = 0.0) -> Path:
    """The graph at ``path``; ``offset``: added to every embedding, so that the mean over a long ``seq`` varies
    little between samples beside its size (INT8's rounding then misses the relative-error gate)."""
    g = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array((g.standard_normal((VOCAB, 8)) + offset).astype(np.float32), "emb"),
        numpy_helper.from_array(g.standard_normal((8, 3)).astype(np.float32), "w"),
        numpy_helper.from_array(np.array([1], dtype=np.int64), "seq_axis"),
        numpy_helper.from_array(np.array(0, dtype=np.int64), "zero"),
        numpy_helper.from_array(np.array(1, dtype=np.int64), "one"),
    ]
    nodes = [helper.make_node("Gather", ["emb", "input_ids"], ["tok"])]
    pooled_from = "tok"
    if table:
        inits.append(numpy_helper.from_array(g.standard_normal((table, 8)).astype(np.float32), "pos"))
        nodes += [
            helper.make_node("Shape", ["input_ids"], ["ids_shape"]),
            helper.make_node("Gather", ["ids_shape", "one"], ["seq"], axis=0),
            helper.make_node("Range", ["zero", "seq", "one"], ["positions"]),
            helper.make_node("Gather", ["pos", "positions"], ["pos_rows"]),
            helper.make_node("Add", ["tok", "pos_rows"], ["with_pos"]),
        ]
        pooled_from = "with_pos"
    nodes += [
        helper.make_node("ReduceMean", [pooled_from, "seq_axis"], ["pooled"], keepdims=0),
        helper.make_node("MatMul", ["pooled", "w"], ["score"]),
    ]
    graph = helper.make_graph(
        nodes,
        "tokens",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("score", TensorProto.FLOAT, ["batch", 3])],
        inits,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(path))
    return path


def token_ids(rows: int, seq: int = 16) -> np.ndarray:
    """Token ids ``[rows, seq]`` over the graph's vocabulary."""
    return np.random.default_rng(1).integers(0, VOCAB, size=(rows, seq))
