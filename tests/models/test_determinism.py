"""The check that a model answers the same inputs alike from call to call in eval mode says what it found in words
that fit each cause it cannot tell apart: random draws, and a state kept in a plain attribute."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from kiln.core.errors import ModelError
from kiln.models.determinism import module_layout, refuse_changed_layout, refuse_random
from tests.models.random_models import sampling, zero_noise


@pytest.mark.parametrize("how", ["randn", "counter"])
def test_draws_and_a_counter_in_an_attribute_are_both_named(how: str) -> None:
    with pytest.raises(ModelError, match="differently from call to call in eval mode") as err:
        refuse_random(sampling(how).eval(), torch.rand(2, 6))
    assert "draws random numbers" in err.value.message
    assert "keeps a state from call to call in an attribute (self.calls += 1)" in err.value.message
    assert "return the deterministic value at inference" in err.value.hint and "keep no state" in err.value.hint


def test_a_vae_that_returns_mu_passes() -> None:
    refuse_random(sampling("mean").eval(), torch.rand(2, 6))


def test_noise_at_a_zero_scale_is_refused_where_draws_are_asked_for_and_the_generator_is_left_as_it_was() -> None:
    """StyleGAN's ``h + self.weight * torch.randn_like(h)``, the weight at zero: the outputs agree until training
    moves it. The check before training asks for draws; the export's leaves them to the graph's check."""
    model, x = zero_noise().eval(), torch.rand(2, 6)
    state = torch.get_rng_state()
    with pytest.raises(ModelError, match="draws random numbers in eval mode .*though its outputs did not move yet"):
        refuse_random(model, x, generators=True)
    assert torch.equal(torch.get_rng_state(), state)  # a run seeded before the check draws as it would without it
    refuse_random(model, x)


def test_a_dropout_module_draws_nothing_in_eval_mode() -> None:
    refuse_random(zero_noise(dropout=True).eval(), torch.rand(2, 6), generators=True)


class _SwitchesOnFirstCall(torch.nn.Module):
    """Replaces its attention block on its first forward, as transformers' BigBird ``block_sparse`` does at a
    short length: calls after the first agree with each other, not with a fresh model."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = torch.nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.attn, torch.nn.Linear):
            self.attn = torch.nn.Identity()
        return self.attn(x)


def test_a_model_that_replaces_a_submodule_when_run_is_refused_naming_it() -> None:
    model = _SwitchesOnFirstCall().eval()
    layout = module_layout(model)
    refuse_random(model, torch.rand(2, 6))  # two calls after the switch agree: this check cannot see it
    with pytest.raises(ModelError, match=r"attn: Linear -> Identity") as err:
        refuse_changed_layout(layout, model)
    assert "state_dict[attn.weight]: state -> (none)" in err.value.message
    assert "attention_type: original_full" in err.value.hint


def test_a_model_run_twice_unchanged_passes_the_layout_check() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.ReLU()).eval()
    layout = module_layout(model)
    refuse_random(model, torch.rand(2, 6))
    refuse_changed_layout(layout, model)


class _LabelDrop(torch.nn.Module):
    """Classifier-free guidance's label drop left on in eval mode: a mask that rarely fires (p tiny here, so never on
    the rows tried), which training does not change."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(5, 4)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        drop = torch.rand(y.shape[0]) < 1e-12  # the line the error names
        return self.emb(torch.where(drop, torch.zeros_like(y), y))


def test_a_label_drop_that_did_not_fire_is_named_with_the_line_that_drew() -> None:
    """A random mask that did not fire on the rows tried (a label drop) is named as a cause beside noise at a zero
    scale, with the user's line that drew."""
    with pytest.raises(ModelError, match="though its outputs did not move yet") as err:
        refuse_random(_LabelDrop().eval(), torch.tensor([1, 2, 3]), generators=True)
    lines = Path(__file__).read_text().splitlines()
    line = next(n for n, text in enumerate(lines, 1) if "# the line the error names" in text)
    assert re.search(rf"first in forward\(\) at \S*test_determinism\.py:{line},", err.value.message)
    assert "a random mask or branch that did not fire on the rows tried (a label drop" in err.value.message
