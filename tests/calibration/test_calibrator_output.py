"""What ONNX Runtime's histogram calibrators print goes to stderr: a kiln command's stdout carries results only."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from click.testing import CliRunner

from kiln.cli import main
from tests.calibration.calib_graphs import batches, conv_model


def test_calibrator_progress_is_not_on_stdout(tmp_path: Path) -> None:
    """Percentile: entropy's calibrator prints the same from the same class, and takes seconds more."""
    model, feed = tmp_path / "model.onnx", tmp_path / "x.npz"
    onnx.save(conv_model(), model)
    np.savez(feed, input=np.concatenate(batches()))
    args = ["precision", str(model), "-o", str(tmp_path / "v"), "--variants", "int8", "--calibration", str(feed)]
    result = CliRunner().invoke(
        main, [*args, "--set", "calibration.method=percentile", "--set", "calibration.cache=false"]
    )
    assert result.exit_code == 0, result.output
    assert "Collecting tensor data" not in result.stdout and "histogram" not in result.stdout
    assert "Collecting tensor data" in result.stderr  # it ran, on stderr
    assert "int8:" in result.stdout  # the results are still there
