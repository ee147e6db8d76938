"""The precision stage's declared settings: its cache key covers the accuracy gates each variant it makes is held to,
and not the gates only validation reads (latency, and the FP32 gates where every variant made has its own)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kiln.pipeline.config import config_from_dict
from kiln.pipeline.runner import cache_key, settings_for, what_changed
from kiln.pipeline.stage_list import STAGES, stage_named
from kiln.stages.accuracy.check import gates_for
from kiln.stages.precision.declaration import variant_gates
from tests.conftest import tiny_config_dict

VARIANTS = {"precision.variants": ["fp32", "fp16", "int8"]}


def _keys(tmp_path: Path, **overrides: Any) -> dict[str, tuple[str, dict[str, Any]]]:
    cfg = config_from_dict(tiny_config_dict(**{**VARIANTS, **overrides}))
    return {s.name: cache_key(s, cfg, tmp_path) for s in STAGES if s.name in ("precision", "validate")}


@pytest.mark.parametrize(
    "override, stages",
    [
        ({"validate.gates.max_latency_p50_ms": 1000.0}, {"validate"}),
        # looser than FP16's and INT8's own defaults: the FP32 gate alone moves, which no variant made reads
        ({"validate.gates.min_cosine": 0.999}, {"validate"}),
        ({"validate.gates.min_cosine": 0.5}, {"validate"}),
        # tighter than every default: it holds FP16 and INT8 too
        ({"validate.gates.min_cosine": 0.99999}, {"precision", "validate"}),
        ({"validate.gates.per_precision": {"int8": {"min_top1_agreement": 0.5}}}, {"precision", "validate"}),
        ({"validate.gates.per_precision": {"fp32": {"min_top1_agreement": 0.5}}}, {"validate"}),
        ({"validate.max_samples": 7}, {"precision", "validate"}),
        # the FP32 variant alone is made: no gate is read by precision
        ({"precision.variants": ["fp32"], "validate.gates.min_cosine": 0.99999}, {"validate"}),
        (
            {"precision.variants": ["fp32", "fp16"], "validate.gates.per_precision": {"int8": {"min_cosine": 0.9}}},
            {"validate"},
        ),
    ],
)
def test_precision_is_keyed_on_the_gates_its_variants_face(tmp_path: Path, override: dict, stages: set[str]) -> None:
    base = {k: v for k, v in override.items() if k == "precision.variants"}  # the same variants before and after
    before, after = _keys(tmp_path, **base), _keys(tmp_path, **override)
    assert {name for name in before if before[name][0] != after[name][0]} == stages


def test_a_changed_accuracy_gate_is_named(tmp_path: Path) -> None:
    (_, before), (_, after) = (
        _keys(tmp_path)["precision"],
        _keys(tmp_path, **{"validate.gates.min_cosine": 0.99999})["precision"],
    )
    assert what_changed(before, after) == ["config.validate.gates"]
    assert after["config"]["validate.gates"]["fp16"]["min_cosine"] == 0.99999


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


def test_the_key_holds_every_gate_the_variants_are_judged_by() -> None:
    """The key's merge of the gates is the one the variants are judged by (:func:`gates_for`), gate for gate."""
    cfg = config_from_dict(
        tiny_config_dict(
            **VARIANTS,
            **{"validate.gates.min_cosine": 0.99999, "validate.gates.per_precision": {"int8": {"max_rel_err": 0.3}}},
        )
    )
    settings = settings_for(stage_named("precision"), cfg)
    keyed = variant_gates(settings)
    assert set(keyed) == {"fp16", "int8"}
    for precision, gates in keyed.items():
        judged = gates_for(settings.gates, precision)
        assert {k: gates[k] for k in judged} == judged
