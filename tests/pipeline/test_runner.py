"""The cache and resume behaviour of the stage runner, on the real pipeline with a tiny model."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from kiln.core.artifacts import hash_file
from kiln.core.errors import BuildError
from kiln.pipeline import runner as runner_module
from kiln.pipeline.api import run_pipeline
from kiln.pipeline.config import config_from_dict
from kiln.pipeline.runner import Runner, cache_key
from kiln.pipeline.stage_list import STAGES
from kiln.stages.engines.registry import load_engine
from tests.conftest import tiny_config_dict


def statuses(result) -> dict[str, str]:
    return {r.name: r.status for r in result.records}


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("run")
    cfg = config_from_dict(tiny_config_dict())
    result, report = run_pipeline(cfg, workdir)
    return workdir, result, report


def test_first_run_runs_everything_and_passes(first_run) -> None:
    workdir, result, report = first_run
    assert result.ok, result.error
    assert set(statuses(result).values()) == {"ran"}
    assert report["validation"]["passed"] is True
    ort = [e for e in report["validation"]["engines"] if e["backend"] == "onnxruntime"]
    assert ort and ort[0]["cosine"] >= 0.9999 and ort[0]["top1_agreement"] == 1.0
    assert {"p50", "p90", "p99"} <= set(ort[0]["latency_ms"]["8"])
    on_disk = json.loads((workdir / "report.json").read_text())
    assert on_disk["stages"]["train"]["status"] == "ran" and (workdir / "report.md").read_text().startswith("# Kiln")


def test_rerun_is_fully_cached(first_run) -> None:
    workdir, _, _ = first_run
    result, report = run_pipeline(config_from_dict(tiny_config_dict()), workdir)
    assert set(statuses(result).values()) == {"cached"}
    assert report["validation"]["passed"] is True


def test_changing_one_setting_reruns_only_downstream(first_run) -> None:
    workdir, _, _ = first_run
    cfg = config_from_dict(tiny_config_dict(**{"build.onnxruntime.intra_op_threads": 1}))
    result, _ = run_pipeline(cfg, workdir)
    assert statuses(result) == {
        "train": "cached",
        "export": "cached",
        "optimize": "cached",
        "precision": "cached",
        "build": "ran",
        "validate": "ran",
        "package": "ran",
    }


def test_force_and_stop(first_run) -> None:
    workdir, _, _ = first_run
    cfg = config_from_dict(tiny_config_dict(**{"build.onnxruntime.intra_op_threads": 1}))
    result, _ = run_pipeline(cfg, workdir, force={"optimize"}, stop="optimize")
    assert statuses(result) == {"train": "cached", "export": "cached", "optimize": "ran"}


def test_failed_stage_keeps_earlier_work_and_rerun_resumes(tmp_path: Path) -> None:
    cfg = config_from_dict(tiny_config_dict())

    def broken_build(ctx):
        (ctx.out / "half-written.plan").write_bytes(b"x")
        raise BuildError("simulated builder failure")

    stages = [dataclasses.replace(s, run=broken_build) if s.name == "build" else s for s in STAGES]
    result = Runner(cfg, tmp_path, stages).run()
    assert isinstance(result.error, BuildError)
    assert statuses(result) == {
        "train": "ran",
        "export": "ran",
        "optimize": "ran",
        "precision": "ran",
        "build": "failed",
        "validate": "not-run",
        "package": "not-run",
    }
    assert not (tmp_path / "build").exists()  # nothing half-written left as if it were finished
    resumed, _ = run_pipeline(cfg, tmp_path)
    assert statuses(resumed)["train"] == "cached" and statuses(resumed)["build"] == "ran" and resumed.ok


def test_gate_failure_fails_the_run_with_values(tmp_path: Path) -> None:
    cfg = config_from_dict(tiny_config_dict(**{"validate.gates.max_latency_p50_ms": 1e-9}))
    result, report = run_pipeline(cfg, tmp_path)
    assert not result.ok and "max_latency" not in str(result.error)
    assert "p50 latency" in str(result.error) and report["validation"]["passed"] is False
    assert statuses(result)["package"] == "not-run"


def _keys(tmp_path: Path, **overrides) -> dict[str, str]:
    cfg = config_from_dict(tiny_config_dict(**overrides))
    return {s.name: cache_key(s, cfg, tmp_path)[0] for s in STAGES}


@pytest.mark.parametrize(
    "override, stages",
    [
        # build sizes engine profiles / autotuned shapes from the largest validate batch size
        ({"validate.batch_sizes": [1, 64]}, {"build", "validate"}),
        # the default dataset (and so calibration data, parity data, held-out data) follows model.name; build reads
        # the model section too (the torch backend compiles the trained model)
        ({"model.name": "transformer", "model.params": {}}, {"train", "export", "precision", "build", "validate"}),
        # built-in datasets are split by seed
        ({"seed": 1}, {"train", "export", "precision", "validate"}),
    ],
)
def test_cache_key_covers_config_the_stage_reads(tmp_path: Path, override, stages) -> None:
    # Before: build ignored validate.batch_sizes, precision model.name, export seed, validate model.
    before, after = _keys(tmp_path), _keys(tmp_path, **override)
    assert {name for name in before if before[name] != after[name]} == stages


def test_cache_key_ignores_gates_for_build(tmp_path: Path) -> None:
    before, after = _keys(tmp_path), _keys(tmp_path, **{"validate.gates.min_cosine": 0.5})
    assert before["build"] == after["build"] and before["validate"] != after["validate"]


def test_build_key_follows_the_cpu_int8_kernels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ORT CPU INT8 engines built where the fast INT8 kernels saturate hold uint8 weights (kiln.core.cpu_int8): a
    workdir moved to or from such a CPU rebuilds its engines, and reuses every other stage."""
    monkeypatch.setattr("kiln.core.cpu_int8.this_cpu_saturates", lambda: False)
    fast = _keys(tmp_path)
    monkeypatch.setattr("kiln.core.cpu_int8.this_cpu_saturates", lambda: True)
    exact = _keys(tmp_path)
    assert {name for name in fast if fast[name] != exact[name]} == {"build"}


def test_code_versions_cover_what_stages_run() -> None:
    # validate runs engines through kiln.stages.engines's runners; train builds models from the zoo.
    import kiln.models
    import kiln.stages.engines
    from kiln.pipeline.stage_list import stage_named

    assert kiln.stages.engines in stage_named("validate").code and kiln.models in stage_named("train").code
    assert kiln.models in stage_named("export").code and kiln.models in stage_named("validate").code


def test_cached_stages_report_this_runs_time(first_run) -> None:
    workdir, _, _ = first_run
    result, report = run_pipeline(
        config_from_dict(tiny_config_dict(**{"build.onnxruntime.intra_op_threads": 1})), workdir
    )
    train = report["stages"]["train"]
    # A cache hit takes milliseconds, training seconds: the stage reports this run's time, not the cached one's
    # (no absolute threshold: a loaded CI machine can stall any step).
    assert train["status"] == "cached" and 0 <= train["seconds"] < train["original_seconds"]


def test_editing_user_model_code_reruns_training(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib
    import sys

    pkg = tmp_path / "src"
    pkg.mkdir()
    module = pkg / "my_models.py"
    module.write_text("from kiln.models.cnn import SmallCNN\n\ndef build():\n    return SmallCNN(width=4, depth=2)\n")
    monkeypatch.syspath_prepend(str(pkg))
    cfg = config_from_dict(
        tiny_config_dict(**{"model.name": "my_models:build", "model.params": {}, "data.name": "digits"})
    )
    first, _ = run_pipeline(cfg, tmp_path / "wd", stop="export")
    assert statuses(first) == {"train": "ran", "export": "ran"}
    module.write_text(module.read_text().replace("width=4", "width=6"))
    sys.modules.pop("my_models", None)
    importlib.invalidate_caches()
    second, _ = run_pipeline(cfg, tmp_path / "wd", stop="export")
    assert statuses(second) == {"train": "ran", "export": "ran"}


def test_start_from_a_stage_reruns_it_and_everything_after(first_run) -> None:
    workdir, _, _ = first_run
    cfg = config_from_dict(tiny_config_dict(**{"build.onnxruntime.intra_op_threads": 1}))
    run_pipeline(cfg, workdir)  # settle the cache for this config first
    result, _ = run_pipeline(cfg, workdir, start="build")
    assert statuses(result) == {
        "train": "cached",
        "export": "cached",
        "optimize": "cached",
        "precision": "cached",
        "build": "ran",
        "validate": "ran",
        "package": "ran",
    }


def test_a_rerun_says_what_changed() -> None:
    from kiln.pipeline.runner import what_changed

    old = {"code": "a", "config": {"train": 1, "data": 2}, "user_data": {"dataset": "x"}}
    new = {"code": "a", "config": {"train": 1, "data": 3}, "user_data": {"dataset": "y"}, "user_code": {"m:f": "z"}}
    assert what_changed(old, new) == ["config.data", "user_code", "user_data.dataset"]
    assert what_changed(old, old) == []


def _flip(path: Path, n: int = 64) -> None:
    data = bytearray(path.read_bytes())
    mid = max(0, len(data) // 2 - n // 2)
    data[mid : mid + n] = bytes(b ^ 0xFF for b in data[mid : mid + n])  # same size: a size check cannot see it
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("stage", [s.name for s in STAGES])
def test_flipped_bytes_in_a_cached_stage_are_detected_and_rebuilt(first_run, stage: str) -> None:
    workdir, _, _ = first_run
    cfg = config_from_dict(tiny_config_dict())
    run_pipeline(cfg, workdir)  # whatever earlier tests left: back to this configuration, all cached
    manifest = json.loads((workdir / stage / "manifest.json").read_text())
    victim = max(manifest["outputs"], key=lambda rel: manifest["sizes"][rel])  # the model / engine / checkpoint
    _flip(workdir / stage / victim)
    result, report = run_pipeline(cfg, workdir)
    assert statuses(result)[stage] == "ran", f"{stage}/{victim} changed but the stage was reused"
    assert result.ok and report["validation"]["passed"] is True
    fresh = json.loads((workdir / stage / "manifest.json").read_text())
    assert hash_file(workdir / stage / victim) == fresh["outputs"][victim]


def test_flipped_engine_is_rebuilt_not_validated_stale(first_run) -> None:
    workdir, _, _ = first_run
    cfg = config_from_dict(tiny_config_dict())
    run_pipeline(cfg, workdir)
    engine = next((workdir / "build").glob("*/engine.onnx"))
    _flip(engine)
    result, _ = run_pipeline(cfg, workdir)
    assert statuses(result)["build"] == "ran" and result.ok
    with load_engine(engine.parent):  # the rebuilt engine matches its metadata again
        pass


@pytest.mark.parametrize("damage", ["garbage", "wrong-kind", "folder", "empty-outputs"])
def test_a_damaged_manifest_means_the_stage_is_redone(first_run, damage: str) -> None:
    workdir, _, _ = first_run
    cfg = config_from_dict(tiny_config_dict())
    run_pipeline(cfg, workdir)
    m = workdir / "optimize" / "manifest.json"
    if damage == "garbage":
        m.write_bytes(b"\x00\xff{not json")
    elif damage == "wrong-kind":
        m.write_text("[1, 2, 3]")
    elif damage == "folder":
        m.unlink()
        m.mkdir()
    else:
        data = json.loads(m.read_text())
        data["outputs"], data["sizes"] = {}, {}
        m.write_text(json.dumps(data))
    result, _ = run_pipeline(cfg, workdir)
    assert statuses(result)["optimize"] == "ran" and result.ok


def test_content_is_hashed_once_per_run(first_run, monkeypatch) -> None:
    workdir, _, _ = first_run
    cfg = config_from_dict(tiny_config_dict())
    run_pipeline(cfg, workdir)
    seen: list[Path] = []
    real = runner_module.hash_tree

    def counting(root, exclude=()):
        seen.append(Path(root))
        return real(root, exclude)

    monkeypatch.setattr(runner_module, "hash_tree", counting)
    result, _ = run_pipeline(cfg, workdir)
    assert set(statuses(result).values()) == {"cached"}
    assert len(seen) == len(set(seen)) == len(STAGES)


def test_report_shows_gates_package_and_original_times(first_run) -> None:
    from kiln.core.cpu_int8 import int8_kernels
    from kiln.pipeline.report import render_markdown

    workdir, _, _ = first_run
    cfg = config_from_dict(tiny_config_dict())
    result, report = run_pipeline(cfg, workdir)
    assert set(statuses(result).values()) == {"cached"}
    md = render_markdown(report)
    assert "(ran in " in md  # cached stages keep their original time
    assert "(≥ 0.9999)" in md and "(≥ 0.99)" in md  # each gate beside its value
    assert "## Package" in md and "package/triton/tiny_onnxruntime-cpu-fp32" not in md
    assert "`package/engines/onnxruntime-cpu-fp32/`" in md and "`package/triton/tiny_onnxruntime_cpu_fp32/`" in md
    assert f"ONNX Runtime CPU INT8 kernels: {int8_kernels()}" in md  # what the CPU INT8 latencies ran


def test_result_line_names_engines_built_but_not_validated() -> None:
    from kiln.pipeline.report import result_line

    report = {
        "ok": True,
        "validation": {
            "engines": [
                {"name": "onnxruntime-cpu-fp32", "status": "validated", "device": "cpu"},
                {"name": "tensorrt-fp16", "status": "not-runnable", "device": "cuda"},
                {"name": "tensorrt-fp32", "status": "not-runnable", "device": "cuda"},
            ]
        },
    }
    line = result_line(report)
    assert line.startswith("PASSED, 2 engines built but not validated: tensorrt-fp16, tensorrt-fp32")
    assert "CUDA" in line
    assert result_line({"ok": True, "validation": {"engines": []}}) == "PASSED"
