"""_as_distribution: FP8's max-calibrated scale as ORT's distribution data, without numpy warnings."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from onnxruntime.quantization.calibrate import CalibrationMethod, TensorData, TensorsData

from kiln.calibration.quantize import E4M3_MAX, _as_distribution
from kiln.calibration.ranges import Ranges

FLT_MAX = float(np.finfo(np.float32).max)


def _ranges(bounds: dict[str, tuple[float, float]], shape: tuple[int, ...]) -> Ranges:
    data = {
        n: TensorData(lowest=np.full(shape, lo, np.float32), highest=np.full(shape, hi, np.float32))
        for n, (lo, hi) in bounds.items()
    }
    return Ranges(TensorsData(CalibrationMethod.MinMax, data), None, "key", False, "minmax")


@pytest.mark.parametrize("shape", [(), (1,)], ids=["scalar", "array"])
def test_a_mask_filled_with_float32s_largest_gives_a_finite_deviation_and_no_overflow_warning(
    shape: tuple[int, ...],
) -> None:
    """A Wav2Vec2's attention mask fills with -FLT_MAX: its deviation stays finite and the scale ORT derives from it
    (std / std of the E4M3 values) is amax / 448, as for any other tensor; a tensor that is not finite (kept in
    float) stays infinite, and neither warns."""
    ranges = _ranges({"mask": (-FLT_MAX, 0.0), "x": (-2.0, 3.0), "inf": (-np.inf, 1.0)}, shape)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        data = _as_distribution(ranges).tensors
    std_of = {name: float(np.asarray(data[name].std).reshape(-1)[0]) for name in ("mask", "x", "inf")}
    assert np.isfinite(std_of["mask"]) and std_of["mask"] > 0
    assert np.isclose(std_of["mask"] / std_of["x"], FLT_MAX / 3.0, rtol=1e-5)
    assert std_of["inf"] == np.inf
    assert float(np.asarray(data["mask"].range_value[1]).reshape(-1)[0]) == FLT_MAX and E4M3_MAX == 448.0
