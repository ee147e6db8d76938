"""A checkpoint loaded without its wrapper's prefix: warned of where the wrapper has a forward of its own, said as
information where it runs its module unchanged (DDP, torch.compile)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from kiln.models.model_io import load_weights


def _wrapped_state(prefix: str) -> dict[str, torch.Tensor]:
    return {prefix + k: v.clone() for k, v in nn.Linear(2, 3).state_dict().items()}


def test_a_guidance_wrappers_checkpoint_given_to_its_module_is_warned_of(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="kiln"):
        load_weights(nn.Linear(2, 3), _wrapped_state("unet."), "cfg.safetensors")
    said = [r for r in caplog.records if "carry the prefix 'unet.'" in r.getMessage()]
    assert said and said[0].levelno == logging.WARNING, caplog.text
    assert "give the wrapper as the model" in said[0].getMessage()


@pytest.mark.parametrize("prefix", ["module.", "_orig_mod.", "module._orig_mod."])
def test_a_ddp_or_compiled_checkpoint_is_said_as_information(prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="kiln"):
        load_weights(nn.Linear(2, 3), _wrapped_state(prefix), "w.pt")
    said = [r for r in caplog.records if f"carry the prefix '{prefix}'" in r.getMessage()]
    assert said and said[0].levelno == logging.INFO, caplog.text
