"""One check for precision and validation: a variant the precision stage accepts is an engine validation accepts,
judged on the same held-out data, shapes, batch sizes and outputs with the same gates; a variant no fallback round
gets through those gates is not made, and says which nodes it tried."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from kiln.core.data import DatasetSplits
from kiln.pipeline.api import run_pipeline
from kiln.pipeline.config import config_from_dict


class TwoInputEncoder(nn.Module):
    """Token ids and a mask in, ``(hidden, logits)`` out: a model written here, exported by its user."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        self.mix = nn.Linear(32, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = torch.relu(self.mix(self.emb(ids))) * mask[..., None].float()
        return hidden, self.head(hidden.sum(1) / mask.sum(1, keepdim=True).clamp(min=1).float())


def tokens() -> DatasetSplits:
    g = np.random.default_rng(0)
    ids = torch.from_numpy(g.integers(1, 50, size=(192, 12)))
    lengths = torch.from_numpy(g.integers(3, 13, size=192))
    mask = (torch.arange(12)[None] < lengths[:, None]).long()
    y = torch.from_numpy(g.integers(0, 4, size=192))
    x = {"ids": ids * mask, "mask": mask}
    return DatasetSplits({k: v[:128] for k, v in x.items()}, y[:128], {k: v[128:] for k, v in x.items()}, y[128:], 4)


@pytest.fixture
def onnx_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    torch.manual_seed(0)
    path = tmp_path / "encoder.onnx"
    ids, mask = torch.ones(2, 12, dtype=torch.long), torch.ones(2, 12, dtype=torch.long)
    axes = {"ids": {0: "batch", 1: "seq"}, "mask": {0: "batch", 1: "seq"}, "hidden": {0: "batch", 1: "seq"}}
    torch.onnx.export(
        TwoInputEncoder().eval(),
        (ids, mask),
        str(path),
        input_names=["ids", "mask"],
        output_names=["hidden", "logits"],
        dynamic_axes={**axes, "logits": {0: "batch"}},
        dynamo=False,
    )
    monkeypatch.setitem(sys.modules, "one_check_data", sys.modules[__name__])
    return path


def run(tmp_path: Path, onnx_path: Path, **validate: object) -> tuple[dict, dict]:
    cfg = config_from_dict(
        {
            "model": {"onnx": str(onnx_path)},
            "data": {"name": "one_check_data:tokens"},
            "build": {"backends": ["onnxruntime"]},
            "precision": {"variants": ["fp32", "int8"], "node_errors": False},
            "signature": {"batch_sizes": [1, 8], "shapes": {"seq": [6, 12]}},
            "validate": {"warmup": 1, "iterations": 3, **validate},
        }
    )
    run_pipeline(cfg, tmp_path / "w")
    variants = json.loads((tmp_path / "w" / "precision" / "variants.json").read_text())["variants"]
    validation = json.loads((tmp_path / "w" / "validate" / "validation.json").read_text())
    return variants, validation


def test_precision_accepts_what_validation_accepts(tmp_path: Path, onnx_start: Path) -> None:
    """From an ONNX start the FP32 graph in ONNX Runtime is validation's reference too: the INT8 graph's statistics
    in the precision stage are the INT8 engine's in validation (every shape of seq, both batch sizes)."""
    variants, validation = run(tmp_path, onnx_start, metric="macro_f1")
    int8 = next(e for e in validation["engines"] if e["precision"] == "int8")
    assert int8["passed"] and variants["int8"]["fallback_passed"]
    judged = variants["int8"]["report"]["ort_cpu"]["vs_fp32"]  # the graph ONNX Runtime CPU engines run
    assert judged["top1_agreement"] == pytest.approx(int8["top1_agreement"], abs=1e-9)
    assert judged["cosine"] == pytest.approx(int8["cosine"], abs=1e-5)
    assert judged["metric"] == pytest.approx(int8["metric"], abs=1e-9)
    assert validation["baseline"]["metric_name"] == "macro_f1" and validation["baseline"]["metric"] is not None
    assert [p["seq"] for p in validation["baseline"]["shapes"]] == [6, 12]


def test_a_variant_no_round_gets_through_is_not_made(tmp_path: Path, onnx_start: Path) -> None:
    gates = {"per_precision": {"int8": {"min_cosine": 0.9999999}}}  # INT8 cannot get there
    variants, validation = run(tmp_path, onnx_start, gates=gates)
    assert "int8" not in variants and all(e["precision"] != "int8" for e in validation["engines"])
    summary = json.loads((tmp_path / "w" / "precision" / "manifest.json").read_text())["summary"]
    why = summary["failed"]["int8"]
    assert "not made" in why and "min_cosine 0.9999999" in why and "tried keeping" in why
