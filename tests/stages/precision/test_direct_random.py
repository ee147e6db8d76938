"""`kiln precision FILE` without --calibration: the warning and the summary say what random inputs are used for, and
name INT8 ranges only where a variant takes ranges (FP16 takes none)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.pipeline.test_faults import invoke, tiny_onnx


@pytest.mark.parametrize(("variants", "said"), [("fp16", "checked"), ("int8", "calibrated")])
def test_random_inputs_are_said_for_what_they_do(tmp_path: Path, variants: str, said: str) -> None:
    out = invoke("precision", tiny_onnx(tmp_path / "m.onnx"), "-o", tmp_path / "v", "--variants", variants)
    assert out.exit_code == 0, out.output
    text = " ".join(out.output.split())
    assert f"{said} on RANDOM inputs; wrote" in text
    assert ("INT8 ranges will not match real data" in text) == (variants == "int8")
