"""The train stage's probe tells rows that are one sample (a graph's nodes indexed across rows) from an indexing
error of the model's own, and checks ``validate.gates.gated_outputs`` against the model's outputs before training."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kiln.core.data import DatasetSplits
from kiln.core.errors import ConfigError, KilnError
from kiln.stages.train.stage import check_model_fits_data


class TopK(nn.Module):
    """Token ids through an embedding, then a top-k larger than what it picks from: the model's own bug."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.emb, self.router, self.k = nn.Embedding(8, 4), nn.Linear(4, 3), k

    def forward(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.emb(input_ids).mean(1)
        gate, _ = torch.topk(self.router(h), self.k, dim=-1)
        return {"logits": gate, "aux_loss": gate.sum()}


class Table(nn.Module):
    """Ids (not through an embedding) indexing a table of its own shorter than the ids reach: the model's bug, even
    though it fails on all rows alike."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(4, 3))

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return x[:, :3] + self.table.index_select(0, ids)


def _tokens() -> DatasetSplits:
    ids = torch.arange(20 * 3).reshape(20, 3) % 8  # values 0..7: below the 20 rows, as any small vocabulary
    y = torch.arange(20) % 3
    return DatasetSplits({"input_ids": ids}, y, {"input_ids": ids}, y, num_classes=3, name="toks:load")


def test_a_topk_past_its_axis_is_the_models_error_not_rows_indexed_across() -> None:
    with pytest.raises(KilnError) as err:
        check_model_fits_data(TopK(k=5), _tokens(), "moe:build")
    assert "not independent samples" not in str(err.value)
    assert "model 'moe:build' raised RuntimeError: selected index k out of range (in forward() at" in err.value.message
    assert err.value.hint.startswith("fix forward() in ") and "test_train_probe_index_errors.py line" in err.value.hint


def test_an_index_past_the_models_own_table_is_its_error_where_all_rows_fail_too() -> None:
    x = (torch.randn(10, 4), (torch.arange(10) + 5) % 10)  # ids 5, 6 first, into a table of 4: within the 10 rows
    y = torch.zeros(10, dtype=torch.long)
    with pytest.raises(KilnError) as err:
        check_model_fits_data(Table(), DatasetSplits(x, y, x, y, num_classes=3), "tab:build")
    assert "not independent samples" not in str(err.value)
    assert "raised" in err.value.message and "index out of range in self" in err.value.message


def test_a_misspelt_gated_output_fails_on_the_probe_with_the_closest_name() -> None:
    with pytest.raises(ConfigError) as err:
        check_model_fits_data(TopK(k=2), _tokens(), "moe:build", gated_outputs=["logit"])
    assert err.value.message == (
        "validate.gates.gated_outputs names ['logit'], which the model has no output of "
        "(its outputs: ['logits', 'aux_loss'])"
    )
    assert err.value.hint.startswith("did you mean 'logits' for 'logit'? list outputs of ['logits', 'aux_loss']")


def test_gated_outputs_the_model_has_pass() -> None:
    check_model_fits_data(TopK(k=2), _tokens(), "moe:build", gated_outputs=["logits"])
    check_model_fits_data(TopK(k=2), _tokens(), "moe:build", gated_outputs=None)
