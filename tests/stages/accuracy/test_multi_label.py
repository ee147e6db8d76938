"""A multi-label head: logits ``[N, K]`` beside float 0/1 targets shaped like them (binary cross-entropy on the
logits, ``validate.metric: multilabel_f1``). Each label is a decision of its own, the logit above 0: where the
data declares K labels (``num_classes``) and the logits are class logits (named in ``signature.logits_output``, or
K wide) they are held to decision agreement, the share of (sample, label) pairs whose decision is the reference's,
gated by ``min_top1_agreement``, in place of the agreement of their argmax, which a multi-label head does not answer
by. One-hot rows (exactly one 1 each) are class labels, whose argmax is the class: held to top-1 agreement. Without
``num_classes``, float 0/1 targets are a regression's, whose threshold is the user's to say."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from kiln.core.data import DatasetSplits, as_feed
from kiln.core.records import Baseline, EngineValidation, Percentiles, ValidationResult
from kiln.core.signature import Signature
from kiln.models.config import ModelConfig
from kiln.stages.accuracy.check import gates_for, held_out
from kiln.stages.accuracy.config import CheckConfig
from kiln.stages.validate.report import report_section
from tests.stages.accuracy.judging import judged

RNG = np.random.default_rng(0)
W = RNG.standard_normal((6, 5)).astype(np.float32)  # five labels
X = RNG.standard_normal((160, 6)).astype(np.float32)
TAGS = (X @ W > 0).astype(np.float32)  # multi-hot: each row has several labels on
NEAR = 0.3  # the engine below flips the labels whose logit lies within this of 0


def _run(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {"logits": feed["input"] @ W}


def _flipped(z: np.ndarray) -> np.ndarray:
    """The logits the engine below negates: those within ``NEAR`` of 0, in rows whose largest logit lies beyond it."""
    return (np.abs(z) < NEAR) & (z.max(1, keepdims=True) > NEAR)


def _near_zero_flipping(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """An engine that negates the logits near the threshold (:func:`_flipped`): those labels' decisions flip, while
    each row's largest logit stays the largest (the argmax agrees)."""
    out = _run(feed)["logits"]
    return {"logits": np.where(_flipped(out), -out, out)}


def _reference(
    num_classes: int, setting: str | None, x: np.ndarray = X, targets: np.ndarray = TAGS, run: Any = _run
) -> Any:
    """Validation's reference of ``run`` on ``x`` with float ``targets`` (multi-hot by default), the first 64 rows
    for training and the rest held out."""
    from kiln.stages.validate.stage import reference

    y, xs = torch.from_numpy(targets), torch.from_numpy(x)
    data = DatasetSplits(xs[:64], y[:64], xs[64:], y[64:], num_classes=num_classes)
    sig = Signature(logits_output=setting, batch_sizes=[1, 8])
    ctx = SimpleNamespace(config=SimpleNamespace(signature=sig, validate=CheckConfig(), model=ModelConfig()))
    feeds = held_out(data, lambda v: as_feed(v, ["input"]), {}, {}, None)
    metric = "multilabel_f1" if num_classes else None
    outputs = list(run({"input": x[:1]}))
    return reference(ctx, data, CheckConfig(metric=metric), run, feeds, outputs, {})


@pytest.mark.parametrize(("num_classes", "setting"), [(5, None), (5, "logits")])
def test_labels_flipped_near_the_threshold_fail_decision_agreement(num_classes: int, setting: str | None) -> None:
    """A few percent of the (sample, label) decisions flip, no row's argmax: decision agreement counts the flips and
    fails INT8's 0.97, where argmax agreement was 1.0 and passed the engine."""
    ref = _reference(num_classes, setting)
    entry, failures = judged(ref, _near_zero_flipping, [1, 8], "int8")
    z = X[64:] @ W
    flipped = _flipped(z)
    assert (_near_zero_flipping({"input": X[64:]})["logits"].argmax(1) == z.argmax(1)).all()
    assert 0.03 < flipped.mean() < 0.2
    assert ref.logits == "logits" and entry.top1_agreement == pytest.approx(1 - flipped.mean())
    assert entry.agreement == "decision"
    said = f"decision agreement (per label: logit > 0, or > 0.5 for probabilities) {entry.top1_agreement:.4f} <"
    assert any(f.startswith(said) for f in failures) and not any(f.startswith("top1") for f in failures), failures
    same, none = judged(ref, _run, [1, 8], "int8")
    assert same.top1_agreement == 1.0 and none == []


ROWS = RNG.standard_normal((400, 6)).astype(np.float32)  # many rows: the share of close calls is steady
ONE_HOT = np.eye(5, dtype=np.float32)[(ROWS @ W).argmax(1)]  # one 1 per row: each row's class
CLOSE = 0.1  # the engine below swaps the two largest logits of the rows whose margin is within this


def _close_calls_swapped(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """An engine that answers the runner-up class on the rows whose two largest logits lie within ``CLOSE``: their
    argmax flips, while nearly every logit keeps its side of 0."""
    z = _run(feed)["logits"].copy()
    order = np.argsort(-z, 1)
    rows = np.arange(len(z))
    top, second = order[:, 0], order[:, 1]
    close = z[rows, top] - z[rows, second] < CLOSE
    z[rows[close], top[close]], z[rows[close], second[close]] = (
        z[rows[close], second[close]],
        z[rows[close], top[close]],
    )
    return {"logits": z}


def test_one_hot_rows_are_class_labels_held_to_top1_agreement() -> None:
    """One-hot float targets with ``num_classes`` 5 and the logits named: an INT8 engine that flips the argmax of
    the close calls (several percent of the rows) fails top-1 agreement, which their per-label decisions would
    not see."""
    ref = _reference(5, "logits", ROWS, ONE_HOT)
    entry, failures = judged(ref, _close_calls_swapped, [1, 8], "int8")
    z = ROWS[64:] @ W
    swapped = (_close_calls_swapped({"input": ROWS[64:]})["logits"].argmax(1) != z.argmax(1)).mean()
    assert 0.04 < swapped < 0.15
    assert any(f.startswith("top1_agreement") for f in failures), failures
    assert entry.top1_agreement == pytest.approx(1 - swapped)
    assert not ref.multi_label and entry.agreement == "top1"


OCCUPANCY = (RNG.random((400, 16)) < 0.3).astype(np.float32)  # 16 cells, each 0/1: a regression's targets
FIT, OFF = RNG.standard_normal((2, 400, 16)).astype(np.float32)  # the regressor's own error, and an engine's
CELLS = {float(v): i for i, v in enumerate(ROWS[:, 0])}  # a row's index, by its first input


def _occupancy(noise: float) -> Any:
    """A regressor fit by least squares to :data:`OCCUPANCY`: each value near its 0/1 target, 0.05 off either way;
    ``noise`` more off, as an engine of a lower precision is."""

    def run(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        i = np.array([CELLS[float(v)] for v in feed["input"][:, 0]])
        return {"pred": OCCUPANCY[i] + 0.05 * FIT[i] + noise * OFF[i]}

    return run


def test_float_0_1_targets_without_num_classes_are_a_regressions_even_where_the_output_is_named() -> None:
    """An occupancy grid's regressor (``num_classes`` 0, ``signature.logits_output: pred``): its values near 0.5 are
    no decision of the model's, so an FP16 engine off by 0.01 is judged by cosine and error, not by how many cells
    cross a threshold."""
    ref = _reference(0, "pred", ROWS, OCCUPANCY, _occupancy(0.0))
    entry, failures = judged(ref, _occupancy(0.01), [1, 8], "fp16")
    assert failures == [] and entry.top1_agreement is None, failures
    assert ref.logits is None and not ref.multi_label


def test_decision_agreement_is_said_where_the_reference_is_made(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import logging

    monkeypatch.setattr(logging.getLogger("kiln"), "propagate", True)  # the CLI tests turn it off
    with caplog.at_level(logging.INFO, logger="kiln"):
        _reference(5, None)
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "decision agreement" in said and "(sample, label)" in said, said


def _report(engines: list[EngineValidation]) -> list[str]:
    """report.md's validation lines for ``engines``, each held to INT8's gates, of a model of class logits."""
    timed = {"8": Percentiles(p50=0.1, p90=0.1, p99=0.1)}
    for e in engines:
        e.gates, e.latency_ms, e.passed = gates_for(CheckConfig(), "int8"), timed, not e.failures
    b = Baseline(accuracy=None, samples=96, latency_ms=timed, logits_output="logits", compared=["logits"])
    failures = [f for e in engines for f in e.failures]
    return report_section(ValidationResult(passed=not failures, baseline=b, engines=engines, failures=failures))


def test_the_report_names_decision_agreement_and_a_record_without_the_flag_stays_top1() -> None:
    """A multi-label head's figure is decision agreement in the table's header, the compared outputs and the gate
    failure, not top-1 agreement; a record written before the flag (no ``agreement``) reads as top-1."""
    entry, failures = judged(_reference(5, None), _near_zero_flipping, [1, 8], "int8")
    entry.failures = failures
    lines = _report([entry])
    header = next(x for x in lines if x.startswith("| engine |"))
    assert "| decision agree |" in header and "top-1" not in header, header
    row = next(x for x in lines if x.startswith("| e |"))
    assert f"| {entry.top1_agreement:.4f} (≥ 0.97) |" in row, row
    compared = next(x for x in lines if x.startswith("Compared outputs"))
    assert "decision agreement (per label: logit > 0, or > 0.5 for probabilities) on 'logits'" in compared
    assert any(x.startswith("Decision agree: the class logits are a multi-label head's") for x in lines)
    assert any(x.startswith("- decision agreement (per label") for x in lines), lines

    old = EngineValidation.model_validate(entry.model_dump(mode="json", exclude={"agreement"}))
    assert old.agreement == "top1"
    old_header = next(x for x in _report([old]) if x.startswith("| engine |"))
    assert "| top-1 agree |" in old_header and "decision" not in old_header, old_header
