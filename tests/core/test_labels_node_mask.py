"""A graph neural network's node mask (``node_mask``, PyTorch Geometric's ``to_dense_batch`` mask: 1 where a node is
real, 0 on padding) is a mask like an attention mask: its 0 positions are padding, which labels should not carry and
comparisons leave out. A bare ``mask`` is not taken (an inpainting model's marks pixels to fill, not padding)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln.core.labels import is_mask_name, is_padding_mask_name, labelled_padding, pad_positions, without_padding


@pytest.mark.parametrize(
    ("name", "mask"),
    [("node_mask", True), ("src_node_mask", True), ("Node_Mask", True), ("mask", False), ("nodemask", False)],
)
def test_a_node_mask_is_named_like_a_mask(name: str, mask: bool) -> None:
    assert is_mask_name(name) is mask
    assert not is_padding_mask_name(name)  # 1 marks a real node, as an attention mask's 1 a real token


def _graphs() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Three graphs of 2, 3 and 4 nodes padded to 4 (``x [3, 4, 2]``, a float ``node_mask [3, 4]``), labels 0 on
    the padded nodes as a user's data may leave them."""
    mask = (torch.arange(4)[None, :] < torch.tensor([[2], [3], [4]])).float()
    x = torch.randn(3, 4, 2) * mask[..., None]
    return {"x": x, "node_mask": mask}, torch.ones(3, 4, dtype=torch.long) * mask.long()


def test_labels_on_padded_nodes_are_counted() -> None:
    inputs, y = _graphs()
    assert labelled_padding(inputs, y) == ("node_mask", 3)
    assert labelled_padding(inputs, y.masked_fill(inputs["node_mask"] == 0, -100)) == ("node_mask", 0)
    assert labelled_padding({"x": inputs["x"], "mask": inputs["node_mask"]}, y) == ("", 0)


def test_padded_nodes_are_left_out_of_comparisons() -> None:
    inputs, _ = _graphs()
    mask = inputs["node_mask"].numpy().astype(np.int64)
    assert (pad_positions("node_mask", mask) == (mask == 0)).all()
    out = without_padding({"node_mask": mask}, {"logits": np.ones((3, 4, 5), np.float32)})["logits"]
    assert (out[..., 0] == mask).all()
