"""The error for integer labels without classes says num_classes was not given where it was left at its default."""

from __future__ import annotations

import pytest
import torch

from kiln.core.data import DataContractError, DatasetSplits, check_splits


@pytest.mark.parametrize("num_classes", [0, None])
def test_integer_labels_with_num_classes_left_out_say_it_is_not_given(num_classes: int | None) -> None:
    x, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
    with pytest.raises(DataContractError) as caught:
        check_splits(DatasetSplits(x, y, x, y, num_classes=num_classes), "seg:load")
    assert "integer labels but num_classes is not given" in caught.value.message
    assert "not a positive integer" not in caught.value.message
    assert (caught.value.hint or "").startswith("pass num_classes=... to DatasetSplits")


def test_integer_labels_with_a_negative_num_classes_say_the_value() -> None:
    x, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
    with pytest.raises(DataContractError, match="num_classes is -2, not a positive integer"):
        check_splits(DatasetSplits(x, y, x, y, num_classes=-2), "seg:load")
