"""Calibration feeds ONNX Runtime one batch a ``collect_data`` call (its memory holds one batch's tensors), with the
ranges ORT computes from all the batches in one call."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from onnxruntime.quantization import create_calibrator
from onnxruntime.quantization.calibrate import HistogramCalibrater, MinMaxCalibrater

from kiln.calibration.data import ArrayReader
from kiln.calibration.entropy import entropy_ranges
from kiln.calibration.ranges import ENTROPY_BINS, _ort_method, calibrate
from tests.calibration.calib_graphs import batches, saved

CASES = [("minmax", False), ("percentile", True), ("percentile", False), ("distribution", False), ("entropy", False)]


def spread() -> list[np.ndarray]:
    """Batches of growing magnitude: a merge of one batch's histogram into the last one's would rebin them."""
    return [b * (i + 1) for i, b in enumerate(batches(n=4, size=8, seed=3))]


def all_at_once(model: Path, data: list[np.ndarray], method: str, symmetric: bool, tmp: Path) -> dict[str, Any]:
    """ORT's ranges with every batch in one ``collect_data`` call, as Kiln calibrated before."""
    extra: dict[str, Any] = {"symmetric": symmetric, **(ENTROPY_BINS if method == "entropy" else {})}
    calibrator = create_calibrator(
        model,
        None,
        augmented_model_path=str(tmp / "ref.onnx"),
        calibrate_method=_ort_method(method),
        extra_options=extra,
    )
    calibrator.collect_data(ArrayReader("input", data))
    if method == "entropy":
        return entropy_ranges(calibrator.collector.get_histogram_dict(), ENTROPY_BINS["num_quantized_bins"]).data
    return calibrator.compute_data().data


@pytest.mark.parametrize(("method", "symmetric"), CASES)
def test_batch_by_batch_ranges_equal_all_at_once(tmp_path: Path, method: str, symmetric: bool) -> None:
    model, data = saved(tmp_path), spread()
    got = calibrate(model, data, "input", method, cache_dir=None, symmetric=symmetric).tensors.data
    want = all_at_once(model, data, method, symmetric, tmp_path)
    assert set(got) == set(want)
    for name, td in want.items():
        np.testing.assert_allclose(np.asarray(got[name].range_value, dtype=np.float64), td.range_value, rtol=1e-6)


@pytest.mark.parametrize("method", ["minmax", "percentile", "entropy"])
def test_the_calibrator_is_fed_one_batch_a_call(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: str) -> None:
    rows: list[list[int]] = []
    for cls in (MinMaxCalibrater, HistogramCalibrater):
        original = cls.collect_data

        def counted(self: Any, reader: ArrayReader, original: Any = original) -> None:
            rows.append([len(b) for b in reader.batches])
            original(self, reader)

        monkeypatch.setattr(cls, "collect_data", counted)
    calibrate(saved(tmp_path), spread(), "input", method, cache_dir=None)
    assert rows and all(r == [8] for r in rows)


@pytest.mark.parametrize(("method", "symmetric"), CASES)
def test_a_large_batch_is_fed_in_pieces_with_the_same_ranges(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: str, symmetric: bool
) -> None:
    """Batches of 20 rows reach the calibrator as pieces of at most CALIBRATE_ROWS (its session holds one call's
    activations), with the ranges of all the rows in one call."""
    rows: list[int] = []
    for cls in (MinMaxCalibrater, HistogramCalibrater):
        original = cls.collect_data

        def counted(self: Any, reader: ArrayReader, original: Any = original) -> None:
            rows.extend(len(b) for b in reader.batches)
            original(self, reader)

        monkeypatch.setattr(cls, "collect_data", counted)
    model, data = saved(tmp_path), [b * (i + 1) for i, b in enumerate(batches(n=2, size=20, seed=5))]
    got = calibrate(model, data, "input", method, cache_dir=None, symmetric=symmetric).tensors.data
    assert rows and max(rows) == 8 and sum(rows) % 40 == 0  # 8 + 8 + 4 per batch, every pass
    want = all_at_once(model, data, method, symmetric, tmp_path)
    for name, td in want.items():
        np.testing.assert_allclose(np.asarray(got[name].range_value, dtype=np.float64), td.range_value, rtol=1e-6)
