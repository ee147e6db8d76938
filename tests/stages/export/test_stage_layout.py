"""The export refuses a model whose forward replaces its own submodules (transformers' BigBird ``block_sparse``
swapping to full attention on its first call at a short length): every check would otherwise compare the graph with
the changed model, and a package pass that computes another function than the user's model."""

from __future__ import annotations

from pathlib import Path

import pytest

SWITCHER = """
import torch
from torch import nn

from kiln import DatasetSplits


class Switcher(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        if isinstance(self.attn, nn.Linear):
            self.attn = nn.Identity()
        return self.head(self.attn(x))


def build():
    return Switcher()


def load():
    x = torch.rand(64, 6, generator=torch.Generator().manual_seed(0))
    y = (x[:, 0] * 3).long().clamp(max=2)
    return DatasetSplits(x[:48], y[:48], x[48:], y[48:], num_classes=3)
"""


def test_a_model_that_replaces_a_submodule_when_run_is_one_error_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.pipeline.test_faults import invoke

    (tmp_path / "switcher.py").write_text(SWITCHER)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("model: {name: switcher:build}\ndata: {name: switcher:load}\ntrain: {enabled: false}\n")
    out = invoke("run", str(cfg), "-w", str(tmp_path / "wd"), "--until", "export")
    assert out.exit_code == 2, out.output
    assert "attn: Linear -> Identity" in out.output and "attention_type: original_full" in out.output
    assert "Traceback" not in out.output
