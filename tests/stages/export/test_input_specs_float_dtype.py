"""The fix ``kiln export -o`` gives where --input-shape's float inputs are in another float dtype than the model's
weights (``:float16`` for float32 weights): the weights' dtype, as the pipeline's data path says it, not a word on
random values."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from kiln.cli import main
from tests.core.test_ownership import one_error

HERE = "tests.stages.export.test_input_specs_float_dtype"


class _Two(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.lin(x).sum(1) + ids[:, :1]


def linear() -> torch.nn.Module:
    return torch.nn.Linear(3, 2)


def two() -> torch.nn.Module:
    return _Two()


def _export(tmp_path: Path, factory: str, *shapes: str):
    flags = [a for s in shapes for a in ("--input-shape", s)]
    out = str(tmp_path / "m.onnx")
    return CliRunner().invoke(main, ["export", "--model", f"{HERE}:{factory}", *flags, "-o", out])


@pytest.mark.parametrize("dtype", ["float16", "float64"])
def test_an_unnamed_float_input_off_the_weights_dtype_is_told_float32(tmp_path: Path, dtype: str) -> None:
    result = _export(tmp_path, "linear", f"48,3:{dtype}")
    one_error(result, f"give 'input' {dtype} as float32, the dtype of the model's weights: --input-shape 48,3:float32")
    assert "random values" not in result.output


def test_a_named_input_is_told_by_name_and_others_are_left_alone(tmp_path: Path) -> None:
    result = _export(tmp_path, "two", "x=5,3:float16", "ids=4:int64")
    one_error(result, "give 'x' float16 as float32, the dtype of the model's weights: --input-shape x=5,3:float32")
    assert "ids=" not in result.output.split("fix:")[1]
