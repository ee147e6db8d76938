"""``kiln export --model`` of a factory that returns half-precision weights says so, as ``kiln run`` does, rather
than failing later in ONNX's shape inference or blaming --input-shape's values."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from kiln.cli import main
from tests.core.test_ownership import one_error

HERE = "tests.stages.export.test_input_specs_fp32"


def half() -> torch.nn.Module:
    return torch.nn.Linear(4, 2).half()


class _CastIn(torch.nn.Module):
    """A bf16 model that casts its float32 input: PyTorch runs it, ONNX's Conv takes no bfloat16."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 2, 3).to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x.to(torch.bfloat16)).float()


def bf16_wrapped() -> torch.nn.Module:
    return _CastIn()


@pytest.mark.parametrize(("factory", "dtype"), [("half", "float16"), ("bf16_wrapped", "bfloat16")])
def test_direct_export_of_half_weights_names_their_dtype(tmp_path: Path, factory: str, dtype: str) -> None:
    shape = "x=4" if factory == "half" else "x=1,6,6"
    args = ["export", "--model", f"{HERE}:{factory}", "--input-shape", shape, "-o", str(tmp_path / "m.onnx")]
    result = CliRunner().invoke(main, args)
    one_error(result, f"has {dtype} weights", "return the model in float32")
    assert "--input-shape fills" not in result.output and "shape inference" not in result.output
