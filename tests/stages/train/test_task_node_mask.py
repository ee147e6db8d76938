"""Labels set on padded nodes of a dense graph batch (``node_mask`` 0, PyTorch Geometric's ``to_dense_batch`` mask)
are warned of before training, as labels on an attention mask's padding are: a padded node's logits argmax to 0 and
count as hits where its label is 0. A padding mask (True marks padding) is named by its own value in the warning."""

from __future__ import annotations

import logging

import pytest
import torch

from kiln.core.data import DatasetSplits
from kiln.stages.train.task import warn_labelled_padding


def _said(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, data: DatasetSplits) -> list[str]:
    """The kiln.train warnings :func:`warn_labelled_padding` logs for ``data``."""
    monkeypatch.setattr(logging.getLogger("kiln"), "propagate", True)  # the CLI tests turn it off
    caplog.set_level(logging.WARNING, logger="kiln.train")
    warn_labelled_padding(data)
    return [r.getMessage() for r in caplog.records if r.name == "kiln.train" and r.levelno == logging.WARNING]


def _graphs(mask_name: str, real: torch.Tensor) -> DatasetSplits:
    """Four graphs of 2 to 5 nodes padded to 5, labels 0 on every padded node; ``real`` maps the real-node flags to
    the mask's values."""
    nodes = torch.arange(5)[None, :] < torch.tensor([[2], [3], [4], [5]])
    x = {"x": torch.randn(4, 5, 3), "adj": torch.eye(5).expand(4, 5, 5), mask_name: real(nodes)}
    y = torch.where(nodes, torch.tensor(1), torch.tensor(0))
    return DatasetSplits(x, y, x, y, num_classes=2)


def test_labels_on_nodes_the_node_mask_pads_are_warned_of(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    said = _said(caplog, monkeypatch, _graphs("node_mask", lambda nodes: nodes.float()))
    assert len(said) == 1, said
    assert said[0].startswith("labels are set at 6 positions of train_y and 6 positions of val_y")
    assert "where input 'node_mask' is 0 (padding)" in said[0] and "y[node_mask == 0] = -100" in said[0]


def test_a_padding_masks_padding_is_named_by_its_true(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    said = _said(caplog, monkeypatch, _graphs("key_padding_mask", lambda nodes: ~nodes))
    assert len(said) == 1, said
    assert "where input 'key_padding_mask' is True or 1 (padding)" in said[0]
    assert "y[key_padding_mask != 0] = -100" in said[0]
