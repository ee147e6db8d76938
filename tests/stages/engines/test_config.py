"""``build.graph_engines``: the engine kinds built from the precision stage's graphs, as ``<backend>-<device>``."""

from __future__ import annotations

from kiln.stages.engines.config import BuildConfig


def test_graph_engines_follow_the_backends_and_their_devices() -> None:
    assert BuildConfig.model_validate({"backends": ["onnxruntime"]}).graph_engines == ["onnxruntime-cpu"]
    both = BuildConfig.model_validate(
        {"backends": ["torch", "tensorrt", "onnxruntime"], "onnxruntime": {"devices": ["cuda", "cpu"]}}
    )
    assert both.graph_engines == ["onnxruntime-cpu", "onnxruntime-cuda", "tensorrt-cuda"]  # torch reads no graph
