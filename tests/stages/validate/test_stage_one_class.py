"""A reference that answers one class at every held-out row (a CTR model that learnt only the prior) records it,
and the validation summary carries it into validation.json, beside the warning the log gives."""

from __future__ import annotations

import numpy as np

from kiln.core.records import Baseline, ValidationResult
from kiln.stages.accuracy.check import Reference

ROWS = 32


def _reference(logits: np.ndarray, labels: np.ndarray | None) -> Reference:
    x = np.arange(ROWS, dtype=np.float32)[:, None]  # each row its own index: rows run alone answer alike
    return Reference(
        lambda feed: {"logits": logits[feed["x"][:, 0].astype(int)]}, [({}, {"x": x})], [labels], "logits", 4
    )


def test_a_one_logit_reference_deciding_negative_everywhere_records_it() -> None:
    rng = np.random.default_rng(0)
    labels = (rng.random(ROWS) < 0.125).astype(np.int64)
    prior = rng.uniform(-3.2, -3.1, (ROWS, 1)).astype(np.float32)
    assert _reference(prior, labels).one_class == "decides negative at all 32 rows of output 'logits'"
    mixed = rng.standard_normal((ROWS, 1)).astype(np.float32)
    assert _reference(mixed, labels).one_class is None


def test_class_logits_with_one_class_on_top_everywhere_record_it() -> None:
    logits = np.random.default_rng(1).standard_normal((ROWS, 5)).astype(np.float32)
    logits[:, 0] += 20.0
    said = _reference(logits, None).one_class
    assert said == "puts class 0 of output 'logits' on top at all 32 of its rows", said


def test_the_validation_summary_keeps_it_in_its_json() -> None:
    base = Baseline(accuracy=0.9512, samples=512, latency_ms={})
    v = ValidationResult(passed=True, baseline=base, engines=[], failures=[], one_class="decides negative at all")
    assert ValidationResult.model_validate_json(v.model_dump_json()).one_class == "decides negative at all"
    assert ValidationResult(passed=True, baseline=base, engines=[], failures=[]).one_class is None
