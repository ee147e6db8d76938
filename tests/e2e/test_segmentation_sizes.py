"""A segmentation model (``{'out': [N, 3, H, W]}``, a class per pixel ``[N, H, W]``) validated at sizes that leave
out the data's own: accuracy is measured at the data's sizes where the engines are built for them, and its gate
applies; where they are not, the log and the report say that accuracy was not measured and its gate not applied."""

from __future__ import annotations

import json
import logging
import textwrap
from pathlib import Path

import pytest

from kiln.pipeline.api import run_pipeline
from kiln.pipeline.config import config_from_dict
from tests.conftest import tiny_config_dict

SEG_MODULE = """
import torch
from torch import nn
import torch.nn.functional as F
from kiln import DatasetSplits


class Segmenter(nn.Module):
    def __init__(self, num_classes=3):
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1), nn.ReLU(), nn.Conv2d(8, 16, 3, 2, 1), nn.ReLU())
        self.cls = nn.Conv2d(16, num_classes, 1)

    def forward(self, x):
        out = F.interpolate(self.cls(self.backbone(x)), size=x.shape[-2:], mode="bilinear", align_corners=False)
        return {"out": out}


def build():
    torch.manual_seed(0)
    return Segmenter()


def load(size=64):
    g = torch.Generator().manual_seed(0)
    x = torch.rand(size, 3, 32, 32, generator=g)
    y = (x[:, 0] * 3).long().clamp(max=2)
    s = size * 3 // 4
    return DatasetSplits(x[:s], y[:s], x[s:], y[s:], num_classes=3)
"""


def _run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shapes: dict[str, list[int]]) -> tuple[dict, str]:
    (tmp_path / "seg_user.py").write_text(textwrap.dedent(SEG_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = tiny_config_dict(
        **{
            "model": {"name": "seg_user:build"},
            "data.name": "seg_user:load",
            "train": {"epochs": 1, "batch_size": 16},
            "precision.variants": ["fp32", "int8"],
            "signature.dynamic_axes": {"input": {2: "height", 3: "width"}},
            "signature.shapes": shapes,
        }
    )
    result, _ = run_pipeline(config_from_dict(cfg), tmp_path / "wd")
    assert result.ok, result.error
    validation = json.loads((tmp_path / "wd" / "validate" / "validation.json").read_text())
    return validation, (tmp_path / "wd" / "report.md").read_text()


def test_pixel_accuracy_is_measured_at_the_datas_sizes_within_the_built_range(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sizes 24..40 by 24..48 on 32x32 data: validated at 32x32 too, where the reference's and every engine's
    accuracy are measured and ``max_accuracy_drop`` holds. Before: accuracy None throughout, the gate never
    applied, and the report claimed accuracy on 'out'."""
    v, report = _run(tmp_path, monkeypatch, {"height": [24, 40], "width": [24, 48]})
    assert v["passed"] and v["baseline"]["accuracy"] is not None and v["baseline"]["accuracy_note"] is None
    assert {"height": 32, "width": 32} in v["baseline"]["shapes"] and v["baseline"][
        "labelled_positions"
    ] == 16 * 32 * 32
    assert all(e["accuracy"] is not None and "max_accuracy_drop" in e["gates"] for e in v["engines"])
    assert "top-1 agreement and accuracy on 'out', counted over the 16,384 labelled positions" in report


def test_pixel_accuracy_outside_the_built_range_is_said_not_gated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Sizes 40..64 by 40..48 on 32x32 data: the engines are not built for 32x32, so accuracy is not measured, and
    the log and report say so instead of passing with accuracy '-' and no word."""
    with caplog.at_level(logging.WARNING, logger="kiln"):
        v, report = _run(tmp_path, monkeypatch, {"height": [40, 64], "width": [40, 48]})
    assert v["baseline"]["accuracy"] is None and v["baseline"]["labelled_positions"] == 0
    assert v["baseline"]["accuracy_note"].startswith("the labels per position fit no validated size")
    assert "task accuracy is not measured and max_accuracy_drop is not applied" in caplog.text
    assert "accuracy on 'out'" not in report and "task accuracy not measured, and `max_accuracy_drop`" in report
