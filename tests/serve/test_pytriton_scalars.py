"""`kiln serve --pytriton` binds an engine with a 0-d input and output (a scalar ``scale``, a scalar ``total``) as
the package's Triton configs declare them, shape ``(1,)`` (Triton takes no empty dims), and hands the engine its
``[]``. No server is started: the binding is read from a stand-in for PyTriton's ``Triton``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kiln.serve.server import ServedEngine, _bind
from kiln.stages.engines.config import BuildConfig
from kiln.stages.engines.onnxruntime.config import OnnxRuntimeConfig
from kiln.stages.engines.registry import load_engine
from kiln.stages.engines.stage import build_engine
from tests.stages.package.test_triton_scalars import _scalar_graph

pytest.importorskip("pytriton", reason="needs the serving libraries (pip install 'kiln[serve]')")


class _Triton:
    """What ``Triton.bind`` was given."""

    def __init__(self) -> None:
        self.bound: dict[str, Any] = {}

    def bind(self, **kwargs: Any) -> None:
        self.bound = kwargs


def test_a_0d_input_and_output_are_bound_as_1_and_the_engine_gets_its_0d_input(tmp_path: Path) -> None:
    from pytriton.proxy.types import Request

    cfg = BuildConfig(backends=["onnxruntime"], onnxruntime=OnnxRuntimeConfig(autotune={"cpu": False}))
    graph = _scalar_graph(tmp_path / "scalars.onnx")
    meta = build_engine(graph, tmp_path / "engine", "onnxruntime", "cpu", "fp32", cfg, tmp_path / "cache")
    triton = _Triton()
    with load_engine(tmp_path / "engine") as runner:
        _bind(triton, ServedEngine("m", tmp_path / "engine", meta), runner, 32, 100)
        x = np.ones((2, 4), np.float32)
        [answer] = triton.bound["infer_func"]([Request(data={"x": x, "scale": np.array([3.0], np.float32)})])
    assert not triton.bound["config"].batching
    shapes = {t.name: t.shape for t in [*triton.bound["inputs"], *triton.bound["outputs"]]}
    assert shapes == {"x": (-1, 4), "scale": (1,), "y": (-1, 4), "total": (1,)}
    assert answer["y"].shape == (2, 4) and (answer["y"] == 3).all()
    assert answer["total"].shape == (1,) and answer["total"][0] == 8
