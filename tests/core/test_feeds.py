"""Named input arrays from an .npz checked against the inputs a model declares."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kiln.core.errors import InputFileError
from kiln.core.feeds import read_feed
from kiln.core.records import TensorSpec

FIXED = [TensorSpec(name="image", shape=[1, 3, 4, 4], dtype="float32")]


def test_rows_on_a_fixed_batch_axis_name_the_batch_and_how_to_free_it(tmp_path: Path) -> None:
    path = tmp_path / "x.npz"
    np.savez(path, image=np.zeros((40, 3, 4, 4), np.float32))
    with pytest.raises(InputFileError, match=r"has 40 rows; the model fixes its batch axis at 1") as err:
        read_feed(path, FIXED, "the model")
    assert "dynamic batch axis" in err.value.hint
    np.savez(path, image=np.zeros((1, 3, 4, 4), np.float32))
    assert read_feed(path, FIXED, "the model")["image"].shape == (1, 3, 4, 4)


def test_another_size_besides_the_batch_is_said_as_the_shape_it_takes(tmp_path: Path) -> None:
    path = tmp_path / "x.npz"
    np.savez(path, image=np.zeros((40, 3, 5, 4), np.float32))
    with pytest.raises(InputFileError, match=r"is float32\[40, 3, 5, 4\]; the model takes float32\[1, 3, 4, 4\]"):
        read_feed(path, FIXED, "the model")


def test_the_fix_casts_only_where_the_dtype_is_what_differs(tmp_path: Path) -> None:
    """A wrong shape in the right dtype was told to `x.astype('float32')`, which changes nothing."""
    spec = [TensorSpec(name="image", shape=["batch", 3, 4, 4], dtype="float32")]
    path = tmp_path / "x.npz"
    np.savez(path, image=np.zeros((2, 3, 5, 4), np.float32))
    with pytest.raises(InputFileError) as err:
        read_feed(path, spec, "the model")
    assert err.value.hint == "give it as float32[batch, 3, 4, 4]"
    np.savez(path, image=np.zeros((2, 3, 4, 4), np.float64))
    with pytest.raises(InputFileError) as err:
        read_feed(path, spec, "the model")
    assert err.value.hint == "give it as float32[batch, 3, 4, 4], e.g. x.astype('float32')"
