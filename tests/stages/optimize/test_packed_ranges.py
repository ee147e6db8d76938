"""A recommender's categorical ids packed in one integer input through train, export and optimize: the export
records the data's values per column, and the optimizer's safety net draws each column within its own table."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

from kiln.core.data import DatasetSplits, fixed_columns, integer_ranges
from kiln.core.onnx_io import index_ranges, io_specs
from kiln.pipeline.api import run_pipeline
from kiln.pipeline.config import config_from_dict
from kiln.stages.optimize.api import optimize_model
from kiln.stages.optimize.config import OptimizeConfig
from tests.conftest import tiny_config_dict
from tests.core.test_onnx_io_offsets import CARDINALITIES, _ft_graph

PACKED = """
import torch
from torch import nn
from kiln import DatasetSplits


class Packed(nn.Module):
    def __init__(self):
        super().__init__()
        self.small, self.big, self.head = nn.Embedding(10, 4), nn.Embedding(1000, 4), nn.Linear(8, 1)

    def forward(self, sparse):
        return self.head(torch.cat([self.small(sparse[:, 0]), self.big(sparse[:, 1])], 1))


def build():
    return Packed()


def load():
    g = torch.Generator().manual_seed(0)
    s = torch.stack([torch.randint(0, 10, (128,), generator=g), torch.randint(0, 1000, (128,), generator=g)], 1)
    y = (s[:, :1] % 2).float()
    return DatasetSplits({"sparse": s[:96]}, y[:96], {"sparse": s[96:]}, y[96:])
"""


def test_a_packed_categorical_input_passes_the_safety_net(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: int_ranges.json held one range for ``sparse`` (the 1000-row column's), every column was drawn from
    it, and optimize stopped with ONNX Runtime's "idx=... must be within the inclusive range [-10,9]", which
    optimize.int_high (the fix it printed) did not change."""
    (tmp_path / "packed_rec.py").write_text(textwrap.dedent(PACKED))
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = tiny_config_dict(
        **{"model.name": "packed_rec:build", "model.params": {}, "data.name": "packed_rec:load", "train.epochs": 1}
    )
    result, _ = run_pipeline(config_from_dict(cfg), tmp_path / "wd", stop="optimize")
    assert result.error is None, result.error
    assert [r.status for r in result.records] == ["ran", "ran", "ran"]
    ranges = json.loads((tmp_path / "wd" / "export" / "int_ranges.json").read_text())["sparse"]
    assert len(ranges) == 2 and ranges[0][1] <= 9 < ranges[1][1]


def test_offset_columns_into_one_shared_table_pass_the_safety_net(tmp_path: Path) -> None:
    """A tabular FT-Transformer's ``x_cat`` (4, 10 and 3 levels, shifted into one shared 17-row table): the ranges
    the export records (as the export stage computes them) hold one per column, and the safety net, drawing each
    column within its own, runs the model; one range, 0 to 9, draws past the table's rows in column 2."""
    graph = _ft_graph(tmp_path)
    g = torch.Generator().manual_seed(0)
    x = {
        "x_num": torch.rand(64, 7, generator=g),
        "x_cat": torch.stack([torch.randint(0, k, (64,), generator=g) for k in CARDINALITIES], 1),
    }
    data = DatasetSplits({k: v[:48] for k, v in x.items()}, None, {k: v[48:] for k, v in x.items()}, None)
    ranges = integer_ranges(data, list(x), fixed_columns(io_specs(graph)[0], index_ranges(graph)))
    assert ranges == {"x_cat": [[0, 3], [0, 9], [0, 2]]}
    assert optimize_model(graph, OptimizeConfig(), int_ranges=ranges)[1]["verified"]
