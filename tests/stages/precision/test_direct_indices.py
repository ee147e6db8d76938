"""`kiln precision model.onnx --calibration data.npz` with token ids past the graph's embedding: one error/fix pair
naming the input, the value and the table's rows, before calibration or the gates run the data through ONNX Runtime
(whose Gather stops with a traceback)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from click.testing import CliRunner

from kiln.cli import main
from tests.stages.precision.precision_graphs import token_graph


def _run(tmp: Path, ids: np.ndarray) -> object:
    model, feed = tmp / "m.onnx", tmp / "d.npz"
    onnx.save(token_graph(vocab=10), model)
    np.savez(feed, input=ids)
    args = ["precision", str(model), "-o", str(tmp / "v"), "--variants", "int8", "--calibration", str(feed)]
    return CliRunner().invoke(main, args)


def test_calibration_ids_past_the_vocabulary_are_one_error_naming_them(tmp_path: Path) -> None:
    ids = np.random.default_rng(0).integers(0, 10, (32, 6)) + 5  # 5..14 into 10 rows
    result = _run(tmp_path, ids)
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    lines = [line for line in result.output.splitlines() if line.startswith(("error:", "fix:"))]
    assert lines[0] == (
        f"error: --calibration {tmp_path / 'd.npz'}: input 'input' holds 14: m.onnx takes values from 0 to 9 (the "
        "positions of the axis it indexes: a table's rows, a graph's nodes)"
    )
    assert (
        lines[1].startswith("fix: give indices within what the input indexes")
        and not (tmp_path / "v" / "int8").exists()
    )


def test_ids_within_the_vocabulary_calibrate(tmp_path: Path) -> None:
    result = _run(tmp_path, np.random.default_rng(0).integers(0, 10, (32, 6)))
    assert result.exit_code == 0, result.output
    assert (tmp_path / "v" / "int8" / "model.onnx").is_file()


def test_negative_calibration_ids_are_refused_as_the_engines_built_from_it_refuse_them(tmp_path: Path) -> None:
    """`kiln build` records an index input's range as 0 to rows - 1, so ids counted from a table's end are refused
    here too, not calibrated on the table's last rows."""
    ids = np.random.default_rng(0).integers(0, 10, (32, 6))
    ids[3, 2] = -3
    result = _run(tmp_path, ids)
    assert result.exit_code == 2, result.output
    assert "input 'input' holds -3: m.onnx takes values from 0 to 9" in result.output
    assert "counted from its end" not in result.output and not (tmp_path / "v" / "int8").exists()
