"""`kiln serve --max-batch` above what an engine was validated for is said, not silently overridden."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from kiln.core.records import EngineMetadata
from kiln.serve.server import say_capped


def _served(validated: list[int]) -> SimpleNamespace:
    meta = EngineMetadata(
        name="e",
        backend="onnxruntime",
        device="cpu",
        precision="fp32",
        source={"file": "m.onnx", "sha256": "0"},
        files={"model": "engine"},
        flavour="onnxruntime",
        versions={},
        inputs=[{"name": "input", "shape": ["batch", 8], "dtype": "float32"}],
        outputs=[{"name": "logits", "shape": ["batch", 4], "dtype": "float32"}],
        validated_batch_sizes=validated,
    )
    return SimpleNamespace(meta=meta, model_name="e_fp32")


def test_a_max_batch_above_the_validated_batches_is_said_as_capped(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kiln.serve.server"):
        say_capped([_served([1, 8])], 64)
    assert "e_fp32: --max-batch 64 capped to 8, the largest batch it was validated at" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kiln.serve.server"):
        say_capped([_served([1, 8])], 8)  # what was validated: nothing to say
        say_capped([_served([1, 8])], 0)  # no batching asked for
    assert not caplog.text
