import json

import pytest

from kiln.core.records import EngineMetadata
from kiln.stages.package.triton import triton_config


def engine_meta(**fields) -> EngineMetadata:
    return EngineMetadata(
        name="e",
        precision="fp32",
        source={"file": "m.onnx", "sha256": "0"},
        files={"model": "engine"},
        flavour=fields["backend"],
        versions={},
        **fields,
    )


def test_triton_config_for_onnxruntime_cpu_engine() -> None:
    meta = engine_meta(
        **{
            "backend": "onnxruntime",
            "device": "cpu",
            "inputs": [{"name": "input", "shape": ["batch", 1, 8, 8], "dtype": "float32"}],
            "outputs": [{"name": "logits", "shape": ["batch", 10], "dtype": "float32"}],
        }
    )
    text = triton_config("demo_cnn", meta, 32)
    assert 'platform: "onnxruntime_onnx"' in text and "max_batch_size: 32" in text
    assert "dims: [ 1, 8, 8 ]" in text and "dims: [ 10 ]" in text and "KIND_CPU" in text and "dynamic_batching" in text


def test_triton_config_for_tensorrt_plan_with_int64_input() -> None:
    meta = engine_meta(
        **{
            "backend": "tensorrt",
            "device": "cuda",
            "inputs": [{"name": "ids", "shape": ["batch", 64], "dtype": "int64"}],
            "outputs": [{"name": "logits", "shape": ["batch", "n"], "dtype": "float16"}],
        }
    )
    text = triton_config("m", meta, 0)
    assert 'platform: "tensorrt_plan"' in text and "TYPE_INT64" in text and "dims: [ batch, 64 ]" not in text
    assert "dims: [ -1, 64 ]" in text and "dims: [ -1, -1 ]" in text and "KIND_GPU" in text


def test_packaged_run_has_triton_repository(tmp_path, tiny_config) -> None:
    from kiln.pipeline.api import run_pipeline

    result, _ = run_pipeline(tiny_config, tmp_path)
    assert result.ok
    pkg = json.loads((tmp_path / "package" / "kiln-package.json").read_text())
    model = pkg["models"][0]
    repo = tmp_path / "package" / "triton" / model["triton_model"]
    assert (repo / "config.pbtxt").is_file() and (repo / "1" / "model.onnx").is_file()
    python_repo = tmp_path / "package" / "triton-python" / model["triton_python_model"]
    assert 'backend: "python"' in (python_repo / "config.pbtxt").read_text()
    assert (python_repo / "1" / "model.py").is_file() and (python_repo / "1" / "engine" / "kiln-engine.json").is_file()
    # served by tests/pipeline/test_serve.py in the bundled tritonserver
    assert model["validation"]["cosine"] >= 0.9999
    # validated at signature.batch_sizes [1, 8]: the packaged engine says so, and no repository batches past 8
    # (package.max_batch_size is 32)
    assert "max_batch_size: 8\n" in (repo / "config.pbtxt").read_text()
    assert "max_batch_size: 8\n" in (python_repo / "config.pbtxt").read_text()
    packaged = EngineMetadata.read(tmp_path / "package" / "engines" / model["engine"] / "kiln-engine.json", hint="")
    assert packaged.validated_batch_sizes == [1, 8]


def test_triton_batch_is_capped_by_the_engines_batch_range() -> None:
    meta = engine_meta(
        **{
            "backend": "tensorrt",
            "device": "cuda",
            "batch_range": (1, 16),
            "inputs": [{"name": "input", "shape": ["batch", 3, 8, 8], "dtype": "float32"}],
            "outputs": [{"name": "logits", "shape": ["batch", 10], "dtype": "float32"}],
        }
    )
    assert "max_batch_size: 16" in triton_config("m", meta, 32)
    assert "max_batch_size: 8" in triton_config("m", meta, 8)


@pytest.mark.parametrize("asked", [True, False])
def test_a_batch_cap_is_a_warning_only_where_the_config_asked_for_more(
    asked: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """package.max_batch_size set above the validated batches is a warning; its default (32) above a run validated
    at [1, 8] is a log line, not a warning on every run."""
    import logging
    from types import SimpleNamespace

    from kiln.stages.package.stage import _say_batch_limit

    meta = engine_meta(
        backend="onnxruntime",
        device="cpu",
        validated_batch_sizes=[1, 8],
        inputs=[{"name": "input", "shape": ["batch", 4], "dtype": "float32"}],
        outputs=[{"name": "logits", "shape": ["batch", 2], "dtype": "float32"}],
    )
    with caplog.at_level(logging.INFO, logger="kiln.test"):
        _say_batch_limit(SimpleNamespace(log=logging.getLogger("kiln.test")), [meta], 32, asked=asked)
    (record,) = caplog.records
    assert record.levelno == (logging.WARNING if asked else logging.INFO)
    assert "served with batches up to 8 rows" in record.getMessage()


def test_a_two_tower_engine_is_packaged_unbatched_for_every_server(
    tmp_path, tiny_config, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine whose inputs come in counts of their own (``texts``, ``images``): both Triton repositories are
    written with ``max_batch_size: 0`` (Triton's batcher would refuse 5 texts with 2 images), the Ray app's replica
    takes the same decision from the packaged metadata, and the log says why."""
    import logging

    import yaml

    from kiln.core.records import Baseline, EngineValidation, ValidationResult
    from kiln.stages.package.stage import run
    from kiln.stages.package.triton import served_max_batch
    from tests.conftest import stage_context
    from tests.stages.engines.two_tower_engine import two_tower_engine

    (tmp_path / "build").mkdir()
    _, meta = two_tower_engine(tmp_path / "build")
    checked = EngineValidation(
        name=meta.name, backend=meta.backend, precision="fp32", device="cpu", status="validated", passed=True
    )
    checked.batch_sizes = [1, 8]
    (tmp_path / "validate").mkdir()
    validation = ValidationResult(
        passed=True, baseline=Baseline(accuracy=None, samples=8, latency_ms={}), engines=[checked], failures=[]
    )
    validation.write(tmp_path / "validate" / "validation.json")
    inputs = {"build": tmp_path / "build", "validate": tmp_path / "validate"}
    ctx = stage_context("package", tiny_config, tmp_path, tmp_path / "package", inputs)
    monkeypatch.setattr(logging.getLogger("kiln"), "propagate", True)  # a CLI test in this worker turns it off
    with caplog.at_level(logging.INFO):
        model = run(ctx).models[0]
    for layout, name in (("triton", model["triton_model"]), ("triton-python", model["triton_python_model"])):
        text = (tmp_path / "package" / layout / name / "config.pbtxt").read_text()
        assert "max_batch_size: 0\n" in text and "dynamic_batching" not in text, (layout, text)
    app = yaml.safe_load((tmp_path / "package" / "ray" / "serve.yaml").read_text())["applications"][0]["args"]
    packaged = EngineMetadata.read(tmp_path / "package" / app["engine_dir"] / "kiln-engine.json", hint="")
    assert served_max_batch(packaged, app["max_batch_size"]) == 0  # what the Ray app's replica serves with
    assert "inputs in counts of their own (first axes texts, images) are served unbatched" in caplog.text
