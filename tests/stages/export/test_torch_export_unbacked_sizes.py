"""Sizes computed from the inputs' values (nonzero inside a torch.cond branch) that the dynamo exporter cannot
carry out of the branch: the failure says so and how to compute the dense form, its message cut between items.
torch raises this only for models whose export takes about a minute (a routed mixture of experts in a cond), so
the exporter here raises torch's words."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from kiln.stages.export.torch_export import ExportFailed, export_onnx

# torch's words for a nonzero in a torch.cond branch of a mixture-of-experts model, as its ONNX translation said them
_PENDING = "Pending unbacked symbols {u53, u52} not in returned outputs [" + ", ".join(
    ["FakeTensor(..., size=(s31, s46, 32), requires_grad=True)"] * 12
)


def _raises_torchs_words(model: nn.Module, args: Any, path: str, **kw: Any) -> None:
    if kw["dynamo"]:
        raise RuntimeError(_PENDING + "]\n\nWhile executing cond")
    raise RuntimeError("Detected that you are using FX to torch.jit.trace a dynamo-optimized function.")


def test_a_size_from_the_values_in_a_cond_branch_gets_the_dense_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.onnx, "export", _raises_torchs_words)
    with pytest.raises(ExportFailed) as err:
        export_onnx(nn.Linear(4, 2).eval(), torch.randn(3, 4), tmp_path / "m.onnx")
    hint = err.value.hint or ""
    assert "computes a size from its inputs' values" in hint and "dense form" in hint
    assert "cannot express" not in hint
    assert "requires_grad=True) ... (in " in err.value.message
    assert "size=, " not in err.value.message
