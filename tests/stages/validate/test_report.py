"""The validation section of report.md: every value beside the gate that held it, and no gate where none did."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from kiln.core.data import DatasetSplits, as_feed
from kiln.core.records import Baseline, EngineValidation, Percentiles, ValidationResult
from kiln.core.signature import Signature
from kiln.models.config import ModelConfig
from kiln.stages.accuracy.check import held_out
from kiln.stages.accuracy.config import CheckConfig
from kiln.stages.validate.report import report_section
from kiln.stages.validate.stage import accuracy_absent, reference


def _table(lines: list[str]) -> list[list[str]]:
    start = next(i for i, line in enumerate(lines) if line.startswith("| engine |"))
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def test_a_model_without_class_logits_shows_its_relative_error_gate_and_no_top1_gate() -> None:
    engine = EngineValidation(
        name="e", backend="onnxruntime", precision="int8", device="cpu", status="validated", passed=True
    )
    engine.max_abs_err, engine.rel_err, engine.cosine = 0.0103, 0.01137, 0.999939
    engine.gates = {"min_cosine": 0.99, "max_rel_err": 0.141421, "min_top1_agreement": 0.97}
    timed = {"1": Percentiles(p50=0.1, p90=0.1, p99=0.1), "32": Percentiles(p50=0.2, p90=0.2, p99=0.2)}
    engine.latency_ms = timed
    v = ValidationResult(
        passed=True, baseline=Baseline(accuracy=None, samples=8, latency_ms=timed), engines=[engine], failures=[]
    )
    header, separator, *rows = _table(report_section(v))
    assert len(separator) == len(header) and all(len(r) == len(header) for r in rows)
    row = dict(zip(header, rows[-1]))
    assert row["rel err"] == "0.01137 (≤ 0.141421)" and row["top-1 agree"] == "-", row


def test_a_speedup_is_shown_with_its_interval_and_said_to_be_a_median_of_paired_ratios() -> None:
    """A speedup is the median of per-round ratios, which can differ from the ratio of the p50s beside it (a busy
    round): its cell gives the interval and the timing note says what both figures are."""
    from kiln.core.timing import ratio_interval
    from kiln.stages.validate.baselines import speedups

    def timed(rounds: list[float], p50: float) -> dict[str, Percentiles]:
        return {"8": Percentiles(p50=p50, p90=p50, p99=p50, ci95=(min(rounds), max(rounds)), rounds=rounds)}

    eager = Baseline(accuracy=None, samples=8, latency_ms=timed([6.0, 9.0, 1.5], 6.332), kind="eager", device="cpu")
    engine = EngineValidation(
        name="e", backend="onnxruntime", precision="fp32", device="cpu", status="validated", passed=True
    )
    engine.latency_ms = timed([0.4, 0.6, 0.7], 0.584)
    engine.speedups, engine.speedup_ci = speedups("cpu", engine.latency_ms, [eager])
    engine.speedup_vs_baseline = engine.speedups["eager-cpu"]
    timing = {"rounds": 3, "load_before": 1.0, "load_after": 1.0, "cpus": 2}
    v = ValidationResult(passed=True, baseline=eager, baselines=[eager], engines=[engine], failures=[], timing=timing)
    lines = report_section(v)
    header, _, _, row = _table(lines)
    lo, hi = ratio_interval([6.0, 9.0, 1.5], [0.4, 0.6, 0.7])
    assert dict(zip(header, row))["speedup @8"] == f"15.00 ({lo:.2f}-{hi:.2f})"  # not 6.332 / 0.584 = 10.84
    note = next(line for line in lines if line.startswith("Latency:"))
    assert "p50 is the median of the rounds' medians, with its 95 % interval" in note
    assert "A speedup is the median of the per-round ratios (baseline / engine, paired round by round)" in note


def test_the_worst_sample_cosine_is_shown_beside_the_whole_outputs_with_the_gate_it_missed() -> None:
    """A class map whose whole-output cosine passes while one sample's does not: both values in the table, each
    with min_cosine beside it, and the output's row in the per-output table."""
    engine = EngineValidation(
        name="e", backend="onnxruntime", precision="int8", device="cpu", status="validated", passed=False
    )
    engine.max_abs_err, engine.rel_err, engine.cosine = 4.56, 0.105, 0.994496
    seg = {"max_abs_err": 4.56, "rel_err": 0.105, "cosine": 0.994496, "top1_agreement": 0.9832, "top1_ties": 0.0}
    engine.outputs = {
        "logits": {**seg, "sample_cosine": 0.305433, "worst_sample": 100},
        "aux": {**seg, "cosine": 0.999, "sample_cosine": 0.998, "worst_sample": 3},
    }
    engine.gates = {"min_cosine": 0.99, "min_top1_agreement": 0.97}
    engine.latency_ms = {"32": Percentiles(p50=0.2, p90=0.2, p99=0.2)}
    v = ValidationResult(
        passed=False,
        baseline=Baseline(accuracy=None, samples=128, latency_ms=engine.latency_ms),
        engines=[engine],
        failures=[],
    )
    lines = report_section(v)
    header, separator, *rows = _table(lines)
    assert len(separator) == len(header) and all(len(r) == len(header) for r in rows)
    row = dict(zip(header, rows[-1]))
    assert row["cosine"] == "0.994496 (≥ 0.99)" and row["worst-sample cosine"] == "0.305433 (≥ 0.99)", row
    per_output = lines[lines.index("### Per output (worst over shapes and batch sizes)") + 2 :]
    header, _, *rows = _table(per_output)
    assert dict(zip(header, rows[0]))["worst-sample cosine"] == "0.305433"


def _scored(metric: float | None, name: str | None, engines: dict[str, float], **baseline: object) -> list[str]:
    """report.md's validation lines for a reference scoring ``metric`` (``name``: validate.metric's; None: unset)
    and engines scoring ``engines``, each held to max_metric_drop 0.01."""
    timed = {"8": Percentiles(p50=0.1, p90=0.1, p99=0.1)}
    entries = []
    for engine, value in engines.items():
        e = EngineValidation(name=engine, backend="onnxruntime", precision="int8", device="cpu", status="validated")
        e.passed, e.metric, e.latency_ms, e.gates = True, value, timed, {"max_metric_drop": 0.01}
        entries.append(e)
    b = Baseline(**{"accuracy": None, **baseline}, samples=8, latency_ms=timed, metric=metric, metric_name=name)
    return report_section(ValidationResult(passed=True, baseline=b, engines=entries, failures=[]))


def test_an_error_metric_is_shown_with_its_relative_rise_and_the_default_said_as_such() -> None:
    """mse in the targets' units (1.008e6): an exact engine's rise is shown relative (2.2e-08, not 0.022); the metric
    float targets get where validate.metric is unset (a value recorded without a name) is said to be that default."""
    lines = _scored(1.008e6, "mse", {"fp32": 1.008e6 + 0.022, "int8": 1.1e6})
    line = next(x for x in lines if x.startswith("Metric `mse`"))
    assert "(validate.metric)" in line and "fp32 1.008e+06 (relative rise 2.183e-08, gate ≤ 0.01)" in line, line
    assert "int8 1.1e+06 (relative rise 0.09127, gate ≤ 0.01)" in line and "1 % more error" in line, line
    default = next(x for x in _scored(0.0792, None, {"int8": 0.2198}) if x.startswith("Metric"))
    assert default.startswith("Metric `mse` (the default for float targets: validate.metric is unset)"), default
    assert "int8 0.2198 (relative rise 1.775, gate ≤ 0.01)" in default, default
    share = next(x for x in _scored(0.9, "accuracy", {"int8": 0.88}) if x.startswith("Metric"))
    assert "int8 0.88 (drop 0.02, gate ≤ 0.01)" in share and "error metric" not in share, share
    assert not any(x.startswith("Metric") for x in _scored(None, None, {}))


def psnr(outputs: dict[str, np.ndarray], labels: np.ndarray) -> float:
    """A user's metric in dB, higher is better, without ``relative = True``: its drop is in dB."""
    mse = float(np.mean((next(iter(outputs.values())) - labels) ** 2))
    return 10 * np.log10(1 / mse)


def rel_err(outputs: dict[str, np.ndarray], labels: np.ndarray) -> float:
    """A user's error metric, judged by its rise over the reference's value."""
    return float(np.abs(next(iter(outputs.values())) - labels).mean())


rel_err.higher_is_better = False  # type: ignore[attr-defined]
rel_err.relative = True  # type: ignore[attr-defined]


def test_a_users_metric_is_shown_with_its_gate_in_its_own_units() -> None:
    """A PSNR without ``relative = True`` is gated by its drop in dB (max_metric_drop 0.01: 0.01 dB), which the line
    says beside each engine's drop; one with it by its rise over the reference's value."""
    line = next(x for x in _scored(24.97, f"{__name__}:psnr", {"int8": 24.9}) if x.startswith("Metric"))
    assert "int8 24.9 (drop 0.07, gate ≤ 0.01)" in line, line
    assert "a drop of at most 0.01 in" in line and "own units (higher is better)" in line, line
    line = next(x for x in _scored(2.0, f"{__name__}:rel_err", {"int8": 2.1}) if x.startswith("Metric"))
    assert "int8 2.1 (relative rise 0.05, gate ≤ 0.01)" in line, line
    assert "1 % more error than the reference's" in line and "(lower is better)" in line, line


def test_a_users_metric_not_loaded_here_is_shown_with_its_gate_and_both_units() -> None:
    """A cached run renders the report without running the user's code: the gate stands beside each engine, with
    what it is in for either kind of function."""
    line = next(x for x in _scored(24.97, "not_imported_here.metrics:psnr", {"int8": 24.9}) if x.startswith("Metric"))
    assert "int8 24.9 (gate ≤ 0.01)" in line, line
    assert "a drop of at most 0.01 in" in line and "where its function sets `relative = True`, 1 % worse" in line


def test_top1_flips_on_ties_are_counted_over_what_top1_compares() -> None:
    """Per-token logits: the share of ties is of the labelled positions (at the worst shape), not of samples."""
    timed = {"8": Percentiles(p50=0.1, p90=0.1, p99=0.1)}
    e = EngineValidation(name="s2s", backend="onnxruntime", precision="int8", device="cpu", status="validated")
    e.passed, e.top1_agreement, e.top1_ties, e.latency_ms = True, 1.0, 0.1641, timed
    for positions, counted in [(384, "16.41% of the labelled positions compared"), (None, "top-1 decisions")]:
        b = Baseline(accuracy=0.9, samples=8, latency_ms=timed, logits_output="logits", labelled_positions=positions)
        lines = report_section(ValidationResult(passed=True, baseline=b, engines=[e], failures=[]))
        tie = next(x for x in lines if x.startswith("Top-1 flips on ties"))
        assert counted in tie and "of samples" not in tie and "where the share is largest" in tie, tie
        row = next(x for x in lines if x.startswith("| s2s |"))
        assert "1.0000 (with 16.41% ties)" in row, row  # the headline says the ties are in the figure


def _compared_line(top1: float | None, accuracy: float | None, note: str | None) -> str:
    """The "Compared outputs" sentence of a two-head model whose click logit is the class-logit output."""
    timed = {"8": Percentiles(p50=0.1, p90=0.1, p99=0.1)}
    e = EngineValidation(name="e", backend="onnxruntime", precision="int8", device="cpu", status="validated")
    e.passed, e.top1_agreement, e.accuracy, e.latency_ms = True, top1, accuracy, timed
    b = Baseline(accuracy=accuracy, accuracy_note=note, samples=8, latency_ms=timed, logits_output="click")
    b.compared = ["click", "value"]
    lines = report_section(ValidationResult(passed=True, baseline=b, engines=[e], failures=[]))
    return next(x for x in lines if x.startswith("Compared outputs"))


def test_the_compared_outputs_say_only_what_was_measured_on_the_class_logits() -> None:
    """A named class-logit output claims top-1 agreement and accuracy only where each was measured, and says why
    one was not."""
    note = "the labels float32[300, 2] are no 0/1 label per row for 'click', a binary classifier's one logit"
    assert "; top-1 agreement and accuracy on 'click'." in _compared_line(0.99, 0.9, None)
    top1 = _compared_line(0.99, None, note)
    assert f"; top-1 agreement on 'click'; no task accuracy ({note})." in top1, top1
    neither = _compared_line(None, None, note)
    assert "top-1 agreement and accuracy" not in neither and "top-1 agreement on" not in neither, neither
    assert (
        "class-logit output 'click': no top-1 agreement (it has no class axis: one value per row, which is a "
        "binary classifier's one logit only beside 0/1 labels with num_classes=2 in the data) and no task "
        f"accuracy ({note})"
    ) in neither, neither


def test_outputs_coupled_across_the_batch_are_said_with_how_they_are_served() -> None:
    """A two-tower model's image-text logits [batch, batch]: validation records them (the Triton configs then take
    no batching); the report said nothing of it."""
    b = Baseline(accuracy=None, samples=8, latency_ms={})
    b.compared = ["logits_per_image", "logits_per_text", "text_embeds"]
    coupled = ["logits_per_image", "logits_per_text"]
    v = ValidationResult(passed=True, baseline=b, engines=[], failures=[], batch_coupled=coupled)
    line = next(x for x in report_section(v) if x.startswith("Compared outputs"))
    assert "'logits_per_image', 'logits_per_text' depend on the whole batch" in line and "served unbatched" in line
    v.batch_coupled = []
    assert "whole batch" not in next(x for x in report_section(v) if x.startswith("Compared outputs"))


def test_the_latency_note_names_the_sizes_a_model_of_dynamic_axes_was_timed_at() -> None:
    """Latency of a model with a length axis depends on it: the report says the sizes it was timed at (the largest
    validated), and says nothing of sizes for a model whose only dynamic axis is the batch."""
    timed = {"8": Percentiles(p50=0.1, p90=0.1, p99=0.1)}
    timing = {"rounds": 12, "cpus": 2, "load_before": 0.1, "load_after": 0.1, "median_spread": 0.01, "busy": False}
    b = Baseline(accuracy=None, samples=8, latency_ms=timed)
    for extra, said in (({"timed_at": {"samples": 24000}}, True), ({}, False)):
        v = ValidationResult(passed=True, baseline=b, engines=[], failures=[], timing={**timing, **extra})
        line = next(x for x in report_section(v) if x.startswith("Latency:"))
        assert ("Timed at samples=24000 (the largest validated sizes)" in line) == said, line
        assert ("Timed at" in line) == said
    v = ValidationResult(passed=True, baseline=b, engines=[], failures=[], timing={**timing, "torch_threads": 2})
    assert "PyTorch timed on 2 thread(s)." in next(x for x in report_section(v) if x.startswith("Latency:"))


RNG = np.random.default_rng(0)
X = torch.from_numpy(RNG.standard_normal((24, 4)).astype(np.float32))
HEADS = {
    k: RNG.standard_normal((4, n)).astype(np.float32) for k, n in (("output_0", 256), ("output_1", 4), ("output_2", 1))
}
QUERIES = RNG.standard_normal((4, 3 * 6)).astype(np.float32)  # a detector's 3 queries of 5 classes + no object


def _three_heads(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A model of three unnamed outputs (a tuple's), the first 256 class logits."""
    return {k: feed["input"] @ w for k, w in HEADS.items()}


def _detector(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A YOLOS-like head: ``logits [N, 3, 6]`` (5 classes and no object) beside boxes ``[N, 3, 4]``."""
    x = feed["input"]
    boxes = np.concatenate([np.full((len(x), 3, 2), 0.2), np.full((len(x), 3, 2), 0.6)], -1).astype(np.float32)
    return {"logits": (x @ QUERIES).reshape(len(x), 3, 6), "pred_boxes": boxes}


def _reported(data: DatasetSplits, run: Any, names: list[str], setting: str | None, metric: str | None) -> str:
    """The "Compared outputs" sentence of a run of ``run`` on ``data``: the validate stage's own reference and
    notes, as a run records them."""
    sig = Signature(logits_output=setting, batch_sizes=[1, 8])
    ctx = SimpleNamespace(config=SimpleNamespace(signature=sig, model=ModelConfig()))
    cfg = CheckConfig(metric=metric)
    ref = reference(ctx, data, cfg, run, held_out(data, lambda v: as_feed(v, ["input"]), {}, {}, None), names, {})
    note = accuracy_absent(ref, data, sig.logits_output)
    b = Baseline(accuracy=ref.accuracy, accuracy_note=note, samples=8, latency_ms={})
    b.logits_output, b.compared, b.metric_name = ref.logits, list(ref.outputs[-1]), metric
    lines = report_section(ValidationResult(passed=True, baseline=b, engines=[], failures=[]))
    return next(x for x in lines if x.startswith("Compared outputs"))


def test_the_report_says_why_no_output_is_the_class_logits_apart_from_why_there_is_no_accuracy() -> None:
    """Three unnamed outputs and num_classes 256 without labels: the reason for no class-logit output was the one
    for no task accuracy (no labels). It names why no output was taken, and the setting that takes one; a DETR-style
    head (5 classes + no object) beside float box labels has its class scores taken as class logits
    (detection_recall's), with no task accuracy of its own; a regression's (float targets scored by mse), whose
    targets are values, says that once."""
    unlabelled = DatasetSplits(X[:8], None, X, None, num_classes=256)
    line = _reported(unlabelled, _three_heads, list(HEADS), None, None)
    assert (
        "no class-logit output (3 outputs (output_0, output_1, output_2), none named 'logits': set "
        "`signature.logits_output` to the one that holds class logits): no top-1 agreement"
    ) in line, line
    assert "; no task accuracy (the data has no held-out labels (val_y is None))." in line, line
    assert "class-logit output 'output_0'" in _reported(unlabelled, _three_heads, list(HEADS), "output_0", None)

    y = torch.tensor([[2.0, 0.2, 0.2, 0.6, 0.6]]).repeat(len(X), 1, 1)  # one box per image: (class, x1, y1, x2, y2)
    boxes = DatasetSplits(X[:8], y[:8], X, y, num_classes=5)
    line = _reported(boxes, _detector, ["logits", "pred_boxes"], None, "detection_recall")
    assert "class-logit output 'logits'" in line and "no class-logit output" not in line, line  # detection_recall's
    assert "no task accuracy (the labels are no classes (float targets float32[24, 1, 5] beside num_classes 5" in line
    assert "class-logit output 'logits'" in _reported(boxes, _detector, ["logits", "pred_boxes"], "logits", None)

    y = torch.from_numpy(X.numpy() @ HEADS["output_2"])
    line = _reported(
        DatasetSplits(X[:8], y[:8], X, y), lambda f: {"y": f["input"] @ HEADS["output_2"]}, ["y"], None, "mse"
    )
    assert "no class-logit output (the labels are no classes (float targets): validate.metric 'mse'" in line, line
    assert "no top-1 agreement or accuracy" in line and "no task accuracy" not in line, line


def _rel_l2(outputs: dict[str, np.ndarray], labels: np.ndarray) -> float:
    """A user's error metric on the first output (a VAE's reconstruction)."""
    return float(np.linalg.norm(outputs["output_0"] - labels) / np.linalg.norm(labels))


def test_a_named_output_of_float_targets_is_said_as_their_prediction_not_asked_for() -> None:
    """A VAE's three outputs, float targets scored by the user's metric, and ``signature.logits_output: output_0``
    (its reconstruction): the report says that output holds the targets' prediction, not that none is named
    'logits' with the advice to set the setting the user set."""
    y = torch.from_numpy(X.numpy() @ HEADS["output_1"])

    def vae(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        x = feed["input"]
        return {"output_0": x @ HEADS["output_1"], "output_1": x @ HEADS["output_2"], "output_2": x[:, :1]}

    line = _reported(DatasetSplits(X[:8], y[:8], X, y), vae, list(HEADS), "output_0", f"{__name__}:_rel_l2")
    assert "none named 'logits'" not in line and "set `signature.logits_output`" not in line, line
    assert "'output_0', which signature.logits_output names, holds their prediction" in line, line
    assert "no top-1 agreement or accuracy" in line, line


def test_an_integer_outputs_share_of_equal_values_is_not_called_top1_agreement() -> None:
    """A detector's top-k indices beside its scores: the indices' statistic is the share of equal values
    (compare_outputs gives it no cosine), marked as such in the per-output table's top-1 column."""
    from kiln.core.compare import compare_outputs

    rng = np.random.default_rng(0)
    scores = rng.standard_normal((8, 10)).astype(np.float32)
    inds = rng.integers(0, 100, (8, 10))
    got_inds = inds.copy()
    got_inds[:, :2] += 1  # two of ten values differ in every row
    stats = compare_outputs({"scores": scores, "inds": inds}, {"scores": scores + 1e-4, "inds": got_inds})
    engine = EngineValidation(
        name="e", backend="onnxruntime", precision="fp32", device="cpu", status="validated", passed=False
    )
    engine.outputs = {n: s.as_dict() for n, s in stats.items()}
    engine.gates = {"min_cosine": 0.9999, "min_top1_agreement": 0.99}
    engine.latency_ms = {"8": Percentiles(p50=0.2, p90=0.2, p99=0.2)}
    v = ValidationResult(
        passed=False, baseline=Baseline(accuracy=None, samples=8, latency_ms={}), engines=[engine], failures=[]
    )
    lines = report_section(v)
    header, _, *rows = _table(lines[lines.index("### Per output (worst over shapes and batch sizes)") + 2 :])
    cells = {row[1]: dict(zip(header, row)) for row in rows}
    column = next(h for h in header if h.startswith("top-1"))
    assert cells["inds"][column] == "0.8000 (equal values)", cells
    assert "equal values" not in cells["scores"][column], cells  # a float output's top-1 agreement stays as it is


def test_an_embedding_output_is_said_to_be_compared_as_features_for_one_reason() -> None:
    """The only output named as features: one sentence on what it is held to, not the class-logits default's rule
    beside the features' note."""
    engine = EngineValidation(
        name="e", backend="onnxruntime", precision="int8", device="cpu", status="validated", passed=True
    )
    engine.latency_ms = {"1": Percentiles(p50=0.1, p90=0.1, p99=0.1)}
    note = "the only output, 'embedding', is named as features"
    baseline = Baseline(accuracy=None, samples=8, latency_ms=engine.latency_ms, compared=["embedding"])
    baseline.accuracy_note = note
    v = ValidationResult(passed=True, baseline=baseline, engines=[engine], failures=[])
    line = next(x for x in report_section(v) if x.startswith("Compared outputs"))
    assert "'embedding' is named as features (an embedding), held to cosine" in line, line
    assert "DETR" not in line and "taken as class logits by default" not in line


def test_a_torch_engine_run_under_autocast_says_so_beside_its_precision() -> None:
    """Under torch.autocast the ops it keeps in float32 run so: the row does not call the engine float16 alone."""
    engines = [
        EngineValidation(name=n, backend="torch", precision="fp16", device="cpu", status="validated", autocast=a)
        for n, a in (("plain", False), ("mixed", True))
    ]
    for e in engines:
        e.latency_ms = {"4": Percentiles(p50=0.2, p90=0.2, p99=0.2)}
    v = ValidationResult(
        passed=True, baseline=Baseline(accuracy=None, samples=8, latency_ms={}), engines=engines, failures=[]
    )
    header, _, *rows = _table(report_section(v))
    precision = {r[0]: dict(zip(header, r))["precision"] for r in rows}
    assert precision["plain"] == "fp16" and precision["mixed"] == "fp16 (autocast)", precision


def test_a_derived_relative_error_limit_is_shown_beside_the_error_it_held() -> None:
    """No max_rel_err set: the limit derived for the engine (its gates' rel_err_limit) is the one in its row."""
    engine = EngineValidation(
        name="e", backend="onnxruntime", precision="int8", device="cpu", status="validated", passed=False
    )
    engine.rel_err, engine.gates = 0.2536, {"max_rel_err": None, "rel_err_limit": 0.01414}
    engine.latency_ms = {"4": Percentiles(p50=0.2, p90=0.2, p99=0.2)}
    v = ValidationResult(
        passed=False, baseline=Baseline(accuracy=None, samples=8, latency_ms={}), engines=[engine], failures=[]
    )
    header, _, *rows = _table(report_section(v))
    assert dict(zip(header, rows[-1]))["rel err"] == "0.2536 (≤ 0.01414)", rows


def test_the_reference_line_of_a_regression_gives_its_metric_not_an_empty_accuracy() -> None:
    """Float targets have no accuracy: the first line gives the metric the reference scored (mse), not 'accuracy -';
    a classifier's keeps its accuracy."""
    first = next(x for x in _scored(0.7413, None, {"int8": 0.75}) if x.startswith("Accuracy reference"))
    assert ", mse 0.7413 on 8 held-out samples" in first and "accuracy -" not in first, first
    named = next(x for x in _scored(3.5, "mae", {"int8": 3.6}) if x.startswith("Accuracy reference"))
    assert ", mae 3.5 on 8 held-out" in named, named
    classes = next(x for x in _scored(None, None, {}, accuracy=0.9) if x.startswith("Accuracy reference"))
    assert ", accuracy 0.9" in classes, classes
