"""A forward that branches on a size (``if L % 4 != 0: pad``): the dynamo exporter keeps the side its example took,
so the graph is right at the sizes on that side only. The export records those sizes as the axis's steps (the
engines then refuse the others) with a warning naming the branch; one across the validated sizes is an error whose
fix is about the branch; a model that pads unconditionally records no steps."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from kiln import DatasetSplits
from kiln.core.errors import InputError, ModelError
from kiln.pipeline.api import RunResult, run_pipeline
from kiln.pipeline.config import config_from_dict
from kiln.stages.engines.registry import load_engine

CHANNELS, PATCH = 2, 4


class PadsWhenNotAMultiple(nn.Module):
    """Patches of 4 steps, after padding on the left (the first step repeated) where the length is not a multiple
    of 4: paper code's patching, whose ``if`` the exporter fixes."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Linear(PATCH, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, L, C]
        x = self.pad(x)
        patches = x.permute(0, 2, 1).unfold(-1, PATCH, PATCH)  # [B, C, N, P]
        return self.head(torch.relu(self.embed(patches)).mean((1, 2)))

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[1]
        if length % PATCH != 0:  # BRANCH
            x = torch.cat([x[:, :1].repeat(1, PATCH - length % PATCH, 1), x], dim=1)
        return x


class PadsAlways(PadsWhenNotAMultiple):
    """The same padding computed for every length: 0 steps where the length is a multiple of 4."""

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x[:, :1].repeat(1, (PATCH - x.shape[1] % PATCH) % PATCH, 1), x], dim=1)


BRANCH_AT = f"test_graph_steps.py:{PadsWhenNotAMultiple.pad.__code__.co_firstlineno + 2}"


def branchy() -> nn.Module:
    return PadsWhenNotAMultiple()


def padded() -> nn.Module:
    return PadsAlways()


def series(length: int) -> DatasetSplits:
    x = torch.randn(24, length, CHANNELS, generator=torch.Generator().manual_seed(0)).cumsum(1)
    return DatasetSplits(x[:16], None, x[16:], None)


def at_16() -> DatasetSplits:
    return series(16)


def at_15() -> DatasetSplits:
    return series(15)


def _run(
    tmp_path: Path,
    model: str,
    data: str,
    shapes: dict[str, list[int]],
    stop: str = "build",
    axes: dict[str, dict[int, str]] | None = None,
) -> RunResult:
    """The pipeline on ``model`` and ``data`` without training, FP32 on ONNX Runtime, through ``stop``."""
    axes = axes or {"input": {1: "seq"}}
    cfg = config_from_dict(
        {
            "model": {"name": f"{__name__}:{model}"},
            "data": {"name": f"{__name__}:{data}"},
            "train": {"enabled": False},
            "signature": {"batch_sizes": [1, 4], "dynamic_axes": axes, "shapes": shapes},
            "precision": {"variants": ["fp32"]},
            "build": {"backends": ["onnxruntime"]},
        }
    )
    result, _ = run_pipeline(cfg, tmp_path, stop=stop)
    return result


def _steps(tmp_path: Path) -> dict[str, list[int]]:
    """The axis steps the export stage recorded in its summary."""
    return json.loads((tmp_path / "export" / "manifest.json").read_text())["summary"]["axis_steps"]


def test_the_sizes_a_branch_on_the_size_leaves_right_are_recorded_and_the_engine_refuses_the_others(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Data at 16, validated at 8 and 16: every size both check is a multiple of 4, where the graph (no padding)
    is right; at 9-11 and 13-15 it drops the last steps. The graph's steps are recorded, said with the branch's
    line, and the engine refuses 13 as servers do, and answers 12 as PyTorch."""
    with caplog.at_level(logging.WARNING, logger="kiln.export"):
        result = _run(tmp_path, "branchy", "at_16", {"seq": [8, 16]})
    assert result.error is None, result.error
    assert _steps(tmp_path) == {"seq": [4, 0]}
    said = caplog.text
    assert "signature axis seq: the exported graph gives PyTorch's outputs only at seq in steps of 4" in said
    assert f"a branch on the size in pad() at tests/stages/export/{BRANCH_AT} (if length % PATCH != 0:" in said
    assert "fix: make the branch on the size unconditional" in said
    engine_dir = tmp_path / "build" / "onnxruntime-cpu-fp32"
    assert json.loads((engine_dir / "kiln-engine.json").read_text())["axis_steps"] == {"seq": [4, 0]}
    model = PadsWhenNotAMultiple().eval()
    model.load_state_dict(load_file(tmp_path / "train" / "model.safetensors"))
    x = at_16().val_x[:1, :12]
    with load_engine(engine_dir) as engine:
        with pytest.raises(InputError, match=r"seq\) is 13: .* only in steps of 4"):
            engine.infer({"input": np.zeros((1, 13, CHANNELS), np.float32)})
        (got,) = engine.infer({"input": x.numpy()}).values()
    assert np.allclose(got, model(x).detach().numpy(), atol=1e-5)


def test_data_on_the_other_side_of_the_branch_records_the_other_remainders(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Data at 15, validated at 7 and 15: the graph always pads, right off the multiples of 4 and wrong at 8 and 12;
    the branch is named from torch's guard on the remainder being unequal."""
    with caplog.at_level(logging.WARNING, logger="kiln.export"):
        result = _run(tmp_path, "branchy", "at_15", {}, stop="export")
    assert result.error is None, result.error
    assert _steps(tmp_path) == {"seq": [4, 1, 2, 3]}
    assert "at seq=8, where PyTorch runs, max abs error" in caplog.text and BRANCH_AT in caplog.text


def test_a_model_that_pads_unconditionally_records_no_steps(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kiln.export"):
        result = _run(tmp_path, "padded", "at_16", {"seq": [8, 16]}, stop="export")
    assert result.error is None, result.error
    assert _steps(tmp_path) == {}
    assert "exported graph gives PyTorch's outputs only" not in caplog.text


def test_a_branch_across_the_validated_sizes_is_refused_with_a_fix_for_the_branch(tmp_path: Path) -> None:
    """Validated at 10 and 16, on both sides of the branch: the size check's error names the ``if``, and its fix
    is to make the branch unconditional (or keep to one side), not the advice about Python ints and loops."""
    result = _run(tmp_path, "branchy", "at_16", {"seq": [10, 16]}, stop="export")
    assert isinstance(result.error, ModelError), result.error
    assert "does not compute the model at seq=10" in result.error.message and BRANCH_AT in result.error.message
    assert result.error.hint.startswith("make the branch on the size unconditional")
    assert "sizes on one side of the branch only" in result.error.hint and "Python loop" not in result.error.hint


def test_with_a_second_dynamic_axis_only_the_branched_one_records_steps(tmp_path: Path) -> None:
    """The channels vary too (the model averages over them): the step probe runs per axis, the other at its
    smallest, and records the branched axis's steps alone."""
    cfg = {"seq": [8, 16], "ch": [1, 3]}
    result = _run(tmp_path, "branchy", "at_16", cfg, stop="export", axes={"input": {1: "seq", 2: "ch"}})
    assert result.error is None, result.error
    assert _steps(tmp_path) == {"seq": [4, 0]}


def test_without_a_line_of_the_users_the_warning_names_no_made_up_one(caplog: pytest.LogCaptureFixture) -> None:
    """The branch may lie in a library's module (a patch embedding in site-packages): no line is quoted as if it were
    the user's, and the fix that needs no code edit, sizes on one side of the branch, is offered too."""
    from kiln.stages.export.size_steps import _warn_graph_steps

    with caplog.at_level(logging.WARNING, logger="kiln.export"):
        _warn_graph_steps("seq", [4, 0], (8, 16), {9: "max abs error 0.5"}, "")
    assert "branch on it most likely" in caplog.text and "in forward (if" not in caplog.text
    assert "or give signature.shapes sizes on one side of it only" in caplog.text
