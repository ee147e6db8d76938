"""A training checkpoint holding an object a weights-only load refuses (DiT's train.py saves its argparse args)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
from torch import nn

from kiln.core.errors import InputFileError
from kiln.models.model_io import read_state_dict


def test_a_checkpoint_with_argparse_args_names_the_class_its_keys_and_how_to_save_the_weights(tmp_path: Path) -> None:
    """The error names the class a weights-only load refused and the checkpoint's keys, not torch's advice to load
    with weights_only=False; the fix saves the weights alone."""
    sd = nn.Linear(3, 2).state_dict()
    path = tmp_path / "ckpt.pt"
    torch.save({"model": sd, "ema": sd, "opt": {"lr": 0.1}, "args": argparse.Namespace(depth=2)}, path)
    with pytest.raises(InputFileError) as err:
        read_state_dict(path)
    message, hint = err.value.message, err.value.hint or ""
    assert "argparse.Namespace" in message and "'model', 'ema', 'opt', 'args'" in message
    assert "PyTorch 2.6" not in message and "weights_only` set to `False`" not in message
    assert f"torch.save(torch.load({str(path)!r}, weights_only=False)['model'], 'weights.pt')" in hint
    assert "'model' and 'ema' hold weights" in hint
