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
from kiln.stages.optimize.verify import random_inputs
from tests.conftest import tiny_config_dict
from tests.core.test_onnx_io_cells import dlrm_graph, dlrm_ids
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


MULTI_HOT = """
import torch
from torch import nn
from kiln import DatasetSplits

ROWS = (1000, 50, 20, 5)


class Dlrm(nn.Module):
    def __init__(self):
        super().__init__()
        self.tables, self.head = nn.ModuleList(nn.Embedding(n, 4) for n in ROWS), nn.Linear(16, 1)

    def forward(self, sparse):
        return self.head(torch.cat([t(sparse[:, i]).sum(1) for i, t in enumerate(self.tables)], 1))


def build():
    return Dlrm()


def load():
    g = torch.Generator().manual_seed(0)
    s = torch.stack([torch.randint(0, n, (128, 3), generator=g) for n in ROWS], 1)
    y = (s[:, 3, :1] % 2).float()
    return DatasetSplits({"sparse": s[:96]}, y[:96], {"sparse": s[96:]}, y[96:])
"""


def test_multi_hot_ids_of_tables_on_axis_1_pass_the_safety_net(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """DLRM's ``sparse [batch, 4, 3]`` (tables of 1000, 50, 20 and 5 rows, 3 ids each, ``table_i(sparse[:, i])``):
    the export records the data's range per cell, and the net draws table 3's ids within its 5 rows. Before, one
    range, 0 to 999, was recorded, and optimize stopped at ONNX Runtime's Gather with a rerun of the export for
    fix, which wrote the same range again."""
    (tmp_path / "multi_hot_rec.py").write_text(textwrap.dedent(MULTI_HOT))
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = tiny_config_dict(
        **{
            "model.name": "multi_hot_rec:build",
            "model.params": {},
            "data.name": "multi_hot_rec:load",
            "train.epochs": 1,
        }
    )
    result, _ = run_pipeline(config_from_dict(cfg), tmp_path / "wd", stop="optimize")
    assert result.error is None, result.error
    assert [r.status for r in result.records] == ["ran", "ran", "ran"]
    ranges = json.loads((tmp_path / "wd" / "export" / "int_ranges.json").read_text())["sparse"]
    assert len(ranges) == 12 and max(high for _, high in ranges[9:]) <= 4 < ranges[0][1]


@pytest.mark.parametrize("per_cell", [True, False], ids=["per-cell", "one-range"])
def test_multi_hot_ids_are_drawn_within_their_own_tables(tmp_path: Path, per_cell: bool) -> None:
    """The net draws each cell of ``sparse [batch, 4, 3]`` within its table's rows, from the data's ranges per cell
    (as the export records them) or from an older int_ranges.json's one range (the 1000-row table's)."""
    graph = dlrm_graph(tmp_path)
    g = torch.Generator().manual_seed(0)
    sparse = dlrm_ids(64, g)
    data = DatasetSplits({"sparse": sparse[:48]}, None, {"sparse": sparse[48:]}, None)
    columns = fixed_columns(io_specs(graph)[0], index_ranges(graph))
    ranges = integer_ranges(data, ["sparse"], columns) if per_cell else {"sparse": [0, 999]}
    drawn = random_inputs(graph, OptimizeConfig(), batch=64, int_ranges=ranges)["sparse"]
    assert drawn[:, 3].max() <= 4 and drawn[:, 0].max() > 16
    assert optimize_model(graph, OptimizeConfig(), int_ranges=ranges)[1]["verified"]
