"""``package.max_batch_size: 0`` writes the stock Triton model unbatched, whose first axis Triton leaves uncapped:
the package stage warns that it takes batches past the validated one."""

import logging
from pathlib import Path

import pytest

from kiln.core.records import EngineMetadata
from kiln.stages.package.triton import write_stock_model


def _engine(tmp_path: Path, validated: list[int] | None) -> tuple[Path, EngineMetadata]:
    engine_dir = tmp_path / "engine"
    engine_dir.mkdir()
    (engine_dir / "model.onnx").write_bytes(b"onnx")
    meta = EngineMetadata(
        name="onnxruntime_cpu_fp32",
        backend="onnxruntime",
        device="cpu",
        precision="fp32",
        source={"file": "m.onnx", "sha256": "0"},
        files={"model": "model.onnx"},
        flavour="onnxruntime",
        versions={},
        inputs=[{"name": "input_ids", "shape": ["batch", "seq"], "dtype": "int64"}],
        outputs=[{"name": "logits", "shape": ["batch", 2], "dtype": "float32"}],
        validated_batch_sizes=validated,
    )
    return engine_dir, meta


def test_unbatched_stock_model_warns_of_no_batch_cap(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    engine_dir, meta = _engine(tmp_path, [1, 8])
    with caplog.at_level(logging.WARNING, logger="kiln"):
        write_stock_model(tmp_path / "triton" / "m", engine_dir, meta, max_batch_size=0)
    assert "max_batch_size: 0" in (tmp_path / "triton" / "m" / "config.pbtxt").read_text()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "any number of rows" in warnings[0] and "validated batch 8" in warnings[0]


def test_batched_stock_model_says_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    engine_dir, meta = _engine(tmp_path, [1, 8])
    with caplog.at_level(logging.WARNING, logger="kiln"):
        write_stock_model(tmp_path / "triton" / "m", engine_dir, meta, max_batch_size=8)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
