"""Calibration ranges are cached on (model content, data, method, settings) and reused without recalibrating."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

from kiln.calibration.config import CalibrationConfig
from kiln.calibration.quantize import quantize_int8
from kiln.calibration.ranges import STATS, calibrate
from tests.calibration.calib_graphs import batches, conv_model, saved


def test_second_call_reuses_the_cache(tmp_path: Path) -> None:
    path, cache = saved(tmp_path), tmp_path / "cache"
    before = STATS["calibrations"]
    first = calibrate(path, batches(), "input", "percentile", cache_dir=cache)
    assert not first.cache_hit and STATS["calibrations"] == before + 1
    assert first.path.parent == cache / "calibration" and first.path.is_file()
    mtime = first.path.stat().st_mtime_ns
    second = calibrate(path, batches(), "input", "percentile", cache_dir=cache)
    assert second.cache_hit and second.path == first.path
    assert STATS["calibrations"] == before + 1  # no calibrator ran
    assert first.path.stat().st_mtime_ns == mtime  # and nothing was rewritten
    assert second.amax() == first.amax()


def test_quantize_from_cache_needs_no_data(tmp_path: Path) -> None:
    """quantize_static gets no data reader at all: the Q/DQ graph is made from the cached ranges alone."""
    path = saved(tmp_path)
    ranges = calibrate(path, batches(), "input", "minmax", cache_dir=tmp_path / "cache")
    before = STATS["calibrations"]
    info = quantize_int8(path, tmp_path / "a.onnx", ranges, CalibrationConfig())
    quantize_int8(path, tmp_path / "b.onnx", ranges, CalibrationConfig(exclude_nodes=["head"]))
    assert STATS["calibrations"] == before and info["qdq_nodes"]["QuantizeLinear"] > 0
    assert (tmp_path / "a.onnx").read_bytes() != (tmp_path / "b.onnx").read_bytes()


def test_key_changes_with_model_data_method_and_settings(tmp_path: Path) -> None:
    path, cache = saved(tmp_path), tmp_path / "cache"
    base = calibrate(path, batches(), "input", "percentile", cache_dir=cache)
    other_data = calibrate(path, batches(seed=1), "input", "percentile", cache_dir=cache)
    other_method = calibrate(path, batches(), "input", "minmax", cache_dir=cache)
    other_setting = calibrate(path, batches(), "input", "percentile", cache_dir=cache, percentile=99.9)
    model = conv_model()
    model.graph.initializer[0].float_data[:] = []  # same structure, different weights
    model.graph.initializer[0].raw_data = np.ones((8, 1, 3, 3), np.float32).tobytes()
    onnx.save(model, tmp_path / "other.onnx")
    other_model = calibrate(tmp_path / "other.onnx", batches(), "input", "percentile", cache_dir=cache)
    keys = {r.key for r in (base, other_data, other_method, other_setting, other_model)}
    assert len(keys) == 5 and not any(r.cache_hit for r in (other_data, other_method, other_setting, other_model))


def test_unreadable_cache_file_is_recomputed(tmp_path: Path) -> None:
    path, cache = saved(tmp_path), tmp_path / "cache"
    first = calibrate(path, batches(), "input", "minmax", cache_dir=cache)
    first.path.write_text("{not json")
    again = calibrate(path, batches(), "input", "minmax", cache_dir=cache)
    assert not again.cache_hit and again.amax() == first.amax()


def test_a_cache_file_damaged_but_still_parsing_is_recomputed(tmp_path: Path) -> None:
    """A changed range that still parses (one digit) would quantize with wrong scales: the checksum written with the
    file catches it, and the ranges are computed again."""
    path, cache = saved(tmp_path), tmp_path / "cache"
    first = calibrate(path, batches(), "input", "minmax", cache_dir=cache)
    text = first.path.read_text()
    digit = next(i for i, c in enumerate(text) if c.isdigit() and c != "9")
    first.path.write_text(text[:digit] + "9" + text[digit + 1 :])
    again = calibrate(path, batches(), "input", "minmax", cache_dir=cache)
    assert not again.cache_hit and again.amax() == first.amax()
    assert calibrate(path, batches(), "input", "minmax", cache_dir=cache).cache_hit  # rewritten whole


def test_methods_give_their_own_ranges(tmp_path: Path) -> None:
    """Entropy clips long tails below the observed maximum, so its ranges differ from minmax's (with ONNX Runtime's
    default 128 bins it had a single candidate threshold and silently equalled minmax everywhere)."""
    path = saved(tmp_path)
    data = [
        b * np.where(np.random.default_rng(i).random(b.shape) < 0.01, 20.0, 1.0).astype(np.float32)
        for i, b in enumerate(batches(n=8))
    ]  # a few outliers: a long tail
    amax = {m: calibrate(path, data, "input", m, cache_dir=None).amax() for m in ("minmax", "entropy", "percentile")}
    assert amax["minmax"].keys() == amax["entropy"].keys()
    assert all(amax["entropy"][t] <= amax["minmax"][t] * (1 + 1e-6) for t in amax["minmax"])
    assert amax["entropy"]["input"] < 0.9 * amax["minmax"]["input"]  # the outliers are clipped
    assert amax["percentile"]["input"] < amax["minmax"]["input"]
