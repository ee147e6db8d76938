"""Where a graph's weight bytes sit: an embedding-heavy model (a recommender's lookup tables) keeps nearly all of
them in the tables its Gather nodes read, which the default ``calibration.op_types`` leaves in float, so its INT8
variant is as large as FP32 while the FLOP share it reports looks high. The hint names the setting that stores
those tables in int8."""

from __future__ import annotations

from collections.abc import Iterable

import onnx

from kiln.calibration.config import CalibrationConfig
from kiln.calibration.quantize import quantizable_op_types
from kiln.core.onnx_io import tensor_bytes

# Op types whose stored input (by index) ONNX Runtime's quantizers store in int8 where calibration.op_types lists
# them: a Gather's table (input 0), its looked-up rows dequantized
TABLE_INPUTS = {"Gather": 0}
# the share of the graph's weight bytes in float tables past which the hint is given
MOST = 0.5


def weight_bytes(model: onnx.ModelProto) -> dict[str, int]:
    """Stored tensor -> its size in bytes, from its dims and element type (nothing is read: external weights too)."""
    return {t.name: tensor_bytes(t, external=True) for t in model.graph.initializer}


def table_bytes(model: onnx.ModelProto, ops: Iterable[str]) -> dict[str, int]:
    """Op type of :data:`TABLE_INPUTS` among ``ops`` -> bytes of the stored tensors that only such nodes read, as
    their table: weights no other node reads (a tied embedding also read by a MatMul is not counted)."""
    sizes = weight_bytes(model)
    readers: dict[str, set[tuple[str, int]]] = {}
    for node in model.graph.node:
        for i, name in enumerate(node.input):
            if name in sizes:
                readers.setdefault(name, set()).add((node.op_type, i))
    out: dict[str, int] = {}
    for op in ops:
        tables = [n for n, r in readers.items() if r == {(op, TABLE_INPUTS[op])}]
        if tables:
            out[op] = sum(sizes[n] for n in tables)
    return out


def float_tables_hint(model: onnx.ModelProto, cfg: CalibrationConfig) -> str | None:
    """The note for an INT8 variant whose graph keeps most of its weight bytes in float tables that listing their
    op type in ``calibration.op_types`` would store in int8; None where the tables are listed, excluded on purpose
    (``exclude_op_types``) or hold less than :data:`MOST` of the bytes."""
    listed = quantizable_op_types(cfg)
    candidates = [op for op in TABLE_INPUTS if op not in listed and op not in cfg.exclude_op_types]
    total = sum(weight_bytes(model).values())
    found = table_bytes(model, candidates)
    if not total or sum(found.values()) <= MOST * total:
        return None
    ops = sorted(found)
    held = sum(found.values())
    wanted = ",".join([*cfg.op_types, *ops])
    return (
        f"int8: {held * 100 // total}% of the graph's weight bytes ({held / 1e6:.2f} of {total / 1e6:.2f} MB) "
        f"are tables read by {', '.join(ops)} nodes, which calibration.op_types leaves in float, so the INT8 graph "
        f"is about as large as FP32 (its int8 share counts FLOPs, not bytes); to store them in int8 try "
        f"--set 'calibration.op_types=[{wanted}]' (the variant is gated like any other)"
    )
