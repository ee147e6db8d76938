"""A packaged engine records the output its run held to top-1 agreement, named or chosen by default (integer labels
beside ``num_classes``), so ``kiln validate ENGINE`` holds it to top-1 agreement too."""

from __future__ import annotations

from kiln.core.records import EngineMetadata, EngineValidation
from kiln.stages.package.stage import _with_logits
from tests.stages.package.test_stage import engine_meta

OUTPUTS = [{"name": "features", "shape": ["batch", 4], "dtype": "float32"}]
OUTPUTS += [{"name": "logits", "shape": ["batch", 10], "dtype": "float32"}]


def _meta() -> EngineMetadata:
    inputs = [{"name": "input", "shape": ["batch", 8], "dtype": "float32"}]
    return engine_meta(backend="onnxruntime", device="cpu", inputs=inputs, outputs=OUTPUTS)


def _result(top1: float | None, outputs: dict | None = None) -> EngineValidation:
    common = {"backend": "onnxruntime", "precision": "fp32", "device": "cpu", "status": "validated"}
    return EngineValidation(name="e", top1_agreement=top1, outputs=outputs or {}, **common)


def test_the_output_validation_chose_is_recorded_where_no_setting_names_one() -> None:
    assert _with_logits(_meta(), None, _result(0.99), "logits").logits_output == "logits"


def test_the_output_the_engines_record_gives_an_agreement_where_the_baseline_names_none() -> None:
    stats = {"features": {"cosine": 1.0}, "logits": {"cosine": 1.0, "top1_agreement": 0.99}}
    assert _with_logits(_meta(), None, _result(0.99, stats), None).logits_output == "logits"


def test_the_setting_wins_and_no_agreement_records_none() -> None:
    assert _with_logits(_meta(), 0, _result(0.99), "logits").logits_output == "features"
    assert _with_logits(_meta(), None, _result(None), "logits").logits_output is None
