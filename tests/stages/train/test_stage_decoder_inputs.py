"""The error the train stage's probe gives an encoder-decoder whose forward needs ``decoder_input_ids`` the data
lacks (T5's decoder fails in its library's words, which name no decoder): the fix is to give them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kiln.core.data import DatasetSplits
from kiln.core.errors import ModelError
from kiln.stages.train.stage import check_model_fits_data
from kiln.stages.train.task import DECODER_FIX


class NeedsDecoder(nn.Module):
    """T5's shape: the decoder is called with ``decoder_input_ids`` as its ``input_ids`` and fails without them."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head, self.width = nn.Embedding(8, 4), nn.Linear(4, 8), width

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        if decoder_input_ids is None:
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        memory = self.emb(input_ids)[..., : self.width].mean(1, keepdim=True)
        return {"logits": self.head(self.emb(decoder_input_ids) + memory)}


def _data() -> DatasetSplits:
    ids = torch.randint(0, 8, (6, 5))
    x = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    return DatasetSplits(x, ids, x, ids, num_classes=8, name="pairs:no_dec")


def test_missing_decoder_inputs_are_named_with_the_decoder_fix() -> None:
    with pytest.raises(ModelError) as e:
        check_model_fits_data(NeedsDecoder(), _data(), "s2s:build_t5")
    assert "decoder_input_ids is missing" in e.value.message
    assert "input_ids or inputs_embeds" in e.value.message
    assert e.value.hint == DECODER_FIX


def test_a_failure_that_decoder_inputs_do_not_cure_keeps_the_generic_fix() -> None:
    """A model that fails with decoder inputs too (its width does not fit): the decoder is not what to fix."""
    with pytest.raises(ModelError) as e:
        check_model_fits_data(NeedsDecoder(width=3), _data(), "s2s:build_t5")
    assert "decoder_input_ids is missing" not in e.value.message
    assert e.value.hint.startswith("make data.name/data.params produce what the model expects")
