"""A checkpoint file that is not there: the error names what the user gave it with (``--checkpoint`` in a direct
command, the config key ``model.checkpoint`` otherwise), so the fix points at what they wrote."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.core.errors import InputFileError
from kiln.models.model_io import read_state_dict


def test_a_missing_checkpoint_given_by_a_flag_names_the_flag(tmp_path: Path) -> None:
    with pytest.raises(InputFileError) as err:
        read_state_dict(tmp_path / "nope.safetensors", given="--checkpoint")
    said = f"{err.value.message}\n{err.value.hint}"
    assert "nope.safetensors (given by --checkpoint)" in err.value.message, said
    assert (err.value.hint or "").startswith("give --checkpoint the path"), said
    assert "model.checkpoint" not in said, said


def test_a_missing_checkpoint_of_the_config_names_its_key(tmp_path: Path) -> None:
    with pytest.raises(InputFileError) as err:
        read_state_dict(tmp_path / "nope.pt")
    assert "(given by model.checkpoint)" in err.value.message and "model.checkpoint" in (err.value.hint or "")
