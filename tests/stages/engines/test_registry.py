"""The backend registry: every backend is complete, and engines open only when their files are intact."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kiln.core.errors import ConfigError, InputFileError
from kiln.pipeline.api import run_pipeline
from kiln.pipeline.config import config_from_dict
from kiln.stages.engines.backend import SIDECAR, Backend, read_metadata
from kiln.stages.engines.config import BuildConfig
from kiln.stages.engines.onnxruntime.config import OnnxRuntimeConfig
from kiln.stages.engines.registry import BACKENDS, backend_named, load_engine, register
from kiln.stages.engines.stage import build_engine
from tests.conftest import tiny_config_dict
from tests.stages.engines.toy_backend import TOY


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_every_backend_is_complete(name: str) -> None:
    backend = BACKENDS[name]
    assert isinstance(backend, Backend) and backend.name == name
    assert set(backend.runners) == set(backend.devices), "a runner for every device it builds for"
    assert backend.settings(BuildConfig()) is not None
    names = {backend.engine_name(d, p) for d in backend.devices for p in ("fp32", "fp16")}
    assert len(names) == 2 * len(backend.devices) and all(n.startswith(name) for n in names)


def test_unknown_backend_lists_the_registered_ones() -> None:
    with pytest.raises(ConfigError) as err:
        backend_named("openvino")
    assert all(name in err.value.hint for name in BACKENDS)


@pytest.fixture
def engine(tmp_path: Path, zoo) -> Path:
    cfg = BuildConfig(backends=["onnxruntime"], onnxruntime=OnnxRuntimeConfig(autotune={"cpu": False}))
    build_engine(zoo("cnn"), tmp_path / "e", "onnxruntime", "cpu", "fp32", cfg, tmp_path / "cache")
    return tmp_path / "e"


def test_an_intact_engine_opens_and_runs(engine: Path) -> None:
    meta = read_metadata(engine)
    assert set(meta.file_hashes) == {"engine.onnx"}
    with load_engine(engine) as runner:
        assert runner.infer({"input": np.zeros((2, 1, 8, 8), "float32")})["logits"].shape == (2, 10)


def test_flipped_bytes_in_an_engine_are_refused(engine: Path) -> None:
    model = engine / "engine.onnx"
    data = bytearray(model.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 64] = bytes(64)
    model.write_bytes(bytes(data))
    with pytest.raises(InputFileError, match="does not match its recorded sha256"):
        load_engine(engine)


def test_a_missing_engine_file_is_refused(engine: Path) -> None:
    (engine / "engine.onnx").unlink()
    with pytest.raises(InputFileError, match="missing"):
        load_engine(engine)


def test_damaged_metadata_is_refused(engine: Path) -> None:
    (engine / SIDECAR).write_text('{"name": 1}')
    with pytest.raises(InputFileError, match="not a valid EngineMetadata"):
        load_engine(engine)


def test_build_messages_name_the_engine_not_the_staging_folder(tmp_path: Path, zoo, caplog) -> None:
    caplog.set_level("INFO")
    cfg = BuildConfig(backends=["onnxruntime"], onnxruntime=OnnxRuntimeConfig(autotune={"cpu": False}))
    build_engine(
        zoo("cnn"), tmp_path / "e", "onnxruntime", "cpu", "fp32", cfg, tmp_path / "cache", name="onnxruntime-cpu-fp32"
    )
    assert "not autotuning onnxruntime-cpu-fp32" in caplog.text
    assert "staging" not in caplog.text


def test_a_backend_defined_outside_kiln_is_one_registration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """tests/stages/engines/toy_backend.py (ONNX's reference evaluator as an engine) plus ``register(TOY)``: its
    config section is taken, the build stage builds it, validation runs it against PyTorch, packaging ships it."""
    monkeypatch.setitem(BACKENDS, TOY.name, TOY)  # undone after the test; register() below is what a user writes
    register(TOY)
    overrides = {"build.backends": ["toy"], "build.toy": {"optimized": True}, "precision.variants": ["fp32"]}
    result, report = run_pipeline(config_from_dict(tiny_config_dict(**overrides)), tmp_path / "wd")
    assert result.error is None and report["ok"], report.get("error")
    meta = read_metadata(tmp_path / "wd" / "build" / "toy-fp32")
    assert meta.flavour == "onnx-reference" and meta.backend_info == {
        "evaluator": "onnx.reference.ReferenceEvaluator",
        "optimized": True,
    }
    (engine,) = report["validation"]["engines"]
    assert engine["name"] == "toy-fp32" and engine["passed"] and engine["cosine"] > 0.9999
    assert (tmp_path / "wd" / "package" / "engines" / "toy-fp32" / SIDECAR).is_file()
    with load_engine(tmp_path / "wd" / "build" / "toy-fp32") as runner:
        assert runner.infer({"input": np.zeros((2, 1, 8, 8), "float32")})["logits"].shape == (2, 10)
    with pytest.raises(ConfigError, match="build.toy.optimized"):
        config_from_dict({"build": {"backends": ["toy"], "toy": {"optimized": "very"}}})
