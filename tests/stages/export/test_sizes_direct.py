"""``kiln export -o`` checks its dynamic axes at sizes it makes itself (half the example's): a model that cannot
take that size is checked at the smallest it takes instead, or at the example's alone, said in the log; a size
``signature.shapes`` lists is refused with a fix that speaks of the example, not of data or later stages. Outputs
nowhere finite on the example itself, and inputs the model rejects, name the random ``--input-shape`` values as the
likely cause."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from kiln.cli import main
from kiln.core.data import DatasetSplits
from kiln.core.errors import ModelError
from kiln.pipeline.config import load_config
from kiln.pipeline.runner import settings_for
from kiln.pipeline.stage_list import stage_named
from kiln.stages.export.stage import export_direct
from tests.core.test_ownership import one_error

HERE = "tests.stages.export.test_sizes_direct"
SEQ = "signature.dynamic_axes={x: {1: seq}}"


class Kernel7(nn.Module):
    """A convolution over time of kernel 7 without padding: it takes 7 steps and more."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 3, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x.transpose(1, 2)).mean(2)


class Kernel7Loop(Kernel7):
    """The same convolution, then a Python loop over its steps, which the exporter unrolls to the example's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x.transpose(1, 2))
        acc = torch.zeros_like(h[:, :, 0])
        for t in range(h.shape[2]):
            acc = 0.5 * acc + h[:, :, t]
        return acc


class PositionTable(nn.Module):
    """A position table of 16 rows added whole: it takes 16 steps only."""

    def __init__(self) -> None:
        super().__init__()
        self.pos, self.head = nn.Parameter(torch.randn(1, 16, 4)), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x + self.pos).mean(1)


class LogOfInputs(nn.Module):
    """The log of its inputs: NaN on standard normal values wherever one is negative, in every output row."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.log(x)).sum(1)


class Packed(nn.Module):
    """A GRU over each row's real steps (pack_padded_sequence): every count must be at least 1. Named ``counts``, not
    like lengths, which direct export fills with the whole length."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.gru = nn.Embedding(4, 8), nn.GRU(8, 8, batch_first=True)

    def forward(self, ids: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        packed = nn.utils.rnn.pack_padded_sequence(self.emb(ids), counts, batch_first=True, enforce_sorted=False)
        return self.gru(packed)[1][-1]


def kernel7() -> nn.Module:
    return Kernel7()


def kernel7_loop() -> nn.Module:
    return Kernel7Loop()


def position_table() -> nn.Module:
    return PositionTable()


def log_of_inputs() -> nn.Module:
    return LogOfInputs()


def packed() -> nn.Module:
    return Packed()


def negative() -> DatasetSplits:
    """Inputs below 0 only: their log is NaN everywhere."""
    x = -torch.rand(16, 8, 4) - 0.1
    return DatasetSplits(x[:8], None, x[8:], None)


def _export(factory: str, out: Path, *args: str):
    """``kiln export -v --model HERE:factory ... -o out``: ``args`` are further options (``--input-shape``,
    ``--set``)."""
    return CliRunner().invoke(main, ["export", "-v", "--model", f"{HERE}:{factory}", *args, "-o", str(out)])


def test_a_model_of_a_minimum_length_is_checked_at_the_smallest_length_it_takes(tmp_path: Path) -> None:
    """Half the example's 10 steps is too short for a kernel of 7: the axis is checked at 7, the smallest length
    it takes, which a correct graph passes and one that unrolled a loop fails."""
    out = tmp_path / "m.onnx"
    result = _export("kernel7", out, "--input-shape", "x=10,4", "--set", SEQ)
    assert result.exit_code == 0 and out.exists(), result.output
    assert "the smallest size from 5 the model takes is 7" in result.output
    assert "checked at seq=7 in place of 5" in result.output
    looped = _export("kernel7_loop", tmp_path / "l.onnx", "--input-shape", "x=10,4", "--set", SEQ)
    one_error(looped, "does not compute the model at seq=7", "Python loop")


def test_a_model_that_takes_the_example_length_alone_is_checked_there_and_says_so(tmp_path: Path) -> None:
    """A position table takes no length below the example's: nothing else can be checked, which the log says; the
    graph, right wherever PyTorch runs, is written."""
    out = tmp_path / "m.onnx"
    result = _export("position_table", out, "--input-shape", "x=16,4", "--set", SEQ)
    assert result.exit_code == 0 and out.exists(), result.output
    assert "the model takes no size from 8 up to the example's, 16" in result.output
    assert "checked at seq=16 alone" in result.output


def test_a_listed_size_the_model_does_not_take_is_refused_in_the_examples_words(tmp_path: Path) -> None:
    out = tmp_path / "m.onnx"
    result = _export(
        "position_table", out, "--input-shape", "x=16,4", "--set", SEQ, "--set", "signature.shapes={seq: [16, 24]}"
    )
    one_error(
        result,
        "the model fails at seq=24, a size the export checks",
        "the model fixes axis 1 of 'x' (seq): it runs at the example's 16 alone there",
        "fix: remove the axis from signature.dynamic_axes",
    )
    assert "later stages" not in result.output and "data's" not in result.output
    assert "{seq: [16]}" not in result.output
    assert not out.exists()


def test_outputs_nowhere_finite_on_random_inputs_ask_for_real_ones(tmp_path: Path) -> None:
    """No size is compared where every output value is NaN, the example's own included: on --input-shape's random
    values the fix asks for real inputs."""
    out = tmp_path / "m.onnx"
    result = _export("log_of_inputs", out, "--input-shape", "x=16,4")
    one_error(result, "NaN or infinite at every value on random inputs", "random normal values", "data.name")
    assert not out.exists()


def test_outputs_nowhere_finite_on_the_configured_data_are_refused(tmp_path: Path) -> None:
    cfg = load_config(None, {"model.name": f"{HERE}:log_of_inputs", "data.name": f"{HERE}:negative"})
    with pytest.raises(ModelError, match="at every value on the first rows of the configured data") as err:
        export_direct(settings_for(stage_named("export"), cfg), None, (), tmp_path / "m.onnx")
    assert "check the data function's values" in (err.value.hint or "")
    assert not (tmp_path / "m.onnx").exists()


def test_random_values_a_model_rejects_are_named_as_what_it_may_reject(tmp_path: Path) -> None:
    """Random counts of 0 or 1 are shapes right and values wrong: the fix says so and asks for real inputs."""
    shapes = ("--input-shape", "ids=20:int64", "--input-shape", "counts=():int64")
    result = _export("packed", tmp_path / "m.onnx", *shapes)
    one_error(result, "rejects the inputs --input-shape gives", "random values", "data.name")
