"""The console's accuracy table: validate.metric's column beside the built-in ones, each told apart by its header."""

from __future__ import annotations

import io

from rich.console import Console

from kiln.cli import _accuracy_table
from kiln.core.records import Baseline, EngineValidation, ValidationResult
from kiln.pipeline.report import fmt


def _validation(metric: str) -> ValidationResult:
    """A validation of one engine, scored by validate.metric ``metric`` beside task accuracy."""
    baseline = Baseline(accuracy=0.52, samples=64, latency_ms={}, metric=0.52, metric_name=metric)
    engine = EngineValidation(
        name="onnxruntime-cpu-fp32",
        backend="onnxruntime",
        precision="fp32",
        device="cpu",
        status="validated",
        passed=True,
        cosine=1.0,
        top1_agreement=1.0,
        accuracy=0.52,
        metric=0.52,
    )
    return ValidationResult(passed=True, baseline=baseline, engines=[engine], failures=[])


def _header(metric: str) -> list[str]:
    """The table's header lines as an 80-column console shows them (a log, a pipe), by column."""
    out = io.StringIO()
    Console(file=out, width=80).print(_accuracy_table(_validation(metric), fmt))
    lines = out.getvalue().splitlines()
    assert all(len(line) <= 80 and "…" not in line for line in lines), lines
    head = lines[1 : next(i for i, line in enumerate(lines) if "━" in line)]
    return [" ".join(" ".join(cell.split()) for cell in cells).strip() for cells in zip(*(h.split("┃") for h in head))]


def test_a_metric_named_like_the_task_accuracy_column_is_headed_as_the_metric() -> None:
    """`validate.metric: accuracy` headed two columns `accuracy` alike: task accuracy and the metric. A metric of a
    name of its own keeps it as its header."""
    assert _header("accuracy") == ["engine", "passed", "cosine", "top-1", "accuracy", "metric: accuracy"]
    assert _header("macro_f1") == ["engine", "passed", "cosine", "top-1", "accuracy", "macro_f1"]
