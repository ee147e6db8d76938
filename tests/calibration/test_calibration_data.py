"""Calibration data from the run's dataset or a user reader; config validation; the TensorRT table."""

from __future__ import annotations

import struct
import textwrap
from pathlib import Path

import numpy as np
import pytest

from kiln.calibration.config import CalibrationConfig
from kiln.calibration.data import calibration_batches, hash_batches
from kiln.calibration.ranges import calibrate
from kiln.calibration.trt_table import read_trt_table, write_trt_table
from kiln.core.errors import ConfigError
from kiln.models.datasets import synthetic
from kiln.pipeline.config import config_from_dict
from tests.calibration.calib_graphs import batches, saved


def test_dataset_batches_fixed_count_deterministic_and_like_validation() -> None:
    data = synthetic(shape=(1, 8, 8), size=400)
    cfg = CalibrationConfig(num_batches=3, batch_size=16)
    a, b = calibration_batches(data, cfg), calibration_batches(data, cfg)
    assert len(a) == 3 and all(x.shape == (16, 1, 8, 8) for x in a)
    assert a[0].dtype == data.val_x.numpy().dtype
    assert hash_batches(a) == hash_batches(b)
    assert hash_batches(a) != hash_batches(calibration_batches(data, cfg, seed=1))


def test_user_reader_by_import_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_calib.py").write_text(
        textwrap.dedent("""
        import numpy as np
        def reader(scale=1.0):
            rng = np.random.default_rng(0)
            while True:  # endless: Kiln takes num_batches
                yield {"input": (rng.random((4, 1, 8, 8)) * scale)}
        def wrong_shape():
            return [np.zeros((4, 3, 8, 8), np.float32)]
        """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    data = synthetic(shape=(1, 8, 8), size=64)
    got = calibration_batches(
        data, CalibrationConfig(reader="my_calib:reader", reader_params={"scale": 2.0}, num_batches=5)
    )
    assert len(got) == 5 and got[0].dtype == np.float32 and got[0].max() > 1.0
    with pytest.raises(ConfigError, match="model takes"):
        calibration_batches(data, CalibrationConfig(reader="my_calib:wrong_shape"))
    with pytest.raises(ConfigError, match="rejected its params"):
        calibration_batches(data, CalibrationConfig(reader="my_calib:wrong_shape", reader_params={"x": 1}))
    with pytest.raises(ConfigError):
        calibration_batches(data, CalibrationConfig(reader="no_such_module_xyz:reader"))


def test_a_reader_batch_that_cannot_calibrate_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """NaN, no rows or values that are no numbers would give NaN ranges, or none, and INT8 would be dropped quietly:
    each is one error naming the batch; tensors that need grad or are bfloat16 are read as numbers."""
    (tmp_path / "odd_calib.py").write_text(
        textwrap.dedent("""
        import numpy as np, torch
        def nan():
            x = np.ones((4, 1, 8, 8), np.float32); x[0, 0, 0, 0] = np.nan
            return [x]
        def empty():
            return [np.zeros((0, 1, 8, 8), np.float32)]
        def text():
            return [np.full((4, 1, 8, 8), "a")]
        def grad_and_bf16():
            return [torch.ones(4, 1, 8, 8, requires_grad=True), torch.ones(4, 1, 8, 8, dtype=torch.bfloat16)]
        """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    data = synthetic(shape=(1, 8, 8), size=64)
    for reader, says in (("nan", "1 NaN or infinite values"), ("empty", "has no rows"), ("text", "not real numbers")):
        with pytest.raises(ConfigError, match=f"calibration batch 0 of reader 'odd_calib:{reader}' .*{says}"):
            calibration_batches(data, CalibrationConfig(reader=f"odd_calib:{reader}"))
    got = calibration_batches(data, CalibrationConfig(reader="odd_calib:grad_and_bf16"))
    assert [b.dtype for b in got] == [np.float32, np.float32] and all((b == 1).all() for b in got)


def test_unknown_calibration_key_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown key 'calibration.methd'"):
        config_from_dict({"calibration": {"methd": "entropy"}})
    with pytest.raises(ConfigError, match="calibration.method"):
        config_from_dict({"calibration": {"method": "kl"}})


def test_trt_calibration_table_format(tmp_path: Path) -> None:
    ranges = calibrate(saved(tmp_path), batches(), "input", "minmax", cache_dir=None)
    amax = ranges.amax()
    table = write_trt_table(amax, tmp_path / "calibration.cache")
    lines = table.read_text().splitlines()
    assert lines[0] == "TRT-8601-EntropyCalibration2"
    name, _, hexval = lines[1].rpartition(": ")
    assert len(hexval) == 8 and int(hexval, 16) >= 0
    # big-endian IEEE float32 of amax / 127, exactly what IInt8Calibrator::readCalibrationCache expects
    assert struct.unpack(">f", bytes.fromhex(hexval))[0] == pytest.approx(amax[name] / 127, rel=1e-6)
    header, scales = read_trt_table(table)
    assert set(scales) == set(amax) and {"input", "c", "r", "logits"} <= set(scales)
