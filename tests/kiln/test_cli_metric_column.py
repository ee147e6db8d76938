"""The console's validate.metric column resolves the gate: an engine whose metric moved by more than
``max_metric_drop`` never prints the reference's number; and ONNX Runtime quantizer's note on a bias computed in
the graph is known noise, shown with --verbose only."""

from __future__ import annotations

import io
import logging

from rich.console import Console

from kiln.cli import _accuracy_table, _setup_logging
from kiln.core.records import Baseline, EngineValidation, ValidationResult
from kiln.pipeline.report import fmt


def _rows(reference: float, engine: float, gate: float) -> dict[str, str]:
    baseline = Baseline(accuracy=None, samples=64, latency_ms={}, metric=reference, metric_name="metrics:ppl")
    common = {"backend": "onnxruntime", "device": "cpu", "status": "validated", "passed": True, "cosine": 1.0}
    engines = [
        EngineValidation(name=f"e-{p}", precision=p, metric=m, gates={"max_metric_drop": gate}, **common)
        for p, m in (("fp32", reference), ("int8", engine))
    ]
    out = io.StringIO()
    validation = ValidationResult(passed=True, baseline=baseline, engines=engines, failures=[])
    Console(file=out, width=120).print(_accuracy_table(validation, fmt))
    lines = [line.split() for line in out.getvalue().splitlines()]
    return {cells[0]: cells[-1] for cells in lines if cells and cells[0] in ("reference", "e-fp32", "e-int8")}


def test_a_change_larger_than_the_gate_prints_differently_at_values_in_the_hundreds() -> None:
    rows = _rows(362.04166, 362.02, 0.01)
    assert rows["reference"] == rows["e-fp32"] != rows["e-int8"], rows


def test_small_values_keep_four_significant_digits() -> None:
    rows = _rows(0.812345, 0.7, 0.01)
    assert rows["reference"] == "0.8123" and rows["e-int8"] == "0.7", rows


def test_the_quantizers_bias_note_is_noise(capsys) -> None:
    _setup_logging(quiet=False, verbose=False)
    try:
        logging.warning("Expected bias 'val_251' to be an initializer")  # ORT's module-level logging.warning
        logging.getLogger("some_library").warning("a library warning a user should see")
        err = capsys.readouterr().err
        assert "Expected bias" not in err and "a library warning a user should see" in err
    finally:
        root = logging.getLogger()
        root.handlers[:] = [h for h in root.handlers if not getattr(h, "kiln", False)]
