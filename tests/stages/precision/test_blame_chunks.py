"""Blame's per-tensor errors are computed a bounded chunk of tensors at a time, with the same result as all at once."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kiln.calibration.config import CalibrationConfig
from kiln.calibration.quantize import quantize_int8
from kiln.stages.precision import compare, fallback
from kiln.stages.precision.variants import Source

from .precision_graphs import inputs, sensitive_graph


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Source, Path]:
    """The FP32 graph and its INT8 Q/DQ graph."""
    tmp = tmp_path_factory.mktemp("blame_chunks")
    src = Source.prepare(sensitive_graph(), tmp / "fp32" / "model.onnx", [inputs(64)], None)
    ccfg = CalibrationConfig(cache=False)
    out = tmp / "model.int8.onnx"
    quantize_int8(src.path, out, src.ranges(ccfg.method, ccfg), ccfg)
    return src, out


def _record_runs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many intermediate tensors each graph run makes outputs."""
    sizes: list[int] = []
    run = compare.run_batched

    def recording(model: compare.Model, x: compare.Samples, **kw: list[str]) -> list[np.ndarray]:
        sizes.append(len(kw.get("extra_outputs") or []))
        return run(model, x, **kw)

    monkeypatch.setattr(compare, "run_batched", recording)
    return sizes


def test_tensor_errors_in_chunks_match_all_at_once(pair: tuple[Source, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    src, int8 = pair
    tensors = ["h1", "ln", "h2", "sm", "ex"]
    whole = compare.tensor_errors(src.model, int8, inputs(16, seed=3), tensors, chunk=len(tensors))
    sizes = _record_runs(monkeypatch)
    chunked = compare.tensor_errors(src.model, int8, inputs(16, seed=3), tensors, chunk=2)
    assert sizes and max(sizes) <= 2, sizes
    assert len(sizes) == 2 * 3  # both graphs, once per chunk of two
    assert chunked == whole
    assert set(tensors) <= set(chunked)


def test_blame_runs_a_bounded_chunk_and_picks_as_before(
    pair: tuple[Source, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    src, int8 = pair
    x, nodes = inputs(32, seed=4), {n.name for n in src.model.graph.node}
    monkeypatch.setattr(fallback, "BLAME_CHUNK", 10**6)
    whole = fallback.blame(src.model, int8, x, nodes, set(), 4, True)
    monkeypatch.setattr(fallback, "BLAME_CHUNK", 1)
    sizes = _record_runs(monkeypatch)
    chunked = fallback.blame(src.model, int8, x, nodes, set(), 4, True)
    assert whole and max(sizes) <= 1, sizes
    assert chunked == whole
