"""PyTorch runs at the size check's sizes before the export: a model that cannot take a size the later stages run
(an axis declared on one input but not on the input it is multiplied with) fails there, before any exporter's
attempt, and the outputs PyTorch gave there are not computed again by the check after the export."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from kiln.core.data import DatasetSplits
from kiln.core.errors import ModelError
from kiln.core.onnx_io import ort_session
from kiln.stages.export import sizes
from kiln.stages.export.sizes import check_validated_sizes, export_at_sizes


class Propagate(nn.Module):
    """``adj @ lin(x)``: the nodes axis of ``x`` must match the last axis of ``adj``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        return adj @ self.lin(x)


def _data() -> DatasetSplits:
    g = torch.Generator().manual_seed(0)
    x = {"x": torch.randn(12, 10, 4, generator=g), "adj": torch.rand(12, 10, 10, generator=g)}
    return DatasetSplits({k: v[:8] for k, v in x.items()}, None, {k: v[8:] for k, v in x.items()}, None)


def _no_exporter(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("an exporter ran")


def test_a_size_the_model_cannot_take_fails_before_any_exporter_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sizes, "export_with_fallback", _no_exporter)
    data, axes = _data(), {"x": {1: "nodes"}, "adj": {1: "nodes"}}  # adj's axis 2 left out
    example = {k: v[:2] for k, v in data.val_x.items()}
    with pytest.raises(ModelError, match="nodes=5"):
        export_at_sizes(Propagate().eval(), example, tmp_path / "m.onnx", 18, data, axes, {})


def test_the_size_check_reuses_what_pytorch_gave_before_the_export(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data, axes = _data(), {"x": {1: "nodes"}, "adj": {1: "nodes", 2: "nodes"}}
    model, path, example = Propagate().eval(), tmp_path / "m.onnx", {k: v[:2] for k, v in data.val_x.items()}
    calls: list[dict[str, int]] = []
    real = sizes.torch_at

    def counted(model: nn.Module, inputs: Any, point: dict[str, int], *args: Any, **kwargs: Any) -> Any:
        calls.append(dict(point))
        return real(model, inputs, point, *args, **kwargs)

    monkeypatch.setattr(sizes, "torch_at", counted)
    refs: dict = {}
    export_at_sizes(model, example, path, 17, data, axes, {}, refs)  # opset 17: the quick TorchScript exporter
    before = list(calls)
    check_validated_sizes(model, path, ort_session(path), data, ["x", "adj"], axes, {}, 1e-4, 1e-5, "", refs)
    assert before and len(refs) == len(before)
    assert calls == before  # no size run again by the check
