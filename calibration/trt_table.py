"""The calibration table TensorRT 10's ``IInt8Calibrator`` reads (``readCalibrationCache``).

No library writes this text format without a GPU and TensorRT's own calibrator (ONNX Runtime's
``write_calibration_table`` writes a flatbuffer for its TensorRT EP instead), so it is written here from the
computed ranges: a header line naming the calibrator, then ``tensor: <float32 scale as big-endian hex>``
per tensor, scale = amax / 127 (symmetric INT8).
"""

from __future__ import annotations

import math
import struct
from pathlib import Path

from kiln.core.artifacts import write_text_atomic

HEADER = "TRT-{version}-EntropyCalibration2"


def scale_hex(scale: float) -> str:
    return struct.pack(">f", scale).hex()


def hex_scale(text: str) -> float:
    return struct.unpack(">f", bytes.fromhex(text))[0]


def write_trt_table(amax: dict[str, float], path: Path, trt_version: int = 8601) -> Path:
    """Write ``tensor: hex(scale)`` lines; tensors whose range is zero get the smallest normal scale, those whose
    range is not finite none (TensorRT keeps a tensor without a scale out of INT8)."""
    lines = [HEADER.format(version=trt_version)]
    for name in sorted(n for n, a in amax.items() if math.isfinite(a)):
        scale = max(amax[name] / 127.0, 1.1754944e-38)
        lines.append(f"{name}: {scale_hex(scale)}")
    write_text_atomic(path, "\n".join(lines) + "\n")
    return path


def read_trt_table(path: Path) -> tuple[str, dict[str, float]]:
    header, *rows = Path(path).read_text().splitlines()
    scales = {}
    for row in rows:
        name, _, hexval = row.rpartition(": ")
        scales[name] = hex_scale(hexval)
    return header, scales
