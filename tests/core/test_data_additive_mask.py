"""A float input of nothing but 0 and -inf is an additive attention mask: its refusal says so and gives the forms
that pass (a bool mask, or a large finite negative number); other infinite inputs are refused as before."""

from __future__ import annotations

import pytest
import torch

from kiln.core.data import DataContractError, DatasetSplits, check_splits


def _splits(bias: torch.Tensor) -> DatasetSplits:
    x = {"tokens": torch.zeros(8, 4, dtype=torch.long), "attn_bias": bias}
    return DatasetSplits(x, None, {"tokens": torch.zeros(2, 4, dtype=torch.long), "attn_bias": torch.zeros(2, 4)}, None)


def test_an_additive_mask_is_named_with_the_forms_that_pass() -> None:
    bias = torch.zeros(8, 4)
    bias[:, 3] = float("-inf")
    with pytest.raises(DataContractError, match=r"train_x\['attn_bias'\] holds only 0 and -inf \(8 values") as info:
        check_splits(_splits(bias), "mine:data")
    assert "additive attention mask" in str(info.value)
    assert "bool mask" in info.value.hint and "-1e9" in info.value.hint and "torch.finfo" in info.value.hint


def test_other_infinite_inputs_are_refused_as_before() -> None:
    bias = torch.ones(8, 4)
    bias[0, 0] = float("inf")
    with pytest.raises(DataContractError, match="holds 1 infinite values") as info:
        check_splits(_splits(bias), "mine:data")
    assert "nan_to_num" in info.value.hint
