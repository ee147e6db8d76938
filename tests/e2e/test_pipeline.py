"""The real pipeline end to end on a tiny model: a first run that passes, a rerun from cache, the report, a
setting that reruns only the stages after it, a damaged engine rebuilt, a failed gate."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kiln.core.cpu_int8 import int8_kernels
from kiln.core.records import EngineMetadata, Variants
from kiln.pipeline.api import run_pipeline
from kiln.pipeline.config import config_from_dict
from kiln.pipeline.report import render_markdown
from kiln.stages.engines.registry import load_engine
from tests.conftest import tiny_config_dict


def statuses(result: Any) -> dict[str, str]:
    return {r.name: r.status for r in result.records}


@pytest.fixture(scope="module")
def first_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, dict[str, Any]]:
    workdir = tmp_path_factory.mktemp("run")
    result, report = run_pipeline(config_from_dict(tiny_config_dict()), workdir)
    return workdir, result, report


def test_a_first_run_passes_and_a_rerun_is_cached(first_run: tuple[Path, Any, dict[str, Any]]) -> None:
    workdir, result, report = first_run
    assert result.ok, result.error
    assert set(statuses(result).values()) == {"ran"} and report["validation"]["passed"] is True
    ort = [e for e in report["validation"]["engines"] if e["backend"] == "onnxruntime"]
    assert ort and ort[0]["cosine"] >= 0.9999 and ort[0]["top1_agreement"] == 1.0
    assert {"p50", "p90", "p99"} <= set(ort[0]["latency_ms"]["8"])
    on_disk = json.loads((workdir / "report.json").read_text())
    assert on_disk["stages"]["train"]["status"] == "ran" and (workdir / "report.md").read_text().startswith("# Kiln")
    again, report = run_pipeline(config_from_dict(tiny_config_dict()), workdir)
    assert set(statuses(again).values()) == {"cached"} and report["validation"]["passed"] is True
    md = render_markdown(report)
    assert "(ran in " in md  # cached stages keep their original time
    assert "(≥ 0.9999)" in md and "(≥ 0.99)" in md  # each gate beside its value
    assert "`package/engines/onnxruntime-cpu-fp32/`" in md and "`package/triton/tiny_onnxruntime_cpu_fp32/`" in md
    assert f"ONNX Runtime CPU INT8 kernels: {int8_kernels()}" in md  # what the CPU INT8 latencies ran


def test_each_engine_records_its_float_inputs_range_in_the_data(first_run: tuple[Path, Any, dict[str, Any]]) -> None:
    """The range ``kiln validate ENGINE`` without ``--inputs`` draws random values in: the data's, not N(0, 1)."""
    workdir, _, _ = first_run
    recorded = Variants.read(workdir / "precision" / "variants.json", "").value_ranges
    ((name, (low, high)),) = recorded.items()
    assert low < high
    for path in (workdir / "package" / "engines").glob("*/kiln-engine.json"):
        assert EngineMetadata.read(path, "").value_ranges == {name: [low, high]}


def test_a_cached_rerun_loads_no_torch_onnx_or_onnx_runtime(
    first_run: tuple[Path, Any, dict[str, Any]], tmp_path: Path
) -> None:
    """Deciding that every stage is cached (keys, summaries, the report) needs none of the libraries the stages run:
    torch's import alone is most of such a run's time. Nor does a stage whose own code needs none (package)."""
    workdir, _, _ = first_run
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(tiny_config_dict()))
    loaded = tmp_path / "loaded.json"
    code = (
        "import atexit, json, sys\n"
        f"atexit.register(lambda: open({str(loaded)!r}, 'w').write(json.dumps(sorted("
        "{'torch', 'onnx', 'onnxruntime'} & set(sys.modules)))))\n"
        "from kiln.cli import command\n"
        "command()\n"
    )
    args = ["run", str(config), "--workdir", str(workdir), "--quiet"]
    for more, ran in (([], set()), (["--force", "package"], {"package"})):  # packaging needs none of them either
        done = subprocess.run([sys.executable, "-c", code, *args, *more], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        report = json.loads((workdir / "report.json").read_text())
        assert {n for n, s in report["stages"].items() if s["status"] != "cached"} == ran
        assert json.loads(loaded.read_text()) == []


def test_a_build_setting_reruns_build_and_what_follows(first_run: tuple[Path, Any, dict[str, Any]]) -> None:
    workdir, _, _ = first_run
    cfg = config_from_dict(tiny_config_dict(**{"build.onnxruntime.intra_op_threads": 1}))
    result, _ = run_pipeline(cfg, workdir)
    before = dict.fromkeys(("train", "export", "optimize", "precision"), "cached")
    assert statuses(result) == {**before, "build": "ran", "validate": "ran", "package": "ran"} and result.ok


def test_a_damaged_engine_is_rebuilt_not_validated_stale(first_run: tuple[Path, Any, dict[str, Any]]) -> None:
    workdir, _, _ = first_run
    cfg = config_from_dict(tiny_config_dict())
    run_pipeline(cfg, workdir)
    engine = next((workdir / "build").glob("*/engine.onnx"))
    data = bytearray(engine.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 64] = bytes(64)
    engine.write_bytes(bytes(data))
    result, _ = run_pipeline(cfg, workdir)
    assert statuses(result)["build"] == "ran" and result.ok
    with load_engine(engine.parent):  # the rebuilt engine matches its metadata again
        pass


def test_a_failed_gate_fails_the_run_with_its_values(tmp_path: Path) -> None:
    cfg = config_from_dict(tiny_config_dict(**{"validate.gates.max_latency_p50_ms": 1e-9}))
    result, report = run_pipeline(cfg, tmp_path)
    assert not result.ok and "max_latency" not in str(result.error)
    assert "p50 latency" in str(result.error) and report["validation"]["passed"] is False
    assert statuses(result)["package"] == "not-run"


def test_a_package_kept_from_an_earlier_run_is_not_served_as_this_ones(
    first_run: tuple[Path, Any, dict[str, Any]], tmp_path: Path
) -> None:
    """A later run whose gates fail keeps the earlier package (nothing built is lost), but `kiln serve` on the
    workdir refuses it, naming what changed since it was packaged, rather than serving another model's engines."""
    from kiln.core.errors import GateFailure
    from kiln.serve.server import find_engines

    workdir = tmp_path / "run"
    shutil.copytree(first_run[0], workdir)
    assert find_engines(workdir)  # the passed run's package serves
    cfg = config_from_dict(tiny_config_dict(**{"seed": 7, "validate.gates.max_latency_p50_ms": 1e-9}))
    result, _ = run_pipeline(cfg, workdir)
    assert not result.ok and statuses(result)["package"] == "not-run"
    with pytest.raises(GateFailure, match="holds the engines of an earlier run: .*changed since") as refused:
        find_engines(workdir)
    assert "kiln serve " in (refused.value.hint or "")
    one = sorted((workdir / "package" / "engines").iterdir())[0]
    assert find_engines(one)  # asked for by its folder, the earlier engine is served


def test_an_identical_rebuild_keeps_validation_and_the_package(
    first_run: tuple[Path, Any, dict[str, Any]], tmp_path: Path
) -> None:
    """An engine's files say what it is, not how long it took to build (that is in the build summary): a forced
    rebuild that comes out the same leaves validate and package cached."""
    workdir = tmp_path / "run"
    shutil.copytree(first_run[0], workdir)
    cfg = config_from_dict(tiny_config_dict())
    assert run_pipeline(cfg, workdir)[0].ok  # as this config built it (an earlier test may have changed build)
    result, _ = run_pipeline(cfg, workdir, force={"build"})
    assert statuses(result)["build"] == "ran" and result.records[4].summary.engines[0].build_seconds > 0
    assert statuses(result)["validate"] == "cached" and statuses(result)["package"] == "cached"
