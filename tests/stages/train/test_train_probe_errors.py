"""The error the train stage gives before the first epoch for data the model's forward cannot take: inputs named
by the forward's parameters, and float inputs of another dtype than the weights named as the thing to fix."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kiln.core.data import DatasetSplits
from kiln.core.errors import ModelError
from kiln.stages.train.stage import check_model_fits_data


class Conditioned(nn.Module):
    """A denoiser's shape: features ``x``, a step ``t`` and a class ``y`` -> an output like ``x``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.emb = nn.Linear(4, 4), nn.Embedding(5, 4)

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.emb(y) + t[:, None].float()


class Variadic(Conditioned):
    """The same inputs through ``*args``: no parameter names to give them."""

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return super().forward(*args)


def _data(x_dtype: torch.dtype = torch.float32, features: int = 4) -> DatasetSplits:
    x = (torch.randn(6, features).to(x_dtype), torch.arange(6), torch.arange(6) % 5)
    return DatasetSplits(x, torch.randn(6, 4), x, torch.randn(6, 4), name="noisy:load")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_a_float_input_in_another_dtype_than_the_weights_is_named_as_the_fix(dtype: torch.dtype) -> None:
    """float64 (or float16) data against float32 weights: the fix converts that input in the data function,
    named by the forward's parameter, rather than pointing at the forward's line."""
    with pytest.raises(ModelError) as e:
        check_model_fits_data(Conditioned(), _data(dtype), "cond:build")
    name = str(dtype).removeprefix("torch.")
    assert f"inputs (x (2, 4) torch.{name}, t (2,) torch.int64, y (2,) torch.int64)" in e.value.message
    assert e.value.hint == (
        f"give input 'x' ({name}) as float32, the dtype of the model's weights (x.float() in the data function "
        "'noisy:load')"
    )


def test_another_failure_keeps_its_fix_with_the_inputs_named() -> None:
    """A shape the model cannot take, float64 or not: the fix stays the data's or the model's, and the forward's
    line; the inputs are still named x, t, y."""
    for dtype in (torch.float32, torch.float64):
        with pytest.raises(ModelError) as e:
            check_model_fits_data(Conditioned(), _data(dtype, features=3), "cond:build")
        assert "inputs (x (2, 3)" in e.value.message and ", t (2,) torch.int64, y (2,)" in e.value.message
        assert e.value.hint.startswith("make data.name/data.params produce what the model expects")
        assert "or fix forward() in" in e.value.hint


def test_inputs_through_args_keep_their_indices() -> None:
    with pytest.raises(ModelError) as e:
        check_model_fits_data(Variadic(), _data(torch.float64), "var:build")
    assert "inputs (0 (2, 4) torch.float64, 1 (2,) torch.int64, 2 (2,)" in e.value.message
    assert e.value.hint.startswith("give input '0' (float64) as float32, the dtype of the model's weights (.float() on")


class Neighbours(nn.Module):
    """Nodes ``x [N, F]`` and each node's neighbours ``nbr [N, k]``, indices into all N rows."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, nbr: torch.Tensor) -> torch.Tensor:
        return self.lin(x + x.index_select(0, nbr.reshape(-1)).reshape(*nbr.shape, -1).mean(1))


def test_rows_indexed_across_by_the_model_are_told_the_batch_of_one() -> None:
    """The probe's two rows failed as 'index out of range' with a fix to change the data or the model, for a model
    that runs on all the rows: they are one sample."""
    x = (torch.randn(12, 4), (torch.arange(12 * 2).reshape(12, 2) * 5) % 12)
    y = torch.zeros(12, dtype=torch.long)
    with pytest.raises(ModelError, match="input nbr holds indices into all 12 rows") as err:
        check_model_fits_data(Neighbours(), DatasetSplits(x, y, x, y, num_classes=3), "knn:build")
    assert "not independent samples" in str(err.value) and "x [1, 12, 4], nbr [1, 12, 2]" in err.value.hint
    assert "signature.batch_sizes: [1]" in err.value.hint and "y[None]" in err.value.hint
