"""A checkpoint whose layers are under weight_norm in another form than the model's (none, the older weight_g/weight_v,
torch.nn.utils.parametrizations' original0/original1) loads where the tensors say the same weight, and says the fix
where they cannot."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations

from kiln.models.model_io import ModelShapeError, load_weights


def _plain() -> nn.Module:
    return nn.Sequential(nn.Conv1d(4, 6, 3), nn.LeakyReLU(0.1), nn.ConvTranspose1d(6, 2, 4, stride=2))


def _parametrized() -> nn.Module:
    model = _plain()
    for i in (0, 2):
        parametrizations.weight_norm(model[i])
    return model


def _older() -> nn.Module:
    model = _plain()
    with warnings.catch_warnings():  # torch.nn.utils.weight_norm is deprecated, and still in checkpoints
        warnings.simplefilter("ignore", FutureWarning)
        for i in (0, 2):
            nn.utils.weight_norm(model[i])
    return model


FORMS = {"plain": _plain, "parametrized": _parametrized, "older": _older}


def _out(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.linspace(-1, 1, 2 * 4 * 9).reshape(2, 4, 9))


@pytest.mark.parametrize(
    ("saved", "built"),
    [("plain", "parametrized"), ("plain", "older"), ("older", "parametrized"), ("parametrized", "older")],
)
def test_a_checkpoint_in_another_weight_norm_form_loads_into_the_model_s(saved: str, built: str) -> None:
    torch.manual_seed(0)
    source = FORMS[saved]()
    model = load_weights(FORMS[built](), {k: v.detach().clone() for k, v in source.state_dict().items()}, "w.pt")
    assert torch.allclose(_out(model), _out(source), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("saved", ["parametrized", "older"])
def test_a_weight_normed_checkpoint_for_a_plain_model_says_to_apply_or_remove_weight_norm(saved: str) -> None:
    with pytest.raises(ModelShapeError) as caught:
        load_weights(_plain(), FORMS[saved]().state_dict(), "w.pt")
    hint = caught.value.hint or ""
    assert hint.startswith("the checkpoint holds 0.weight, 2.weight under weight_norm and the model without"), hint
    assert "remove_parametrizations(layer, 'weight')" in hint and "weight_norm to those layers" in hint


def test_a_plain_weight_of_another_shape_is_not_made_into_g_and_v() -> None:
    state = {k: v for k, v in _plain().state_dict().items()}
    state["0.weight"] = torch.randn(6, 4, 5)  # another kernel size: another architecture
    with pytest.raises(ModelShapeError) as caught:
        load_weights(_parametrized(), state, "w.pt")
    assert "0.parametrizations.weight.original0" in caught.value.message
    assert (caught.value.hint or "").startswith("the model holds 0.weight as weight_norm's two tensors")


class Scaled(nn.Module):
    """A parametrization of two tensors that is not weight_norm: a scale per output channel times the weight."""

    def forward(self, scale: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return scale * weight

    def right_inverse(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.ones(weight.shape[0], 1, 1), weight


def test_two_tensors_of_another_parametrization_are_not_taken_for_weight_norm() -> None:
    built = _plain()
    nn.utils.parametrize.register_parametrization(built[0], "weight", Scaled(), unsafe=True)
    parametrizations.weight_norm(built[2])
    with pytest.raises(ModelShapeError) as caught:
        load_weights(built, _older().state_dict(), "w.pt")
    assert (
        "2 of the model's 6 keys missing (0.parametrizations.weight.original0, 0.parametrizations.weight.original1)"
        in caught.value.message
    )
