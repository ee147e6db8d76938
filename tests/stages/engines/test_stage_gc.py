"""The build stage's TensorRT builds share one pause of the garbage collector: one full collection a stage."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from kiln.stages.engines import stage
from tests.stages.engines.test_stage import _ctx


@pytest.mark.tensorrt
def test_a_stage_of_several_tensorrt_engines_collects_once(zoo, tmp_path: Path, monkeypatch) -> None:
    collections: list[int] = []
    real = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *a: collections.append(1) or real(*a))
    result = stage.run(_ctx(tmp_path, zoo, {"backends": ["tensorrt"]}))
    assert sorted(e.name for e in result.engines) == [f"tensorrt-{p}" for p in ("fp16", "fp32", "int8")]
    assert collections == [1] and gc.isenabled()
