"""The precision stage's declared settings: its cache key covers the accuracy gates a variant is held to, and not
the gates only validation reads (latency)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kiln.pipeline.config import config_from_dict
from kiln.pipeline.runner import cache_key, settings_for, what_changed
from kiln.pipeline.stage_list import STAGES, stage_named
from tests.conftest import tiny_config_dict


def _keys(tmp_path: Path, **overrides: Any) -> dict[str, tuple[str, dict[str, Any]]]:
    cfg = config_from_dict(tiny_config_dict(**overrides))
    return {s.name: cache_key(s, cfg, tmp_path) for s in STAGES if s.name in ("precision", "validate")}


@pytest.mark.parametrize(
    "override, stages",
    [
        ({"validate.gates.max_latency_p50_ms": 1000.0}, {"validate"}),
        ({"validate.gates.min_cosine": 0.5}, {"precision", "validate"}),
        ({"validate.gates.per_precision": {"int8": {"min_top1_agreement": 0.5}}}, {"precision", "validate"}),
        ({"validate.max_samples": 7}, {"precision", "validate"}),
    ],
)
def test_a_latency_gate_leaves_precision_cached(tmp_path: Path, override: dict, stages: set[str]) -> None:
    before, after = _keys(tmp_path), _keys(tmp_path, **override)
    assert {name for name in before if before[name][0] != after[name][0]} == stages


def test_a_changed_accuracy_gate_is_named(tmp_path: Path) -> None:
    (_, before), (_, after) = (
        _keys(tmp_path)["precision"],
        _keys(tmp_path, **{"validate.gates.min_cosine": 0.5})["precision"],
    )
    assert what_changed(before, after) == ["config.validate.gates.min_cosine"]


def test_precision_reads_the_check_without_the_latency_gate() -> None:
    cfg = config_from_dict(tiny_config_dict(**{"validate.gates.max_latency_p50_ms": 5.0, "validate.max_samples": 3}))
    settings = settings_for(stage_named("precision"), cfg)
    assert (
        settings.validate.gates.min_cosine == cfg.section("validate").gates.min_cosine
        and settings.validate.max_samples == 3
    )
    with pytest.raises(AttributeError):
        settings.validate.gates.max_latency_p50_ms  # noqa: B018 - reading it is the check
    assert "max_latency_p50_ms" not in settings.dump()["validate"]["gates"]
