"""Where ONNX Runtime CPU engines alone load INT8 graphs, the Q/DQ graph (no engine's) is checked once and not
searched while ONNX Runtime CPU's own graph passes; a reader of the Q/DQ graph (TensorRT, ONNX Runtime CUDA) keeps
its search. Which engines read is part of the precision stage's cache key."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from kiln.calibration.config import CalibrationConfig
from kiln.pipeline.config import config_from_dict
from kiln.pipeline.runner import cache_key, settings_for
from kiln.pipeline.stage_list import stage_named
from kiln.stages.accuracy.config import GatesConfig
from kiln.stages.precision.config import FallbackConfig
from kiln.stages.precision.gate import GateCheck
from kiln.stages.precision.stage import _log_variant, not_made, reads_qdq
from kiln.stages.precision.variants import NOT_SEARCHED, Source, build_int8
from tests.conftest import tiny_config_dict
from tests.stages.precision.precision_graphs import inputs
from tests.stages.precision.test_ort_cpu_inherited_start import FEATURES, wide_then_head


def _build(tmp_path: Path, qdq_read: bool) -> dict[str, Any]:
    """Calibration data 100 times the held-out data's scale: the Q/DQ graph misses its gates at round 0 (its static
    input scale is too coarse), ONNX Runtime CPU's dynamic graph passes at round 0."""
    cal = [inputs(32, FEATURES, seed=s, scale=100.0) for s in range(4)]
    src = Source.prepare(wide_then_head(), tmp_path / "fp32" / "model.onnx", cal, None)
    gates = GatesConfig(per_precision={"int8": {"min_cosine": 0.99, "min_top1_agreement": 0.9}})
    check = GateCheck.on_samples(src.model, inputs(128, FEATURES, seed=9), gates=gates)
    out = tmp_path / "int8" / "model.onnx"
    return build_int8(src, out, CalibrationConfig(cache=False), FallbackConfig(nodes_per_round=1), check, qdq_read)


def test_only_ort_cpu_reading_runs_no_qdq_fallback_rounds(tmp_path: Path) -> None:
    entry = _build(tmp_path, qdq_read=False)
    own, cpu = entry["fallback"], entry["ort_cpu"]["fallback"]
    assert [r["round"] for r in own["rounds"]] == [0] and not own["passed"]
    assert own["not_searched"] == NOT_SEARCHED
    assert cpu["passed"] and [r["round"] for r in cpu["rounds"]] == [0]
    assert entry["backend_paths"] == {"onnxruntime-cpu": "int8/model.ort_cpu.onnx"}


def test_a_qdq_reader_keeps_the_qdq_search(tmp_path: Path) -> None:
    entry = _build(tmp_path, qdq_read=True)
    own = entry["fallback"]
    assert len(own["rounds"]) > 1 and own["passed"] and "not_searched" not in own


def test_the_unsearched_qdq_graph_is_said_at_info(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    entry = _build(tmp_path, qdq_read=False)
    assert not_made("int8", entry) is None and NOT_SEARCHED in entry["unmade"]
    with caplog.at_level(logging.INFO, logger="kiln.test"):
        _log_variant(logging.getLogger("kiln.test"), "int8", entry)
    said = [r for r in caplog.records if NOT_SEARCHED in r.getMessage()]
    assert said and all(r.levelno == logging.INFO for r in said)


@pytest.mark.parametrize(
    "build, qdq",
    [
        ({"backends": ["onnxruntime"]}, False),
        ({"backends": ["onnxruntime"], "onnxruntime": {"devices": ["cpu", "cuda"]}}, True),
        ({"backends": ["onnxruntime", "tensorrt"]}, True),
    ],
)
def test_the_stage_reads_which_engines_load_the_qdq_graph(build: dict[str, Any], qdq: bool) -> None:
    cfg = config_from_dict(tiny_config_dict(build=build))
    assert reads_qdq(settings_for(stage_named("precision"), cfg).graph_engines) is qdq


def test_the_onnxruntime_devices_are_in_the_precision_key(tmp_path: Path) -> None:
    def key(devices: list[str]) -> str:
        cfg = config_from_dict(tiny_config_dict(**{"build.onnxruntime": {"devices": devices}}))
        return cache_key(stage_named("precision"), cfg, tmp_path)[0]

    assert key(["cpu"]) != key(["cpu", "cuda"]) and key(["cpu", "cuda"]) == key(["cuda", "cpu"])
