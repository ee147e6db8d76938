"""Labels given as a list of one tensor per sample (CTC transcripts of their own lengths) are told to be padded into
one tensor with the label that losses ignore; a target in parts keeps its fix (pack them into one)."""

from __future__ import annotations

import pytest
import torch

from kiln.core.data import DataContractError, DatasetSplits, check_splits

PAD = "torch.nn.utils.rnn.pad_sequence(labels, batch_first=True, padding_value=-100)"


def _splits(labels: list[torch.Tensor]) -> DatasetSplits:
    x = torch.zeros(len(labels), 6, 3)
    return DatasetSplits(x, labels, x, labels)


def _hint(labels: list[torch.Tensor]) -> str:
    with pytest.raises(DataContractError, match="gives train_y as list") as err:
        check_splits(_splits(labels), "speech:load")
    return err.value.hint or ""


def test_transcripts_of_their_own_lengths_are_told_to_be_padded() -> None:
    hint = _hint([torch.arange(n) % 4 for n in (2, 5, 3, 4)])
    assert PAD in hint and "torch.cat" not in hint


def test_a_list_of_one_tensor_per_sample_of_one_length_is_told_to_be_padded_too() -> None:
    assert PAD in _hint([torch.arange(3) for _ in range(4)])


def test_one_class_per_sample_as_scalars_is_told_to_be_stacked() -> None:
    assert "torch.stack(labels)" in _hint([torch.tensor(i % 2) for i in range(4)])


def test_the_parts_of_one_target_keep_their_fix() -> None:
    x = torch.zeros(8, 3)
    y = [torch.zeros(8, 2, 4, 4), torch.zeros(8, 2, 4, 4)]
    with pytest.raises(DataContractError) as err:
        check_splits(DatasetSplits(x, y, x, y), "det:load")
    assert (err.value.hint or "").startswith("pack the targets into one tensor")
