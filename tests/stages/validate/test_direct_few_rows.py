"""`kiln validate ENGINE --inputs` on a handful of rows warns that its agreement is of that few samples."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.pipeline.test_faults import invoke, tiny_onnx


def test_inputs_of_a_few_rows_are_warned_of_as_kiln_precision_warns_of_its_calibration_rows(tmp_path: Path) -> None:
    """One row of inputs passed with no word: every gate was judged on a single sample."""
    model, engine = tiny_onnx(tmp_path / "m.onnx"), tmp_path / "e"
    assert invoke("build", model, "-o", engine).exit_code == 0
    rng = np.random.default_rng(0)
    for rows, warned in ((1, True), (32, False)):
        np.savez(tmp_path / "x.npz", input=rng.random((rows, 4), dtype=np.float32))
        out = invoke("validate", engine, "--reference", model, "--inputs", tmp_path / "x.npz")
        assert out.exit_code == 0, out.output
        said = " ".join(out.output.split())  # the log's lines wrap at the terminal's width
        assert ("holds only 1 row: the engine's agreement with the reference is measured" in said) is warned, said
        assert ("Give at least 32 rows" in said) is warned, said
