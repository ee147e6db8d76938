"""Reduced precision that is not faster than FP32: flagged per engine, dropped with precision.require_speedup."""

from __future__ import annotations

import json
from pathlib import Path

from kiln.core.records import EngineValidation
from kiln.stages.precision.speed import drop_slower, speed_vs_fp32
from tests.conftest import tiny_config_dict


def engine(
    name: str, precision: str, p50: dict[str, float], backend: str = "onnxruntime", device: str = "cpu"
) -> EngineValidation:
    return EngineValidation(
        name=name,
        backend=backend,
        device=device,
        precision=precision,
        status="validated",
        latency_ms={bs: {"p50": v, "p90": v, "p99": v} for bs, v in p50.items()},
    )


def test_int8_compared_with_fp32_and_fp16_of_its_own_backend() -> None:
    engines = [
        engine("ort-fp32", "fp32", {"1": 1.0, "32": 10.0}),
        engine("ort-fp16", "fp16", {"1": 2.0, "32": 20.0}),
        engine("ort-int8", "int8", {"1": 0.5, "32": 12.5}),
        engine("trt-int8", "int8", {"1": 0.1, "32": 1.0}, backend="tensorrt", device="cuda"),
    ]
    rows = {r["engine"]: r for r in speed_vs_fp32(engines)}
    assert set(rows) == {"ort-fp16", "ort-int8"}  # no FP32 TensorRT engine: nothing to compare it with
    assert rows["ort-int8"]["vs_fp32"] == {"1": 2.0, "32": 0.8} and rows["ort-int8"]["vs_fp16"] == {"1": 4.0, "32": 1.6}
    assert rows["ort-int8"]["slower"] and rows["ort-fp16"]["slower"]  # judged at the largest batch (32), not 1
    assert drop_slower(engines, list(rows.values())) == ["ort-fp16", "ort-int8"]
    assert "0.80x" in engines[2].dropped and engines[0].dropped is None and engines[3].dropped is None


def test_fp8_and_int8_are_judged_against_fp16_where_it_was_built() -> None:
    """A GPU's FP8/INT8 engine faster than FP32 but slower than FP16 is slower: FP16 is what it must beat to be
    worth serving; without an FP32 engine the FP16 one is still its reference."""
    engines = [
        engine("t-fp16", "fp16", {"1": 0.5, "32": 1.7}, backend="torch", device="cuda"),
        engine("t-fp8", "fp8", {"1": 0.8, "32": 2.2}, backend="torch", device="cuda"),
        engine("t-int8", "int8", {"1": 0.7, "32": 1.5}, backend="torch", device="cuda"),
    ]
    rows = {r["engine"]: r for r in speed_vs_fp32(engines)}
    assert set(rows) == {"t-fp8", "t-int8"}  # FP16 has no FP32 engine to be judged against
    assert rows["t-fp8"]["judged_against"] == "fp16" and rows["t-fp8"]["vs_fp32"] == {}
    assert rows["t-fp8"]["slower"] and not rows["t-int8"]["slower"]
    assert drop_slower(engines, list(rows.values())) == ["t-fp8"]
    assert engines[1].dropped == "slower than FP16 at batch 32 (0.77x; INT8/FP8 must beat FP16)"
    from kiln.stages.validate.stage import _under_fp16  # validation drops these rows' slower engines by default

    assert sorted(r["engine"] for r in rows.values() if _under_fp16(r)) == ["t-fp8", "t-int8"]


def test_require_speedup_drops_exactly_the_slower_engines_from_the_package(tmp_path: Path) -> None:
    from kiln.pipeline.api import run_pipeline
    from kiln.pipeline.config import config_from_dict

    cfg = config_from_dict(
        tiny_config_dict(**{"precision.variants": ["fp32", "int8"], "precision.require_speedup": True})
    )
    result, _ = run_pipeline(cfg, tmp_path)
    assert result.ok
    validation = json.loads((tmp_path / "validate" / "validation.json").read_text())
    packaged = {m["engine"] for m in json.loads((tmp_path / "package" / "kiln-package.json").read_text())["models"]}
    rows = validation["speed_vs_fp32"]
    assert [r["engine"] for r in rows] == ["onnxruntime-cpu-int8"]
    for r in rows:  # whichever way this machine's timing went, the package follows it
        assert (r["engine"] in packaged) is not r["slower"]
        assert (r["engine"] in validation["dropped"]) is r["slower"]
    assert "onnxruntime-cpu-fp32" in packaged
    assert "Reduced precision vs FP32 and FP16, same backend and device" in (tmp_path / "report.md").read_text()
