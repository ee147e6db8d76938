"""What ONNX Runtime's histogram calibrators print goes to Kiln's debug log: a kiln command's output carries
Kiln's results and messages only."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from click.testing import CliRunner

from kiln.cli import main
from tests.calibration.calib_graphs import batches, conv_model


def test_calibrator_progress_is_in_the_debug_log(tmp_path: Path) -> None:
    """Percentile: entropy's calibrator prints the same from the same class."""
    model, feed = tmp_path / "model.onnx", tmp_path / "x.npz"
    onnx.save(conv_model(), model)
    np.savez(feed, input=np.concatenate(batches()))
    args = ["precision", str(model), "-o", str(tmp_path / "v"), "--variants", "int8", "--calibration", str(feed)]
    settings = ["--set", "calibration.method=percentile", "--set", "calibration.cache=false"]
    result = CliRunner().invoke(main, [*args, *settings])
    assert result.exit_code == 0, result.output
    assert "Collecting tensor data" not in result.stdout + result.stderr and "histogram" not in result.output
    assert "int8:" in result.stdout  # the results are still there
    debug = CliRunner().invoke(main, [*args, *settings, "-vv"])
    assert debug.exit_code == 0, debug.output
    assert "onnxruntime: Finding optimal threshold" in debug.stderr  # it ran: Kiln's log has it
