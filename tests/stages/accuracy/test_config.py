"""A top-level gate the user sets against the per-precision defaults (``validate.gates.per_precision``): tightened,
it holds every precision whose own value the user left at its default; loosened past such a default, the default
stays and a warning names the key that loosens it."""

from __future__ import annotations

import logging

import pytest

from kiln.pipeline.config import config_from_dict, load_config
from kiln.stages.accuracy.check import gates_for
from kiln.stages.validate.stage import check_gates
from tests.stages.validate.test_stage import entry


def test_a_tightened_top_level_gate_holds_the_reduced_precisions_too() -> None:
    cfg = load_config(None, {"validate.gates.min_cosine": 0.9999999})
    for precision in ("fp32", "fp16", "int8", "fp8"):
        assert gates_for(cfg.validate_, precision)["min_cosine"] == 0.9999999, precision
    int8 = gates_for(cfg.validate_, "int8")
    assert int8["min_top1_agreement"] == 0.97 and int8["max_accuracy_drop"] == 0.02  # gates not set keep theirs
    assert any("min_cosine" in f for f in check_gates(entry(cosine=0.99999), 0.95, int8, 8))
    assert config_from_dict(cfg.dump()).validate_.gates == cfg.validate_.gates  # `kiln config` reads back the same


def test_a_per_precision_value_the_user_sets_still_wins_over_the_top_level_gate(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="kiln"):
        cfg = load_config(
            None, {"validate.gates.min_cosine": 0.9999999, "validate.gates.per_precision.int8.min_cosine": 0.98}
        )
    assert gates_for(cfg.validate_, "int8")["min_cosine"] == 0.98
    assert gates_for(cfg.validate_, "fp16")["min_cosine"] == 0.9999999
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert said == [  # the defaults it replaces are said, with the key that keeps one; int8's own value is not
        "validate.gates.min_cosine 0.9999999 holds fp16, fp8 engines too, in place of their looser defaults "
        "(fp16 0.999, fp8 0.99); to keep one, set validate.gates.per_precision.fp16.min_cosine or "
        "validate.gates.per_precision.fp8.min_cosine"
    ]


def test_a_printed_config_edited_at_the_top_reads_as_the_same_edit_in_a_short_one() -> None:
    """`kiln config` spells out the per-precision defaults: as values equal to them, they are not the user's own,
    and tightening the top-level gate in that printout holds the reduced precisions as it does in a short config."""
    import yaml

    printed = yaml.safe_load(yaml.safe_dump(load_config(None, {}).dump()))
    printed["validate"]["gates"]["min_cosine"] = 0.99999
    full = config_from_dict(printed)
    short = load_config(None, {"validate.gates.min_cosine": 0.99999})
    assert gates_for(full.validate_, "int8") == gates_for(short.validate_, "int8")
    assert gates_for(full.validate_, "int8")["min_cosine"] == 0.99999


def test_a_top_level_gate_loosened_past_a_precisions_default_leaves_it_and_says_how_to_set_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """min_cosine 0.95 is looser than INT8's default 0.99, which stays and is said; 0.9995 loosens the FP32
    engines' gate only, still above the reduced precisions' defaults: they keep theirs, with nothing to say."""
    with caplog.at_level(logging.WARNING, logger="kiln"):
        cfg = load_config(None, {"validate.gates.min_cosine": 0.95})
    assert gates_for(cfg.validate_, "fp32")["min_cosine"] == 0.95
    assert gates_for(cfg.validate_, "int8")["min_cosine"] == 0.99
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(said) == 1 and "validate.gates.min_cosine 0.95" in said[0], said
    assert "int8 0.99" in said[0] and "validate.gates.per_precision.int8.min_cosine" in said[0], said[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kiln"):  # loosened for FP32 only: still above their defaults
        cfg = load_config(None, {"validate.gates.min_cosine": 0.9995})
    assert gates_for(cfg.validate_, "int8")["min_cosine"] == 0.99
    assert gates_for(cfg.validate_, "fp16")["min_cosine"] == 0.999
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_top_level_max_rel_err_is_held_against_each_precisions_derived_limit(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """max_rel_err has no per-precision default: each precision's is sqrt(2 (1 - its min_cosine)), FP16's 0.0447
    and INT8's 0.1414. Set to 0.1, it holds INT8 and FP8 (tighter than theirs) and leaves FP16's stricter one, both
    said with the per-precision key; set to 0.005, it holds every precision, said too."""
    with caplog.at_level(logging.WARNING, logger="kiln"):
        cfg = load_config(None, {"validate.gates.max_rel_err": 0.1})
    limits = {p: gates_for(cfg.validate_, p, no_class_logits=True)["max_rel_err"] for p in ("fp32", "fp16", "int8")}
    assert limits == {"fp32": 0.1, "fp16": 0.044721, "int8": 0.1}
    assert gates_for(cfg.validate_, "fp16")["max_rel_err"] is None  # class logits: FP16's default, not 0.1
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(said) == 2, said
    assert "int8 0.141421" in said[0] and "validate.gates.per_precision.int8.max_rel_err" in said[0], said[0]
    assert "fp16 0.044721" in said[1] and "validate.gates.per_precision.fp16.max_rel_err" in said[1], said[1]
    assert config_from_dict(cfg.dump()).validate_.gates == cfg.validate_.gates  # `kiln config` reads back the same
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kiln"):
        cfg = load_config(None, {"validate.gates.max_rel_err": 0.005})
    assert {gates_for(cfg.validate_, p)["max_rel_err"] for p in ("fp32", "fp16", "int8", "fp8")} == {0.005}
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(said) == 1 and "int8 0.141421" in said[0] and "fp16 0.044721" in said[0], said
