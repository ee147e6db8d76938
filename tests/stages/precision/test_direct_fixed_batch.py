"""`kiln precision FILE --calibration data.npz` of a graph that fixes its batch at 1 (the TorchScript exporter's):
every row of the data calibrates and checks the variant, one batch of 1 at a time."""

from __future__ import annotations

import json
from pathlib import Path

from tests.pipeline.test_faults import invoke
from tests.stages.validate.test_direct import _rows, fixed_batch_onnx


def test_int8_of_a_fixed_batch_calibrates_and_is_checked_on_every_row(tmp_path: Path) -> None:
    model, out = fixed_batch_onnx(tmp_path / "m.onnx"), tmp_path / "v"
    result = invoke("precision", model, "-o", out, "--variants", "int8", "--calibration", _rows(tmp_path))
    assert result.exit_code == 0, result.output
    int8 = json.loads((out / "variants.json").read_text())["variants"]["int8"]
    assert int8["report"]["calibration"]["batches"] == 8  # 8 batches of its 1 row
    assert int8["vs_fp32"]["samples"] == 8


def test_the_fallbacks_tensor_comparison_runs_a_fixed_batch_one_batch_at_a_time(tmp_path: Path) -> None:
    """The fallback's blame compares intermediate tensors over the held-out rows: in batches of the graph's own."""
    import numpy as np

    from kiln.stages.precision.compare import run_batched

    x = np.load(_rows(tmp_path))["input"]
    logits, m = run_batched(fixed_batch_onnx(tmp_path / "m.onnx"), {"input": x}, extra_outputs=["m"])
    assert logits.shape == (8, 3) and m.shape == (8, 3)
