"""Checks that an engine graph still takes every shape its source graph takes.

An engine written by an optimizer (ONNX Runtime's offline optimization, a converter, a fusion pass) must keep each
symbolic axis of the source's inputs and outputs symbolic: an engine that silently fixed ``batch`` to 1 builds,
validates at batch 1 and then fails at batch 32 in serving. ``onnx`` itself has no such comparison, hence
this module; it compares declared graph signatures only (no shape inference), which is what ORT enforces at run time.
"""

from __future__ import annotations

from pathlib import Path

import onnx

from kiln.core.errors import BuildError
from kiln.core.onnx_io import io_specs, load_onnx
from kiln.core.records import TensorSpec

HINT = (
    "the engine's optimizer fixed a dynamic axis; report it with the model, or build with "
    "build.onnxruntime.autotune.cuda: false and transformer_fusion: off to find the step that pins it"
)


def lost_axes(source: list[TensorSpec], engine: list[TensorSpec]) -> list[str]:
    """Each symbolic axis of ``source`` that ``engine`` declares fixed (or lacks), as ``name[axis]: 'batch' -> 1``.

    An axis that stays symbolic under another name is kept (ORT may rename); a tensor missing from the engine or
    declared with another rank is reported too: the engine no longer has the source's signature."""
    by_name = {s.name: s for s in engine}
    lost: list[str] = []
    for spec in source:
        got = by_name.get(spec.name)
        if got is None:
            lost.append(f"{spec.name}: missing from the engine")
            continue
        if spec.shape and got.shape and len(spec.shape) != len(got.shape):
            lost.append(f"{spec.name}: rank {len(spec.shape)} -> {len(got.shape)}")
            continue
        for axis, (want, have) in enumerate(zip(spec.shape, got.shape)):
            if _symbolic(want) and not _symbolic(have):
                lost.append(f"{spec.name}[{axis}]: {want!r} -> {have}")
    return lost


def _symbolic(dim: int | str) -> bool:
    # io_specs gives dim_param (a str) or dim_value; 0 means "no value", i.e. unknown: dynamic too.
    return isinstance(dim, str) or dim == 0


def lost_in_model(source: onnx.ModelProto, engine: onnx.ModelProto) -> list[str]:
    """Inputs' symbolic axes, and outputs' axes named by an input symbol: an output axis with a symbol of its own
    (stale, or data-dependent) may legitimately become fixed once shapes are inferred from fixed inputs."""
    (src_in, src_out), (eng_in, eng_out) = io_specs(source), io_specs(engine)
    symbols = {d for s in src_in for d in s.shape if isinstance(d, str)}
    outputs = [
        TensorSpec(
            name=s.name, dtype=s.dtype, shape=[d if not isinstance(d, str) or d in symbols else -1 for d in s.shape]
        )
        for s in src_out
    ]
    return lost_axes(src_in, eng_in) + lost_axes(outputs, eng_out)


def check_engine_graph(source: Path, engine: Path, name: str) -> None:
    """Raise :class:`BuildError` when the ONNX ``engine`` fixed any axis the ``source`` graph leaves dynamic."""
    lost = lost_in_model(load_onnx(source, load_external_data=False), load_onnx(engine, load_external_data=False))
    if lost:
        raise BuildError(f"engine {name} lost dynamic axes of its source graph: {'; '.join(lost[:6])}", hint=HINT)
