"""The validation section of report.md: every value beside the gate that held it, and no gate where none did."""

from __future__ import annotations

from kiln.core.records import Baseline, EngineValidation, Percentiles, ValidationResult
from kiln.stages.validate.report import report_section


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
