"""ORT's transformer fusion is not tried on an INT8 graph: it would rewrite it into CUDA-only QOrdered* ops."""

from __future__ import annotations

import logging

import onnx
import pytest

from kiln.stages.engines.onnxruntime.build import maybe_fuse
from kiln.stages.engines.onnxruntime.config import OnnxRuntimeConfig


@pytest.mark.parametrize("precision", ["int8", "int8_cpu"])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_an_int8_graph_is_not_fused_and_no_warning_says_so(
    zoo, caplog: pytest.LogCaptureFixture, precision: str, device: str
) -> None:
    """The Q/DQ graph and ONNX Runtime CPU's integer graph of a transformer: recorded as already INT8, at info."""
    model = onnx.load(str(zoo("transformer", precision)))
    caplog.clear()
    caplog.set_level(logging.INFO)
    fused, note = maybe_fuse(model, device, OnnxRuntimeConfig())
    assert fused is model and not note["applied"] and note["why"].startswith("graph already INT8")
    assert not [r for r in caplog.records if r.name == "kiln.build" and r.levelno >= logging.WARNING], caplog.text
    assert "graph already INT8" in caplog.text


def test_the_fp32_graph_of_the_same_model_is_still_fused(zoo) -> None:
    assert maybe_fuse(onnx.load(str(zoo("transformer"))), "cpu", OnnxRuntimeConfig())[1]["applied"]
