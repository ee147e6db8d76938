"""The fix ``kiln export -o`` gives where the model rejects --input-shape's inputs because of their names: a
required parameter of forward none gives, or a name forward has no parameter of; and a dtype it does not take."""

from __future__ import annotations

from pathlib import Path

import torch
from click.testing import CliRunner

from kiln.cli import main
from tests.core.test_ownership import one_error

HERE = "tests.stages.export.test_input_specs_names"


class _Two(torch.nn.Module):
    def forward(self, sample: torch.Tensor, text: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return (sample + text.mean(-1, keepdim=True)) * scale


def two() -> torch.nn.Module:
    return _Two()


def _export(tmp_path: Path, *shapes: str):
    flags = [a for s in shapes for a in ("--input-shape", s)]
    return CliRunner().invoke(main, ["export", "--model", f"{HERE}:two", *flags, "-o", str(tmp_path / "m.onnx")])


def test_a_missing_required_input_is_named(tmp_path: Path) -> None:
    result = _export(tmp_path, "sample=4")
    one_error(result, "missing 1 required positional argument: 'text'", "fix: add --input-shape text=DIMS")
    assert "random values" not in result.output


def test_an_input_forward_has_no_parameter_of_is_named_with_those_it_takes(tmp_path: Path) -> None:
    result = _export(tmp_path, "sample=4", "txt=4")
    one_error(
        result, "'txt' is not a parameter of _Two.forward; it takes sample, text, scale", "add --input-shape text="
    )
    assert "random values" not in result.output


def test_an_unnamed_shape_of_a_model_with_several_inputs_asks_to_name_each(tmp_path: Path) -> None:
    result = _export(tmp_path, "4")
    one_error(result, "fix: name each input: --input-shape sample=DIMS --input-shape text=DIMS")


def test_the_inputs_forward_takes_pass_the_names_check(tmp_path: Path) -> None:
    assert _export(tmp_path, "sample=4", "text=4").exit_code == 0


def test_an_unknown_dtype_lists_those_taken(tmp_path: Path) -> None:
    result = _export(tmp_path, "sample=4", "text=():foo")
    one_error(result, "'foo' is not a dtype it takes", "give one of float32, float16", "int64", "bool")
