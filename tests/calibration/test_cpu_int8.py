"""calibration.reduce_range: which CPUs saturate, and that 7-bit weights are what the graphs then hold."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from calib_graphs import batches, saved
from kiln.calibration.config import CalibrationConfig
from kiln.calibration.cpu_int8 import reduce_range, saturates, this_cpu_saturates
from kiln.calibration.quantize import quantize_int8
from kiln.calibration.ranges import calibrate
from onnx import numpy_helper

SKYLAKE_SP = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 avx512f avx512bw avx512vl\n"
ICE_LAKE = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 avx512f avx512_vnni\n"
ALDER_LAKE = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 avx_vnni\n"


@pytest.mark.parametrize("machine, cpuinfo, want", [
    ("x86_64", SKYLAKE_SP, True), ("x86_64", ICE_LAKE, False), ("x86_64", ALDER_LAKE, False),
    ("AMD64", None, True),  # Windows: no /proc/cpuinfo, the safe side
    ("x86_64", "processor\t: 0\n", True), ("aarch64", None, False), ("arm64", SKYLAKE_SP, False)])
def test_only_x86_cpus_without_vnni_saturate(machine: str, cpuinfo: str | None, want: bool) -> None:
    assert saturates(machine, cpuinfo) is want


def test_the_setting_resolves_against_this_cpu() -> None:
    assert reduce_range("on") and not reduce_range("off")
    assert reduce_range("auto") is this_cpu_saturates()
    assert CalibrationConfig().reduce_range == "auto"


@pytest.mark.parametrize("setting, limit", [("on", 64), ("off", 127)])
def test_reduced_weights_fit_seven_bits(tmp_path: Path, setting: str, limit: int) -> None:
    path = saved(tmp_path)
    ranges = calibrate(path, batches(), "input", "minmax", cache_dir=tmp_path / "cache")
    info = quantize_int8(path, tmp_path / "int8.onnx", ranges, CalibrationConfig(reduce_range=setting))
    assert info["reduce_range"] is (setting == "on")
    model = onnx.load(str(tmp_path / "int8.onnx"))
    weights = [numpy_helper.to_array(i) for i in model.graph.initializer if i.data_type == onnx.TensorProto.INT8
               and len(i.dims) >= 2]
    assert weights and max(int(np.abs(w.astype(np.int32)).max()) for w in weights) == limit


@pytest.mark.parametrize("setting", ["on", "off"])
def test_the_precision_stage_cache_key_holds_the_resolved_setting(setting: str) -> None:
    """auto resolves per machine: a workdir quantized on a CPU with VNNI is not reused as it is on one without."""
    from kiln.config import config_from_dict
    from kiln.stages.precision.stage import STAGE

    from tests.conftest import tiny_config_dict

    cfg = config_from_dict(tiny_config_dict(**{"calibration.reduce_range": setting}))
    assert STAGE.env(cfg)["int8_reduce_range"] is (setting == "on")
