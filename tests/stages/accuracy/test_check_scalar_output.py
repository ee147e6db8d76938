"""Outputs without a batch axis (a 0-D loss beside the class logits): held to their error over their norm, with no
cosine, and never the class logits."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.core.errors import ConfigError
from kiln.core.records import EngineValidation
from kiln.stages.accuracy.check import (
    Reference,
    accuracy_failures,
    compare_all,
    compare_on,
    direct_top1,
    gates_for,
    summarize,
)
from kiln.stages.accuracy.config import CheckConfig

W = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)


def _model(scale: float = 1.0, aux_off: float = 1.0):
    """Class logits per row and a batch-level loss (0-D), ``scale`` times off in the logits, ``aux_off`` in the loss."""

    def run(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        logits = feed["x"] @ W * scale
        return {"logits": logits, "aux": np.asarray(aux_off * (2.0 + 1e-4 * float(logits.mean())), np.float32)}

    return run


def _x() -> np.ndarray:
    return np.random.default_rng(1).standard_normal((32, 8)).astype(np.float32)


def test_a_batch_level_scalar_slightly_off_passes_its_relative_error() -> None:
    ref = Reference(_model(), [({}, {"x": _x()})], [None], "logits", 8)
    found = compare_on(ref, _model(aux_off=1.0017), [8])  # 0.17 % off: the scalar barely varies between batches
    aux = found.stats["aux"]
    assert abs(aux.rel_err - 0.0017) < 1e-4 and aux.cosine is None
    entry = EngineValidation(name="e", backend="b", precision="int8", device="cpu", status="validated")
    entry.gates = gates_for(CheckConfig(), "int8")
    summarize(entry, found.stats, "logits", None)
    assert entry.cosine is not None and entry.cosine > 0.9999  # the logits' cosine: the scalar has none
    assert not [f for f in accuracy_failures(entry, entry.gates, None) if "aux" in f]


def test_a_scalar_off_by_half_fails_on_its_relative_error_said_over_its_norm() -> None:
    stats = compare_all({"logits": _x() @ W, "aux": np.array(2.0)}, {"logits": _x() @ W, "aux": np.array(3.0)}, None)
    assert stats["aux"].cosine is None
    entry = EngineValidation(name="e", backend="b", precision="fp32", device="cpu", status="validated")
    entry.gates = gates_for(CheckConfig(), "fp32")
    summarize(entry, stats, None, None)
    fails = accuracy_failures(entry, entry.gates, None)
    assert any("'aux' relative error 0.5" in f and "over its norm" in f for f in fails), fails


def test_naming_a_scalar_as_the_class_logits_is_refused() -> None:
    with pytest.raises(ConfigError, match="'aux', a scalar without a batch axis") as err:
        Reference(_model(), [({}, {"x": _x()})], [None], "aux", 8, named=True)
    assert "['logits']" in err.value.hint
    outputs = _model()({"x": _x()})
    with pytest.raises(ConfigError, match="scalar without a batch axis"):
        direct_top1(list(outputs), "aux", outputs)
