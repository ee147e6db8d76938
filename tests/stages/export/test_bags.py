"""nn.EmbeddingBag over padded bags exports as a lookup and a reduction (no Loop over the bags), with the module's
own values: pads left out, empty bags zeros; flat ids with offsets keep the module's forward."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from kiln.core.onnx_io import ort_session
from kiln.stages.export.bags import bag_lookup, bags_as_lookups
from kiln.stages.export.torch_export import export_onnx


def _ids() -> torch.Tensor:
    ids = torch.randint(1, 30, (6, 7), generator=torch.Generator().manual_seed(0))
    ids[2] = 0  # an empty bag: all padding
    ids[3, 3:] = 0  # a bag of three, padded
    return ids


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("padding_idx", [None, 0])
def test_a_padded_bag_as_a_lookup_has_the_modules_values(mode: str, padding_idx: int | None) -> None:
    torch.manual_seed(0)
    bag = nn.EmbeddingBag(30, 5, mode=mode, padding_idx=padding_idx)
    ids = _ids()
    want = bag(ids)
    with bags_as_lookups(bag) as found:
        got = bag(ids)
    assert found == 1 and torch.allclose(got, want, atol=1e-6)
    assert "forward" not in vars(bag)  # the module's own forward is back


def test_per_sample_weights_and_flat_bags_keep_their_values() -> None:
    torch.manual_seed(0)
    bag = nn.EmbeddingBag(30, 5, mode="sum", padding_idx=0)
    ids, weights = _ids(), torch.rand(6, 7)
    assert torch.allclose(bag_lookup(bag, ids, per_sample_weights=weights), bag(ids, per_sample_weights=weights))
    flat, offsets = ids.flatten(), torch.arange(0, 42, 7)
    assert torch.equal(bag_lookup(bag, flat, offsets), bag(flat, offsets))


class TwoTower(nn.Module):
    """A user tower of padded history bags beside an item id: a recommender's score per row."""

    def __init__(self) -> None:
        super().__init__()
        self.history = nn.EmbeddingBag(30, 8, mode="mean", padding_idx=0)
        self.item = nn.Embedding(20, 8)

    def forward(self, history: torch.Tensor, item: torch.Tensor) -> torch.Tensor:
        return (self.history(history) * self.item(item)).sum(-1)


def test_a_model_with_padded_bags_exports_without_a_loop_and_with_its_values(tmp_path: Path) -> None:
    """Both exporters write an embedding_bag as a Loop that ONNX Runtime runs once per bag; as a lookup and a mean
    it is one Gather and one reduction, with the model's values, at another batch and bag length too."""
    torch.manual_seed(0)
    model = TwoTower().eval()
    example = (_ids(), torch.arange(6))
    graph = export_onnx(model, example, tmp_path / "m.onnx", dynamic_axes={"history": {1: "length"}})
    assert "Loop" not in {n.op_type for n in graph.graph.node}
    history = torch.randint(0, 30, (3, 11), generator=torch.Generator().manual_seed(1))
    history[0] = 0
    item = torch.tensor([1, 5, 19])
    got = ort_session(onnx.load(str(tmp_path / "m.onnx"))).run(None, {"history": history.numpy(), "item": item.numpy()})
    with torch.no_grad():
        want = model(history, item).numpy()
    np.testing.assert_allclose(got[0], want, atol=1e-5)
