"""calibration.reduce_range: 7-bit weights when asked (or, with auto, on a CPU whose INT8 kernels saturate)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from kiln.calibration.config import CalibrationConfig
from kiln.calibration.quantize import quantize_int8, resolve_reduce_range
from kiln.calibration.ranges import calibrate
from kiln.core.cpu_int8 import this_cpu_saturates
from tests.calibration.calib_graphs import batches, saved


def test_off_by_default_and_auto_follows_this_cpu() -> None:
    assert CalibrationConfig().reduce_range == "off"  # Kiln's own sessions use exact kernels (kiln.core.cpu_int8)
    assert resolve_reduce_range("on") and not resolve_reduce_range("off")
    assert resolve_reduce_range("auto") is this_cpu_saturates()


@pytest.mark.parametrize("setting, limit", [("on", 64), ("off", 127)])
def test_reduced_weights_fit_seven_bits(tmp_path: Path, setting: str, limit: int) -> None:
    path = saved(tmp_path)
    ranges = calibrate(path, batches(), "input", "minmax", cache_dir=tmp_path / "cache")
    info = quantize_int8(path, tmp_path / "int8.onnx", ranges, CalibrationConfig(reduce_range=setting))
    assert info["reduce_range"] is (setting == "on")
    model = onnx.load(str(tmp_path / "int8.onnx"))
    weights = [
        numpy_helper.to_array(i)
        for i in model.graph.initializer
        if i.data_type == onnx.TensorProto.INT8 and len(i.dims) >= 2
    ]
    assert weights and max(int(np.abs(w.astype(np.int32)).max()) for w in weights) == limit


@pytest.mark.parametrize("setting", ["on", "off"])
def test_the_precision_stage_cache_key_holds_the_resolved_setting(setting: str) -> None:
    """auto resolves per machine: a workdir quantized on a CPU with VNNI is not reused as it is on one without."""
    from kiln.pipeline.config import config_from_dict
    from kiln.stages.precision.declaration import STAGE
    from tests.conftest import tiny_config_dict

    cfg = config_from_dict(tiny_config_dict(**{"calibration.reduce_range": setting}))
    assert STAGE.env(cfg)["int8_reduce_range"] is (setting == "on")
