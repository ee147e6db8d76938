"""precision.required: a precision the run must deliver, else validation fails (exit 3), however its FP32 engines
did."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.core.records import NONE_VALIDATED, EngineValidation
from kiln.pipeline.config import config_from_dict
from kiln.pipeline.runner import Runner, gate_hint
from kiln.pipeline.stage_list import STAGES
from kiln.stages.validate.stage import required_failures
from tests.conftest import tiny_config_dict


def _engine(name: str, precision: str, status: str = "validated", passed: bool | None = True) -> EngineValidation:
    return EngineValidation(
        name=name, backend="onnxruntime", device="cpu", precision=precision, status=status, passed=passed
    )


def test_each_way_a_required_precision_goes_undelivered_is_named() -> None:
    fp32, int8 = _engine("ort-fp32", "fp32"), _engine("ort-int8", "int8")
    assert required_failures(["int8"], [fp32, int8], []) == []
    assert required_failures([], [fp32], []) == []
    said = lambda engines, dropped=(): required_failures(["int8"], engines, list(dropped))  # noqa: E731
    assert said([fp32]) == ["precision.required: no int8 engine was built (the result line says why)"]
    trt = _engine("trt-int8", "int8", "not-runnable", None).model_copy(update={"reason": "no CUDA GPU"})
    assert said([fp32, trt]) == [
        "precision.required: int8 engines were built but not validated on this machine (trt-int8: no CUDA GPU)"
    ]
    elsewhere = said([fp32, trt]) + [f"{NONE_VALIDATED} (built for other devices: trt-int8)"]
    assert gate_hint(elsewhere, "ran").startswith("validate the engines on a machine that runs them")
    assert said([fp32, _engine("ort-int8", "int8", passed=False)]) == [
        "precision.required: no int8 engine passed its gates"
    ]
    assert said([fp32, int8], ["ort-int8", "ort-fp16"]) == [
        "precision.required: every int8 engine that passed was slower and dropped (ort-int8)"
    ]


def test_a_required_int8_that_its_gates_left_unmade_fails_the_run(tmp_path: Path) -> None:
    """A gate no INT8 graph meets leaves the variant unmade: the run passed on FP32 with exit 0 and no INT8 engine."""
    cfg = config_from_dict(
        tiny_config_dict(
            **{
                "precision.variants": ["fp32", "int8"],
                "precision.required": ["int8"],
                "validate.gates.per_precision.int8.min_cosine": 0.99999999,
                "precision.node_errors": False,
                "package.enabled": False,
            }
        )
    )
    result = Runner(cfg, tmp_path, STAGES).run()
    assert not result.ok and type(result.error).__name__ == "GateFailure", result.error
    assert "precision.required: no int8 engine was built" in str(result.error)
    assert "precision.required" in gate_hint(["precision.required: no int8 engine was built"], "ran")
    assert [r.status for r in result.records if r.name == "validate"] == ["ran"]


def test_a_required_precision_the_run_does_not_make_is_a_config_error() -> None:
    """Else the whole pipeline ran before validation failed on it."""
    from kiln.core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"precision.required \['fp16'\] are not among precision.variants"):
        config_from_dict(tiny_config_dict(**{"precision.variants": ["fp32", "int8"], "precision.required": ["fp16"]}))


def test_changing_what_validation_requires_reruns_no_graph_stage(tmp_path: Path) -> None:
    """precision.required and require_speedup are validation's: the precision stage's key leaves them out."""
    from kiln.pipeline.runner import cache_key
    from kiln.pipeline.stage_list import stage_named

    keys = []
    for over in ({}, {"precision.required": ["fp32"], "precision.require_speedup": True}):
        cfg = config_from_dict(tiny_config_dict(**over))
        _, parts = cache_key(stage_named("precision"), cfg, tmp_path, {})
        _, validate = cache_key(stage_named("validate"), cfg, tmp_path, {})
        keys.append((parts["config"], validate["config"]))
    assert keys[0][0] == keys[1][0] and keys[0][1] != keys[1][1]
