"""Outputs that pick among equal scores (a detector's top-k peak indices) at the sizes the export checks: the equal
scores Kiln's own grown inputs made failed a right graph as one whose exporter fixed a size; a failure that remains
names ties as a possible cause. Where the graph is the TorchScript exporter's, the error names the dynamo failure
first, with the user's line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from torch import nn

from kiln.cli import main
from kiln.core.data import DatasetSplits
from kiln.core.errors import ModelError
from kiln.core.onnx_io import ort_session
from kiln.stages.export.sizes import check_validated_sizes
from kiln.stages.export.torch_export import export_with_fallback
from tests.core.test_ownership import one_error

HERE = "tests.stages.export.test_sizes_ties"
AXES = {"input": {2: "h", 3: "w"}}


class PeakDetector(nn.Module):
    """A CenterNet head: a sigmoid heatmap, its peaks (3x3 max-pool NMS) and the top ``k`` over H*W with their
    int64 indices. A blank image scores highest, so a region of zeros holds many equal peaks."""

    def __init__(self, k: int = 4) -> None:
        super().__init__()
        self.conv, self.k = nn.Conv2d(1, 1, 3, padding=1), k
        nn.init.constant_(self.conv.weight, -0.2)
        nn.init.constant_(self.conv.bias, 1.0)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        heat = torch.sigmoid(self.conv(x))
        peaks = heat * (F.max_pool2d(heat, 3, stride=1, padding=1) == heat).float()
        scores, inds = torch.topk(peaks.flatten(1), self.k)
        return {"scores": scores, "inds": inds}


def _checked(tmp_path: Path, model: nn.Module, x: torch.Tensor, axes: dict, shapes: dict) -> None:
    """The pipeline's export and its check of the sizes the later stages run, the dynamo failure passed on."""
    data, path = DatasetSplits(x[:8], None, x[8:], None), tmp_path / "m.onnx"
    _, dynamo = export_with_fallback(model.eval(), x[:2], path, dynamic_axes=axes)
    check_validated_sizes(model, path, ort_session(path), data, ["input"], axes, shapes, 1e-4, 1e-5, dynamo)


def test_a_detectors_top_k_indices_pass_where_kilns_grown_inputs_tied_its_peaks(tmp_path: Path) -> None:
    """8x8 images checked at 12 wide and high: the zeros Kiln padded them with gave equal peaks, which PyTorch's and
    ONNX Runtime's top-k order apart, and a right graph failed as "the exporter fixed a size"."""
    x = torch.rand(12, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    _checked(tmp_path, PeakDetector(), x, AXES, {"h": [8, 12], "w": [8, 12]})


class TokenPeaks(nn.Module):
    """The top 6 positions of a per-token score: token ids repeated to a longer length repeat their scores."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.topk(self.emb(x)[..., 0], 6).indices


def test_index_outputs_that_still_differ_name_ties_as_a_possible_cause(tmp_path: Path) -> None:
    """Token ids repeat exactly, so their scores tie at twice the length: the error and its fix say so, beside the
    fixed size."""
    g = torch.Generator().manual_seed(0)
    x = torch.stack([torch.randperm(50, generator=g)[:8] for _ in range(12)])  # 8 distinct tokens a row
    with pytest.raises(ModelError, match=r"at seq=16.*integer outputs \['logits'\] index scores that tie") as err:
        _checked(tmp_path, TokenPeaks(), x, {"input": {1: "seq"}}, {"seq": [8, 16]})
    assert "if ['logits'] are indices of tied scores, validate at sizes the data has" in (err.value.hint or "")


class RemainderAndTracedLength(nn.Module):
    """``argmax % length`` on a symbolic length, which the dynamo exporter's ONNX translation refuses; the
    TorchScript exporter then records ``torch.tensor([length])`` as the example's length."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.fc(x)[..., 0]
        pos = s.argmax(1) % x.shape[1]  # the line dynamo fails on
        return s.sum(1) / torch.tensor([x.shape[1]], dtype=torch.float32) + pos


def remainder() -> nn.Module:
    return RemainderAndTracedLength()


REMAINDER_AT = f"test_sizes_ties.py:{RemainderAndTracedLength.forward.__code__.co_firstlineno + 2}"


def test_a_fallback_graph_that_fails_the_size_check_names_the_dynamo_failure(tmp_path: Path) -> None:
    """The error named only the TorchScript graph's fixed size; what to fix is the code the dynamo exporter
    refused: its op and line."""
    args = ["export", "--model", f"{HERE}:remainder", "--input-shape", "input=8x4", "-o", str(tmp_path / "m.onnx")]
    result = CliRunner().invoke(main, [*args, "--set", "signature.dynamic_axes={input: {1: seq}}"])
    one_error(result, "does not compute the model at seq=4", "the dynamo exporter failed first", "SymbolicTensor")
    error, fix = (next(li for li in result.output.splitlines() if li.startswith(p)) for p in ("error:", "fix:"))
    assert f"aten.remainder.Scalar (in forward() at {REMAINDER_AT})" in error, error
    assert fix.startswith(f"fix: change the code the dynamo exporter failed on, in forward() at {REMAINDER_AT}"), fix


class PeakPhase(nn.Module):
    """The position of each row's peak score modulo its length: the TorchScript exporter (the dynamo one refuses the
    remainder on a symbolic length) records ``torch.tensor([length])`` as the example's. The score falls as the
    input rises."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 1)
        nn.init.constant_(self.fc.weight, -0.5)
        nn.init.constant_(self.fc.bias, 1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = self.fc(x)[..., 0].argmax(1) % x.shape[1]
        return pos % torch.tensor([x.shape[1]])


def test_a_fixed_length_is_found_where_copies_shifted_up_keep_the_peak_in_the_data(tmp_path: Path) -> None:
    """Grown inputs whose copies all shifted up kept this model's peak in the data's own copy, where the fixed length
    is right, and the graph passed; real rows at 16 with their peak at 11 then gave 3. Copies shifted down move the
    peak past the data's length."""
    x = torch.rand(12, 8, 4, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ModelError, match=r"at seq=16.*the exporter fixed a size that signature.dynamic_axes"):
        _checked(tmp_path, PeakPhase(), x, {"input": {1: "seq"}}, {"seq": [8, 16]})
