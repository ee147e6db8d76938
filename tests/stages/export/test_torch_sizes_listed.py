"""PyTorch failing at a point that holds both a size Kiln cut the rows to and one signature.shapes lists
(:func:`kiln.stages.export.torch_sizes.torch_at`): where the model still fails with the cut axes at the rows' own
sizes, the fix names the listed size and the largest the model runs at, not the cutting."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from kiln.core.data import from_feed
from kiln.core.errors import ModelError
from kiln.core.shapes import resize
from kiln.stages.export.torch_sizes import torch_at


class _Towers(nn.Module):
    """A query [N, qlen] with a position table of 16 rows added, and a document [N, dlen] summed: qlen takes up to
    16, dlen any size."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.arange(16, dtype=torch.float32))

    def forward(self, query: torch.Tensor, doc: torch.Tensor) -> torch.Tensor:
        q = query + self.pos[: query.shape[1]].expand(query.shape[0], query.shape[1])
        return torch.stack([q.sum(1), doc.sum(1)], dim=1)


def _error(point: dict[str, int], listed: dict[str, list[int]]) -> ModelError:
    rng = np.random.default_rng(0)
    feed = {"query": rng.random((2, 8), dtype=np.float32), "doc": rng.random((2, 12), dtype=np.float32)}
    axes = {"query": {1: "qlen"}, "doc": {1: "dlen"}}
    like = {k: torch.from_numpy(v) for k, v in feed.items()}
    with pytest.raises(ModelError) as err:
        torch_at(_Towers().eval(), from_feed(resize(feed, axes, point), like), point, [feed] * 3, axes, listed)
    return err.value


def test_a_listed_size_the_model_cannot_take_is_named_though_another_axis_was_cut() -> None:
    err = _error({"dlen": 6, "qlen": 40}, {"qlen": [2, 40]})
    assert "the model fails at dlen=6, qlen=40" in err.message, err.message
    assert (err.hint or "").startswith(
        "signature.shapes lists qlen=40 (the largest size it runs at there is 16), where the model fails with the "
        "other axes at the data's own sizes: list there only sizes the model takes"
    ), err.hint
    assert "cutting" not in (err.hint or "")


def test_a_cut_size_alone_at_fault_still_speaks_of_the_cutting() -> None:
    err = _error({"dlen": 6, "qlen": 40}, {})
    assert "signature.shapes lists" not in (err.hint or ""), err.hint


class _Gather(nn.Module):
    """A graph's node values [N, nodes] read at its edges' ends [N, edges]: it takes any number of nodes, but not a
    graph cut to fewer nodes than its edges index."""

    def forward(self, x: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
        return x.gather(1, edges).sum(1, keepdim=True)


def test_a_listed_size_below_the_rows_own_speaks_of_the_cutting() -> None:
    """signature.shapes lists nodes=4 beside held-out graphs of 8: Kiln cut them to 4 and kept edges to the nodes
    it removed, so the fix says so rather than that the model does not take 4 nodes."""
    rng = np.random.default_rng(0)
    feed = {"x": rng.random((2, 8), dtype=np.float32), "edges": np.tile(np.arange(8, dtype=np.int64), (2, 2))[:, :12]}
    axes = {"x": {1: "nodes"}, "edges": {1: "edges"}}
    point = {"nodes": 4, "edges": 12}
    like = {k: torch.from_numpy(v) for k, v in feed.items()}
    with pytest.raises(ModelError) as err:
        torch_at(_Gather().eval(), from_feed(resize(feed, axes, point), like), point, [feed] * 3, axes, {"nodes": [4]})
    assert "signature.shapes lists" not in (err.value.hint or ""), err.value.hint
    assert (err.value.hint or "").startswith("Kiln made that size by cutting the data's rows (its own: nodes=8)")
