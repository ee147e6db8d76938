"""FP16 needs no calibration scales: calibration data that gives no usable ranges fails INT8 alone."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from kiln.calibration.config import CalibrationConfig
from kiln.core.progress import SilentProgress
from kiln.stages.precision.config import PrecisionConfig
from kiln.stages.precision.stage import build_variants
from kiln.stages.precision.variants import Source
from tests.calibration.calib_graphs import batches, conv_model


def test_calibration_data_without_ranges_fails_int8_not_fp16(tmp_path: Path) -> None:
    """All-zero calibration batches (an input whose range is 0) cannot give INT8 scales: INT8 fails with that
    reason, while FP16, whose range check is the only use it makes of them, is made without the check and says so."""
    zeros = [np.zeros_like(b) for b in batches()]
    src = Source.prepare(conv_model(), tmp_path / "fp32" / "model.onnx", zeros, tmp_path / "cache")
    x_val = np.random.default_rng(1).random((64, 1, 8, 8), dtype=np.float32)
    variants, failed = build_variants(
        src,
        tmp_path,
        ["fp32", "fp16", "int8"],
        PrecisionConfig(),
        CalibrationConfig(),
        x_val,
        SilentProgress(),
        logging.getLogger("test"),
    )
    assert set(failed) == {"int8"} and "is 0 in every sample" in failed["int8"].message
    assert set(variants) == {"fp32", "fp16"} and (tmp_path / variants["fp16"]["path"]).is_file()
    assert variants["fp16"]["range_check"].startswith("skipped: calibration input 'input' is 0 in every sample")
