"""A rerun of the build stage keeps the engines whose own inputs are unchanged, through the pipeline's runner, and
rebuilds those whose graph, backend settings or versions changed."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import onnx
import pytest

from kiln.core.artifacts import MANIFEST, hash_file, hash_tree, write_json_atomic
from kiln.core.records import PrecisionVariant, Variants
from kiln.core.stage import StageContext
from kiln.pipeline.config import config_from_dict
from kiln.pipeline.runner import Runner, settings_for
from kiln.pipeline.stage_list import stage_named
from kiln.stages.engines.backend import read_metadata, verify_files
from kiln.stages.engines.declaration import BuildSummary, report_section
from kiln.stages.engines.registry import BACKENDS
from kiln.stages.engines.reuse import inputs_key

KEPT = "inputs unchanged, kept from the previous build"
FP32, INT8 = "onnxruntime-cpu-fp32", "onnxruntime-cpu-int8"


def _finished(folder: Path) -> None:
    """A manifest for ``folder`` as the runner writes one for a finished stage (its outputs hashed)."""
    folder.mkdir(parents=True, exist_ok=True)
    outputs = hash_tree(folder, exclude=(MANIFEST,))
    sizes = {rel: (folder / rel).stat().st_size for rel in outputs}
    write_json_atomic(
        folder / MANIFEST,
        {"stage": folder.name, "key": folder.name, "outputs": outputs, "sizes": sizes, "key_parts": {}, "summary": {}},
    )


def _workdir(tmp_path: Path, zoo) -> Path:
    """A workdir whose precision stage made FP32 and INT8 graphs of the zoo CNN (train and export finished too)."""
    work = tmp_path / "work"
    precision = work / "precision"
    variants = {}
    for p in ("fp32", "int8"):
        (precision / p).mkdir(parents=True)
        shutil.copy(zoo("cnn", p), precision / p / "model.onnx")
        variants[p] = PrecisionVariant(path=f"{p}/model.onnx")
    Variants(variants=variants).write(precision / "variants.json")
    for stage in ("train", "export", "precision"):
        _finished(work / stage)
    return work


def _touch_graph(work: Path, precision: str) -> None:
    """Change the bytes of one variant's graph (its doc string), as a precision stage run anew that made it otherwise
    does."""
    path = work / "precision" / precision / "model.onnx"
    model = onnx.load(str(path))
    model.doc_string = "made anew"
    onnx.save(model, str(path))
    _finished(work / "precision")


def _build(work: Path, force: bool = False, **build: Any) -> dict[str, Any]:
    """Run the build stage in ``work`` through the runner; the summary's engines by name."""
    cfg = config_from_dict({"build": {"backends": ["onnxruntime"], **build}, "signature": {"batch_sizes": [1, 8]}})
    result = Runner(cfg, work, [stage_named("build")]).run(force={"build"} if force else None)
    assert result.ok, result.error
    (record,) = result.records
    assert record.status == "ran"
    return {e.name: e for e in record.summary.engines}


@pytest.mark.parametrize("changed", ["int8", "fp32"])
def test_a_variant_s_changed_graph_rebuilds_its_engine_and_keeps_the_other(
    tmp_path: Path, zoo, caplog: pytest.LogCaptureFixture, changed: str
) -> None:
    work = _workdir(tmp_path, zoo)
    first = _build(work)
    before = {name: hash_tree(work / "build" / name) for name in (FP32, INT8)}
    _touch_graph(work, changed)
    caplog.set_level(logging.INFO, logger="kiln")
    second = _build(work)
    rebuilt, kept = (INT8, FP32) if changed == "int8" else (FP32, INT8)
    assert second[kept].reused and not second[rebuilt].reused
    assert f"engine {kept}: {KEPT}" in caplog.text and f"engine {rebuilt}: {KEPT}" not in caplog.text
    # the kept engine is the previous one, files, metadata and summary entry alike
    assert hash_tree(work / "build" / kept) == before[kept]
    assert second[kept].model_dump(exclude={"reused"}) == first[kept].model_dump(exclude={"reused"})
    # the report says which engine was kept, and the build time it took then
    table = "\n".join(report_section(BuildSummary(engines=list(second.values()))))
    assert f"| {kept} |" in table and f"kept (built in {first[kept].build_seconds:.2f})" in table
    assert table.count("kept (built in") == 1
    # the rebuilt one is built from the new graph
    graph = work / "precision" / changed / "model.onnx"
    assert read_metadata(work / "build" / rebuilt).source.sha256 == hash_file(graph)


def test_a_changed_setting_rebuilds_only_the_engines_of_its_backend(tmp_path: Path, zoo) -> None:
    work = _workdir(tmp_path, zoo)
    first = _build(work)
    hashes = {name: read_metadata(work / "build" / name).settings_hash for name in first}
    # another backend's setting reruns the stage (its key holds the whole build section), not these engines' build
    other = _build(work, torch={"flavour": "compiled"})
    assert all(e.reused for e in other.values())
    # their own backend's setting rebuilds them
    own = _build(work, torch={"flavour": "compiled"}, onnxruntime={"intra_op_threads": 1})
    assert not any(e.reused for e in own.values())
    assert all(read_metadata(work / "build" / name).settings_hash != hashes[name] for name in own)
    # and --force build rebuilds every engine, their inputs unchanged
    forced = _build(work, force=True, torch={"flavour": "compiled"}, onnxruntime={"intra_op_threads": 1})
    assert not any(e.reused for e in forced.values())
    # also where something else changed in the same run (here another backend's setting): forced keeps nothing
    both = _build(work, force=True, onnxruntime={"intra_op_threads": 1})
    assert not any(e.reused for e in both.values())


def test_an_engine_whose_files_changed_since_its_build_is_built_again(tmp_path: Path, zoo) -> None:
    work = _workdir(tmp_path, zoo)
    _build(work)
    meta = read_metadata(work / "build" / INT8)
    damaged = work / "build" / INT8 / meta.files["model"]
    damaged.write_bytes(damaged.read_bytes() + b"\0")  # not the bytes the build's manifest recorded
    second = _build(work, torch={"flavour": "compiled"})  # reruns the stage; no engine's inputs changed
    assert second[FP32].reused and not second[INT8].reused
    rebuilt = read_metadata(work / "build" / INT8)
    verify_files(work / "build" / INT8, rebuilt)  # its own files, not the damaged copy
    assert rebuilt.settings_hash == meta.settings_hash  # from the same inputs


def _key(tmp_path: Path, backend: str, precision: str, **parts: Any) -> str | None:
    """``inputs_key`` of an engine of the graph ``g.onnx`` in ``tmp_path``, under stage key parts ``parts``."""
    cfg = config_from_dict({"build": {"backends": ["onnxruntime", "torch"]}})
    settings = settings_for(stage_named("build"), cfg)
    ctx = StageContext("build", settings, tmp_path, tmp_path / "out", {"precision": tmp_path}, key_parts=parts)
    graph = tmp_path / "g.onnx"
    return inputs_key(ctx, BACKENDS[backend], "cpu", precision, [graph], None, {"max_batch": 8})


def test_a_torch_engine_s_key_holds_the_trained_model_and_a_graph_engine_s_does_not(tmp_path: Path, zoo) -> None:
    shutil.copy(zoo("cnn"), tmp_path / "g.onnx")
    base = {"code": "c", "env": {"versions": {"torch": "2", "onnxruntime": "1"}}, "config": {"model": {"name": "m"}}}
    trained = {**base, "inputs": {"train": "weights-1"}}
    retrained = {**base, "inputs": {"train": "weights-2"}}
    assert _key(tmp_path, "torch", "fp32", **trained) != _key(tmp_path, "torch", "fp32", **retrained)
    assert _key(tmp_path, "onnxruntime", "fp32", **trained) == _key(tmp_path, "onnxruntime", "fp32", **retrained)
    # each backend's key holds its own runtime's version, not another backend's
    newer_torch = {**trained, "env": {"versions": {"torch": "3", "onnxruntime": "1"}}}
    assert _key(tmp_path, "onnxruntime", "fp32", **trained) == _key(tmp_path, "onnxruntime", "fp32", **newer_torch)
    assert _key(tmp_path, "torch", "fp32", **trained) != _key(tmp_path, "torch", "fp32", **newer_torch)
    # Kiln's build code is in every key; outside the runner (no key parts) nothing is kept
    assert _key(tmp_path, "onnxruntime", "fp32", **{**trained, "code": "d"}) != _key(
        tmp_path, "onnxruntime", "fp32", **trained
    )
    assert _key(tmp_path, "onnxruntime", "fp32") is None


def test_a_file_a_backend_setting_names_is_in_its_engines_key(tmp_path: Path, zoo) -> None:
    shutil.copy(zoo("cnn"), tmp_path / "g.onnx")
    table = tmp_path / "calibration.cache"
    table.write_text("TRT-1")
    cfg = config_from_dict({"build": {"backends": ["tensorrt"], "tensorrt": {"calibration_cache": str(table)}}})
    ctx = StageContext(
        "build", settings_for(stage_named("build"), cfg), tmp_path, tmp_path, {}, key_parts={"code": "c"}
    )
    before = inputs_key(ctx, BACKENDS["tensorrt"], "cuda", "int8", [tmp_path / "g.onnx"], None, {})
    table.write_text("TRT-2")  # TensorRT's calibrator reads the table: a new one is a new engine
    assert inputs_key(ctx, BACKENDS["tensorrt"], "cuda", "int8", [tmp_path / "g.onnx"], None, {}) != before
