"""The check that a model answers the same inputs alike from call to call in eval mode says what it found in words
that fit each cause it cannot tell apart: random draws, and a state kept in a plain attribute."""

from __future__ import annotations

import pytest
import torch

from kiln.core.errors import ModelError
from kiln.models.determinism import refuse_random
from tests.models.random_models import sampling


@pytest.mark.parametrize("how", ["randn", "counter"])
def test_draws_and_a_counter_in_an_attribute_are_both_named(how: str) -> None:
    with pytest.raises(ModelError, match="differently from call to call in eval mode") as err:
        refuse_random(sampling(how).eval(), torch.rand(2, 6))
    assert "draws random numbers" in err.value.message
    assert "keeps a state from call to call in an attribute (self.calls += 1)" in err.value.message
    assert "return the deterministic value at inference" in err.value.hint and "keep no state" in err.value.hint


def test_a_vae_that_returns_mu_passes() -> None:
    refuse_random(sampling("mean").eval(), torch.rand(2, 6))
