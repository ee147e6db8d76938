"""The ``export:`` config section: the exporter's settings (the axes that vary are the signature's)."""

from __future__ import annotations

from pydantic import Field

from kiln.core.sections import Section


class ExportConfig(Section):
    opset: int = Field(
        18, ge=13, le=23, description="the dynamo exporter needs >= 18; below 18 the TorchScript exporter alone is used"
    )
    dynamic_batch: bool = Field(True, description="false: a fixed-batch graph; direct `kiln export` only")
    parity_atol: float = Field(1e-4, gt=0, description="max abs error allowed between ONNX Runtime and PyTorch")
    parity_rtol: float = Field(
        1e-5,
        ge=0,
        description="and this share of the |value| an error is on, on top (float32 rounding grows with the values)",
    )
