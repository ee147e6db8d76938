"""Issue 31 rule 2: a calibration that measured nothing (all-zero data, NaN or infinite ranges, a float input
whose range is 0) is an error, never INT8 scales and never a run that says it passed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from kiln.calibration.ranges import check_ranges
from kiln.cli import main
from kiln.core.errors import InputError
from tests.pipeline.test_faults import assert_clean, tiny_onnx


class _Range:
    def __init__(self, lo: float, hi: float) -> None:
        self.range_value = (np.float32(lo), np.float32(hi))


@pytest.mark.parametrize(
    "ranges, needle",
    [
        ({"input": (0, 0), "logits": (0, 0)}, "measured nothing"),
        ({"input": (0, 1), "logits": (np.nan, 1)}, "NaN or infinite"),
        ({"input": (-np.inf, 1), "logits": (0, 1)}, "NaN or infinite"),
        ({"input": (0, 0), "logits": (-1, 2)}, "calibration input 'input' is 0 in every sample"),
    ],
)
def test_ranges_that_cannot_be_right(tmp_path: Path, ranges: dict, needle: str) -> None:
    model = tiny_onnx(tmp_path / "m.onnx")
    with pytest.raises(InputError, match=needle):
        check_ranges({k: _Range(*v) for k, v in ranges.items()}, model)


def test_ranges_of_real_data_pass(tmp_path: Path) -> None:
    check_ranges({"input": _Range(0, 1), "logits": _Range(-3, 4)}, tiny_onnx(tmp_path / "m.onnx"))


@pytest.mark.parametrize("twice", [False, True])  # the second run reads the cached ranges: checked the same
def test_all_zero_calibration_data_is_an_error(tmp_path: Path, twice: bool) -> None:
    model = tiny_onnx(tmp_path / "m.onnx")
    feed = tmp_path / "zeros.npz"
    np.savez(feed, input=np.zeros((8, 4), np.float32))
    args = ["precision", str(model), "-o", str(tmp_path / "v"), "--variants", "int8", "--calibration", str(feed)]
    for _ in range(2 if twice else 1):
        result = CliRunner().invoke(main, args)
    assert_clean(result, 2, "calibration measured nothing")
    assert "fix:" not in next(ln for ln in result.output.splitlines() if ln.startswith("error:")), result.output
