"""The check that a model answers the same inputs alike from call to call in eval mode says what it found in words
that fit each cause it cannot tell apart: random draws, and a state kept in a plain attribute."""

from __future__ import annotations

import pytest
import torch

from kiln.core.errors import ModelError
from kiln.models.determinism import refuse_random
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
