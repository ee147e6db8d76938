"""validate.metric: the built-ins on outputs whose answer is known, a user's metric by import path, its direction,
and its failures as one error naming the function."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from kiln.core.errors import ConfigError, ModelError
from kiln.core.labels import IGNORE_LABEL
from kiln.stages.accuracy.config import BUILTIN_METRICS, CheckConfig
from kiln.stages.accuracy.metrics import BUILTINS, resolve_metric


def logits_for(pred: list[int], classes: int = 3) -> np.ndarray:
    out = np.zeros((len(pred), classes), np.float32)
    out[np.arange(len(pred)), pred] = 1.0
    return out


def importable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, source: str) -> None:
    """``source`` as module ``name`` on the import path for this test (a fresh import, not one cached before)."""
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)


def test_accuracy_and_macro_f1() -> None:
    y = np.array([0, 0, 1, 2])
    out = {"logits": logits_for([0, 1, 1, 2])}
    assert resolve_metric("accuracy", "logits")(out, y) == pytest.approx(0.75)
    # class 0: P 1, R 0.5 -> 2/3; class 1: P 0.5, R 1 -> 2/3; class 2: 1
    assert resolve_metric("macro_f1", "logits")(out, y) == pytest.approx((2 / 3 + 2 / 3 + 1) / 3)


def test_token_accuracy_counts_labelled_positions_only() -> None:
    logits = np.zeros((1, 4, 2), np.float32)
    logits[0, :, 1] = 1.0  # class 1 everywhere
    y = np.array([[1, 0, IGNORE_LABEL, IGNORE_LABEL]])
    assert resolve_metric("token_accuracy", None)({"out": logits}, y) == pytest.approx(0.5)
    with pytest.raises(ModelError, match="per position"):
        resolve_metric("token_accuracy", None)({"out": logits[:, 0]}, np.array([1]))


def test_mse_is_lower_is_better() -> None:
    m = resolve_metric("mse", None)
    assert not m.higher_is_better
    assert m({"y": np.array([[1.0], [3.0]])}, np.array([1.0, 1.0])) == pytest.approx(2.0)
    assert m.drop(1.0, 1.5) == pytest.approx(0.5)  # a rise in error is a drop in quality
    assert resolve_metric("accuracy", None).drop(0.9, 0.8) == pytest.approx(0.1)


def test_detection_recall_matches_class_and_overlap() -> None:
    boxes = np.array([[[0, 0, 10, 10], [20, 20, 30, 30], [0, 0, 1, 1]]], np.float32)
    scores = np.zeros((1, 3, 2), np.float32)
    scores[0, 0, 1] = scores[0, 1, 0] = scores[0, 2, 1] = 1.0  # classes 1, 0, 1
    labels = np.array([[[1, 0, 0, 10, 9], [1, 20, 20, 30, 30], [-1, 0, 0, 0, 0]]], np.float32)
    # box 1 found (class 1, IoU 0.9); box 2 overlaps a class-0 prediction only: missed; the third is padding
    assert resolve_metric("detection_recall", None)({"boxes": boxes, "scores": scores}, labels) == pytest.approx(0.5)


def test_detection_recall_reads_a_detr_head_by_its_softmax_with_no_object_last() -> None:
    """A DETR/YOLOS head: class logits one wider than the data's num_classes, the last "no object", whose softmax
    says whether a class is there. A softmax probability of 0.23 is no detection though its logit is above 0, one of
    0.63 is one though every logit is below 0, and a uniform shift of the logits (an INT8 offset) changes nothing."""
    labels = np.array([[[2, 0.2, 0.2, 0.6, 0.6]]], np.float32)
    boxes = np.array([[[0.2, 0.2, 0.6, 0.6]]], np.float32)
    unsure = np.array([[[0.5, 0.5, 1.0, 0.5, 0.5, 0.9]]], np.float32)  # softmax p(class 2) = 0.23
    sure = np.array([[[-3, -3, -1, -3, -3, -4]]], np.float32)  # softmax p(class 2) = 0.63
    absent = np.array([[[0, 0, 1, 0, 0, 5]]], np.float32)  # "no object" likeliest; class 2 the likeliest real one
    detr = resolve_metric("detection_recall", "logits", num_classes=5)
    for logits, found in ((unsure, 0.0), (sure, 1.0), (absent, 0.0)):
        for shift in (0.0, 7.0, -7.0):
            assert detr({"pred_boxes": boxes, "logits": logits + shift}, labels) == found, (logits, shift)
    # a wrapper that returns the softmax itself: its probabilities are read as they are, not flattened by another
    probs = np.exp(sure) / np.exp(sure).sum(-1, keepdims=True)
    assert detr({"pred_boxes": boxes, "logits": probs}, labels) == 1.0
    assert detr({"pred_boxes": boxes, "logits": np.exp(unsure) / np.exp(unsure).sum(-1, keepdims=True)}, labels) == 0
    # as many scores as classes, or no num_classes: each class on its own (a sigmoid's logit of 0 or more)
    for sigmoid in (
        resolve_metric("detection_recall", "logits", num_classes=6),
        resolve_metric("detection_recall", "logits"),
    ):
        assert sigmoid({"pred_boxes": boxes, "logits": unsure}, labels) == 1.0
        assert sigmoid({"pred_boxes": boxes, "logits": sure}, labels) == 0.0


def test_user_metric_by_import_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    importable(
        tmp_path,
        monkeypatch,
        "mymetrics",
        "import numpy as np\n\n"
        "def err(outputs, labels):\n"
        "    return float(np.abs(outputs['y'].ravel() - labels).mean())\n\n"
        "err.higher_is_better = False\n\n"
        "def broken(outputs, labels):\n"
        "    return outputs['missing']\n",
    )
    m = resolve_metric("mymetrics:err", None)
    assert not m.higher_is_better and m({"y": np.array([1.0, 2.0])}, np.array([1.0, 1.0])) == pytest.approx(0.5)
    assert resolve_metric("mymetrics:err", None, higher_is_better=True).higher_is_better  # the config wins
    with pytest.raises(ModelError, match=r"mymetrics:broken.*mymetrics\.py:9\).*KeyError"):
        resolve_metric("mymetrics:broken", None)({"y": np.zeros(2)}, np.zeros(2))


def test_unknown_metric_is_refused_with_the_config() -> None:
    with pytest.raises(ValidationError, match="unknown metric 'f1score'"):
        CheckConfig(metric="f1score")
    assert CheckConfig(metric="pkg.mod:fn").metric == "pkg.mod:fn"
    assert set(BUILTINS) == set(BUILTIN_METRICS)  # what the config accepts is what resolves


def test_multilabel_f1_and_a_built_in_that_does_not_fit_the_labels() -> None:
    """0/1 targets [N, K]: multilabel_f1 scores them; macro_f1 says what it takes and which built-in fits, instead of
    blaming a line of Kiln's own as the user's."""
    out = {"logits": np.array([[2.0, -1.0, 3.0], [-2.0, 1.0, -1.0]], np.float32)}
    y = np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 1.0]], np.float32)  # 2 right, 1 missed, 1 extra: 2*2 / (3 + 3)
    assert resolve_metric("multilabel_f1", "logits")(out, y) == pytest.approx(4 / 6)
    # a head ending in a sigmoid: the same decisions at 0.5 (at 0 every label would count as predicted: 2*2 / 8)
    probs = {"logits": 1.0 / (1.0 + np.exp(-out["logits"]))}
    fewer = np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]], np.float32)  # 2 right, 1 extra: 2*2 / (3 + 2)
    assert resolve_metric("multilabel_f1", "logits")(out, fewer) == pytest.approx(0.8)
    assert resolve_metric("multilabel_f1", "logits")(probs, fewer) == pytest.approx(0.8)
    with pytest.raises(ModelError) as err:
        resolve_metric("macro_f1", "logits")(out, y)
    assert "takes class indices" in err.value.message and "multilabel_f1" in err.value.message
    assert "metrics.py" not in err.value.message and "module:function" in err.value.hint


def test_a_metric_returning_an_array_is_said_as_such_not_placed_in_kiln() -> None:
    """An array of per-sample scores was reported as failing at a line of Kiln's own metrics module."""
    from kiln.core.errors import ModelError
    from kiln.stages.accuracy.metrics import Metric

    outputs, labels = {"logits": np.zeros((4, 3), np.float32)}, np.zeros(4, np.int64)
    per_sample = Metric("mine:scores", lambda out, y: np.ones(4))
    with pytest.raises(
        ModelError, match=r"validate.metric 'mine:scores' returned an array of shape \(4,\), not a float"
    ):
        per_sample(outputs, labels)
    assert Metric("mine:mean", lambda out, y: np.ones(1))(outputs, labels) == 1.0  # one element is a value


def test_mse_scores_the_output_that_is_the_prediction() -> None:
    y = np.array([[1.0, 2.0], [3.0, 4.0]])
    out = {"log_var": np.zeros((2, 2)), "mean": y + 1.0}
    assert resolve_metric("mse", "mean")(out, y) == pytest.approx(1.0)  # named: that one, wherever it stands
    with pytest.raises(ConfigError, match="outputs 'log_var', 'mean' each fit targets") as err:
        resolve_metric("mse", None)(out, y)  # two could be the prediction: the first is no safer a guess
    assert err.value.hint.startswith("set signature.logits_output to the one that is the prediction (log_var or mean)")
    # one output as large as the targets: that one (a classifier's pooled features beside it do not fit)
    assert resolve_metric("mse", None)({"feat": np.zeros((2, 5)), "y": y}, y) == pytest.approx(0.0)


@pytest.mark.parametrize(
    "labels, named",
    [
        (np.random.default_rng(0).standard_normal((4, 2, 3, 3)).astype(np.float32), "regression targets: mse"),
        ((np.random.default_rng(0).random((4, 2, 3, 3)) > 0.5).astype(np.float32), "multilabel_f1"),
    ],
)
def test_accuracy_on_labels_shaped_like_the_outputs_names_the_metric_that_fits(labels: np.ndarray, named: str) -> None:
    """A denoiser's noise targets are told to take mse, 0/1 targets multilabel_f1."""
    out = np.zeros((4, 2, 3, 3), np.float32)
    with pytest.raises(ValueError, match=named):
        BUILTINS["accuracy"][0]({"logits": out}, labels, "logits")


def test_an_error_metric_is_judged_by_its_rise_relative_to_the_reference() -> None:
    """MSE's units are the targets' squared: targets in the thousands put an exact engine's rounding noise (0.022 on
    1.008e6) over an allowance of 0.01. An error metric's drop is its relative rise; a share's stays in points."""
    mse = resolve_metric("mse", None)
    assert mse.relative and mse.drop(1.008e6, 1.008e6 + 0.022) == pytest.approx(0.022 / 1.008e6)
    assert mse.drop(0.0792, 0.2198) == pytest.approx((0.2198 - 0.0792) / 0.0792)  # 2.8x the error: fails 0.01
    assert mse.drop(2.0, 1.0) == pytest.approx(-0.5)  # better than the reference
    assert mse.drop(0.0, 1e-9) == pytest.approx(1e-9)  # a perfect reference: nothing to be relative to
    accuracy = resolve_metric("accuracy", None)
    assert not accuracy.relative and accuracy.drop(0.9, 0.8) == pytest.approx(0.1)


def test_an_error_metrics_rise_is_over_the_targets_spread_where_they_give_one() -> None:
    """Over the reference's own error, a good fit's INT8 noise is many times it (MSE 0.00874 -> 0.00942: 7.8 %), and a
    reference that fits exactly makes any rounding infinite; over the targets' variance the rise is R^2 points."""
    from kiln.stages.accuracy.metrics import scaled_by

    y = np.random.default_rng(0).normal(size=500)
    mse = scaled_by(resolve_metric("mse", None), y)
    assert mse.scale == pytest.approx(np.var(y))
    assert mse.drop(0.00874, 0.00942) == pytest.approx(0.00068 / np.var(y)) and mse.drop(0.00874, 0.00942) < 0.01
    assert mse.drop(1e-14, 5.2e-8) < 1e-6  # an exact reference: the engine's rounding is no rise to speak of
    assert mse.drop(0.0792 * np.var(y), 0.2198 * np.var(y)) > 0.1  # a forecast 2.8x the reference's error
    assert scaled_by(resolve_metric("rmse", None), y).scale == pytest.approx(np.std(y))
    assert scaled_by(resolve_metric("smape", None), y).scale is None  # scale-free: over the reference's value
    assert scaled_by(resolve_metric("mse", None), np.ones(9)).scale is None  # targets that do not vary


def test_mae_rmse_and_smape_score_the_prediction() -> None:
    y = np.array([[1.0, 0.0], [2.0, 4.0]])
    out = {"pred": np.array([[2.0, 0.0], [2.0, 1.0]])}  # errors 1, 0, 0, 3
    assert resolve_metric("mae", None)(out, y) == pytest.approx(1.0)
    assert resolve_metric("rmse", None)(out, y) == pytest.approx(np.sqrt(10 / 4))
    # |e| / ((|pred| + |y|) / 2): 1/1.5, 0 (both 0: an exact forecast of 0), 0, 3/2.5
    assert resolve_metric("smape", None)(out, y) == pytest.approx((1 / 1.5 + 3 / 2.5) / 4)
    for name in ("mae", "rmse", "smape"):
        m = resolve_metric(name, None)
        assert not m.higher_is_better and m.relative, name
    assert CheckConfig(metric="mae").metric == "mae"  # the config takes them


def test_a_user_metric_keeps_its_units_unless_it_declares_itself_relative(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    importable(
        tmp_path,
        monkeypatch,
        "relmetrics",
        "def wape(outputs, labels):\n"
        "    return 1.0\n\n"
        "wape.higher_is_better = False\n"
        "wape.relative = True\n\n"
        "def score(outputs, labels):\n"
        "    return 1.0\n",
    )
    assert resolve_metric("relmetrics:wape", None).drop(200.0, 202.0) == pytest.approx(0.01)
    assert resolve_metric("relmetrics:score", None).drop(200.0, 198.0) == pytest.approx(2.0)


def test_float_targets_get_mse_by_default_where_one_output_is_the_prediction() -> None:
    """The default for float targets: mse, relative, on the output mse itself would read; none (and no error) where
    it would ask which output is the prediction, and none for 0/1 or integer targets."""
    from kiln.stages.accuracy.metrics import default_metric

    y = np.array([[1.0, 2.0], [3.0, 4.5]], np.float32)
    m = default_metric({"forecast": y + 1.0}, y, None)
    assert m is not None and (m.name, m.default, m.relative, m.higher_is_better) == ("mse", True, True, False)
    assert m({"forecast": y + 1.0}, y) == pytest.approx(1.0)
    assert default_metric({"mean": y, "log_var": y}, y, None) is None  # which is the prediction? not guessed
    assert default_metric({"mean": y, "log_var": y}, y, "mean") is not None  # named
    assert default_metric({"forecast": np.zeros((2, 3))}, y, None) is None  # no output the targets' size
    assert default_metric({"logits": y}, (y > 2).astype(np.float32), None) is None  # 0/1: multi-label
    assert default_metric({"logits": y}, y.astype(np.int64), None) is None  # integers: classes
    gaps = np.where(y > 4, np.nan, y).astype(np.float32)  # a missing value: the default would fail, not judge
    assert default_metric({"forecast": y}, gaps, None) is None


def test_targets_no_output_is_shaped_like_are_told_of_a_metric_of_ones_own() -> None:
    """Two [N, 1] heads over targets [N, 2]: mse fits no output, nor would rmse, mae or smape, so the fix names a
    user metric that splits the targets rather than the other built-ins."""
    outputs = {"click": np.zeros((4, 1), np.float32), "value": np.zeros((4, 1), np.float32)}
    with pytest.raises(ModelError, match=r"no output has as many values as the targets \[4, 2\]") as err:
        resolve_metric("mse", None)(outputs, np.zeros((4, 2), np.float32))
    assert "targets[:, 0]" in err.value.hint and "rmse" not in err.value.hint
    with pytest.raises(ModelError) as err:  # a misfit of another kind: the other built-ins may fit
        resolve_metric("accuracy", None)({"y": np.zeros((4, 3, 2), np.float32)}, np.zeros(5, np.int64))
    assert "pick another built-in" in err.value.hint


def test_a_metric_whose_decorator_fills_in_a_parameter_is_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A functools.wraps wrapper takes (outputs, labels) and calls the wrapped metric with a third argument: the
    wrapper's own parameters are what Kiln calls, not the wrapped function's; one that cannot take them is refused."""
    importable(
        tmp_path,
        monkeypatch,
        "wrapped_metrics",
        "import functools\n\n"
        "def with_k(f):\n"
        "    @functools.wraps(f)\n"
        "    def w(outputs, labels):\n"
        "        return f(outputs, labels, 1)\n"
        "    return w\n\n"
        "@with_k\n"
        "def met(outputs, labels, k):\n"
        "    return float(k)\n\n"
        "def three(outputs, labels, k):\n"
        "    return 1.0\n",
    )
    assert resolve_metric("wrapped_metrics:met", None)({"y": np.zeros(2)}, np.zeros(2)) == 1.0
    with pytest.raises(ConfigError, match=r"cannot be called as fn\(outputs, labels\)"):
        resolve_metric("wrapped_metrics:three", None)


def test_a_metric_returning_none_is_said_as_such_not_as_nan() -> None:
    """A metric without a return statement was reported as returning nan, with a fix to guard divisions by zero."""
    from kiln.stages.accuracy.metrics import Metric

    def no_return(outputs: dict[str, np.ndarray], labels: np.ndarray) -> None:
        (outputs["logits"].argmax(1) == labels).mean()

    outputs, labels = {"logits": np.zeros((4, 3), np.float32)}, np.zeros(4, np.int64)
    with pytest.raises(ModelError, match=r"'mine:no_return' returned None \(a function without a return") as err:
        Metric("mine:no_return", no_return)(outputs, labels)
    assert "return the score" in (err.value.hint or "") and "divisions" not in (err.value.hint or "")
