"""TensorRT 10's weakly typed path: precision chosen by builder flags, with sensitive layers pinned to FP32.

Used only when the library still has the FP16/INT8 flags and the graph itself is FP32. TensorRT 11 and
TensorRT-RTX removed this (strongly typed only); there the precision stage's graph decides.
Written against TensorRT 10's documented Python API; not runnable here (no TensorRT 10 wheel on this machine).
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import ModuleType
from typing import Any

from kiln.core.errors import BuildError
from kiln.stages.engines.tensorrt.config import TensorRTConfig

log = logging.getLogger("kiln.build")


def configure_weak_typing(
    trt: ModuleType, network: Any, config: Any, precision: str, cfg: TensorRTConfig
) -> dict[str, Any]:
    if precision == "fp32":
        return {"flags": []}
    flags = ["FP16"] if precision == "fp16" else ["FP16", "INT8"]
    for flag in flags:
        config.set_flag(getattr(trt.BuilderFlag, flag))
    pinned = _pin_fp32(trt, network, config, cfg.fp32_op_types)
    out: dict[str, Any] = {"flags": flags, "fp32_layers": pinned}
    if precision == "int8":
        out["calibration_cache"] = _attach_calibrator(trt, config, cfg)
    return out


def _pin_fp32(trt: ModuleType, network: Any, config: Any, patterns: list[str]) -> list[str]:
    """Keep LayerNorm/Softmax/reductions in FP32: their FP16 overflow is what breaks accuracy."""
    pinned = []
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        kind = str(layer.type).split(".")[-1]
        if any(p.lower() in kind.lower() or p.lower() in layer.name.lower() for p in patterns):
            layer.precision = trt.float32
            for j in range(layer.num_outputs):
                layer.set_output_type(j, trt.float32)
            pinned.append(layer.name)
    flag = next(
        (f for f in ("OBEY_PRECISION_CONSTRAINTS", "PREFER_PRECISION_CONSTRAINTS") if hasattr(trt.BuilderFlag, f)), None
    )
    if flag and pinned:
        config.set_flag(getattr(trt.BuilderFlag, flag))
    return pinned


def _attach_calibrator(trt: ModuleType, config: Any, cfg: TensorRTConfig) -> str:
    if not cfg.calibration_cache or not Path(cfg.calibration_cache).is_file():
        raise BuildError(
            "INT8 from an FP32 graph with TensorRT 10 needs a calibration cache "
            f"(build.tensorrt.calibration_cache = {cfg.calibration_cache!r})",
            hint="run calibration to write one, or hand TensorRT the precision stage's Q/DQ graph",
        )
    config.int8_calibrator = cache_calibrator(trt, Path(cfg.calibration_cache))
    return cfg.calibration_cache


def cache_calibrator(trt: ModuleType, cache: Path) -> Any:
    """An ``IInt8EntropyCalibrator2`` that serves a finished calibration cache and never asks for data."""

    class _CacheCalibrator(trt.IInt8EntropyCalibrator2):
        def __init__(self) -> None:
            trt.IInt8EntropyCalibrator2.__init__(self)

        def get_batch_size(self) -> int:
            return 1

        def get_batch(self, names: list[str]) -> None:
            return None  # no data: TensorRT then relies on read_calibration_cache

        def read_calibration_cache(self) -> bytes:
            return cache.read_bytes()

        def write_calibration_cache(self, data: Any) -> None:
            log.debug("TensorRT offered a calibration cache of %d bytes; the file is kept as is", len(data))

    return _CacheCalibrator()
