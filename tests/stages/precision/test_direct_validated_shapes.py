"""`kiln precision FILE --set signature.shapes=...` does what a run does at the sizes it records: the --calibration
data is calibrated at its own size and, one batch each, at every other validated shape, and each variant is judged
at every one, so a graph that cannot run at a size asked for is one error there, not at `kiln build`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tests.pipeline.test_faults import assert_clean, invoke
from tests.stages.precision.token_graph import token_graph, token_ids

SHAPES = "signature.shapes={seq: [4, 24]}"


def _precision(tmp: Path, model: Path, *args: str) -> object:
    np.savez(tmp / "calib.npz", input_ids=token_ids(32))
    return invoke("precision", model, "-o", tmp / "v", "--variants", "int8", "--calibration", tmp / "calib.npz", *args)


def test_a_size_the_graph_cannot_run_is_one_error(tmp_path: Path) -> None:
    """A position table of 16 rows: the graph runs at seq=16 (the data's) and at no size signature.shapes asks for."""
    result = _precision(tmp_path, token_graph(tmp_path / "pos.onnx", table=16), "--set", SHAPES)
    assert_clean(result, 2, "ONNX Runtime cannot run the reference, pos.onnx, on the --calibration inputs")
    error = next(line for line in result.output.splitlines() if line.startswith("error:"))
    assert "int64[32, 4]" in error or "int64[32, 24]" in error, error
    assert "give signature.shapes sizes the graph takes" in result.output
    assert not (tmp_path / "v").exists()


def test_the_data_is_calibrated_at_every_size_recorded(tmp_path: Path) -> None:
    result = _precision(tmp_path, token_graph(tmp_path / "m.onnx"), "--set", SHAPES)
    assert result.exit_code == 0, result.output
    variants = json.loads((tmp_path / "v" / "variants.json").read_text())
    assert variants["axis_sizes"] == {"seq": [4, 24]}
    assert variants["variants"]["int8"]["report"]["calibration"]["batches"] == 3  # at 16 (its own), 4 and 24


def test_without_shapes_the_datas_own_size_alone_is_calibrated(tmp_path: Path) -> None:
    result = _precision(tmp_path, token_graph(tmp_path / "pos.onnx", table=16))
    assert result.exit_code == 0, result.output
    variants = json.loads((tmp_path / "v" / "variants.json").read_text())
    assert variants["axis_sizes"] == {"seq": [16]}
    assert variants["variants"]["int8"]["report"]["calibration"]["batches"] == 1
