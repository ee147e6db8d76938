"""Nested inputs in the data (a KV cache as Hugging Face lays it out, ``((k0, v0), (k1, v1))``) are named as such."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kiln.core.data import DataContractError, DatasetSplits, check_splits


def _cache(rows: int) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    return tuple((torch.zeros(rows, 2, 3, 4), torch.zeros(rows, 2, 3, 4)) for _ in range(2))


def _inputs(rows: int, past: object) -> dict[str, object]:
    return {"input_ids": torch.zeros(rows, 3, dtype=torch.long), "past_key_values": past}


@pytest.mark.parametrize(
    ("past", "told"),
    [
        (_cache, "past_key_0, past_value_0"),
        (lambda rows: [torch.zeros(rows, 4), torch.zeros(rows, 4)], "past_key_values_0, past_key_values_1"),
        (lambda rows: {"a": torch.zeros(rows, 4)}, "past_key_values_0"),
    ],
)
def test_a_nested_input_is_told_to_become_named_tensors(past: Callable[[int], object], told: str) -> None:
    """The fix was to wrap arrays with torch.from_numpy(...), which a tuple of tensors already is."""
    data = DatasetSplits(_inputs(4, past(4)), None, _inputs(2, past(2)), None)
    with pytest.raises(DataContractError, match=r"train_x\['past_key_values'\] as a nested .* not supported") as err:
        check_splits(data, "nest:load")
    assert told in err.value.hint and "from_numpy" not in err.value.hint and "forward" in err.value.hint


def test_an_array_input_is_still_told_to_wrap_it() -> None:
    data = DatasetSplits({"x": [1.0, 2.0]}, None, {"x": torch.zeros(2, 1)}, None)
    with pytest.raises(DataContractError, match=r"train_x\['x'\] as list, not a torch.Tensor") as err:
        check_splits(data, "nest:load")
    assert "from_numpy" in err.value.hint
