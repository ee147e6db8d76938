"""A library's error whose cause is a setting of the model, not the data, gets that setting as its fix."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kiln.core.data import DatasetSplits
from kiln.core.errors import ModelError
from kiln.stages.train.stage import check_model_fits_data


class NoPadToken(nn.Module):
    """Raises as a transformers GPT-2 sequence classifier built without pad_token_id does at batch > 1."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[0] > 1:
            raise ValueError("Cannot handle batch sizes > 1 if no padding token is defined.")
        return self.emb(input_ids).mean(1)


def test_a_missing_pad_token_is_told_to_set_pad_token_id_not_to_change_the_data() -> None:
    ids = torch.randint(0, 10, (8, 6))
    data = DatasetSplits(
        ids, torch.zeros(8, dtype=torch.long), ids[:4], torch.zeros(4, dtype=torch.long), num_classes=4
    )
    with pytest.raises(ModelError) as err:
        check_model_fits_data(NoPadToken(), data, "gpt:build")
    assert "pad_token_id" in err.value.hint and "data.name" not in err.value.hint
