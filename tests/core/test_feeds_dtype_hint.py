"""The fix for an input given in the wrong dtype converts it without changing what its values mean."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kiln.core.errors import InputFileError
from kiln.core.feeds import check_feed, read_feed
from kiln.core.records import TensorSpec

IMAGE = [TensorSpec(name="image", shape=["batch", 3, 4, 4], dtype="uint8")]
IDS = [TensorSpec(name="ids", shape=["batch", 6], dtype="int64")]


def _hint(path: Path, specs: list[TensorSpec], **arrays: np.ndarray) -> str:
    """The fix read_feed gives for an .npz of ``arrays``."""
    np.savez(path, **arrays)
    with pytest.raises(InputFileError) as err:
        read_feed(path, specs, "the model")
    return err.value.hint


def test_float_intensities_in_0_1_for_a_uint8_image_are_scaled_not_cast(tmp_path: Path) -> None:
    """x.astype('uint8') turned every pixel of an image in [0, 1] into 0 (or 1)."""
    image = np.random.default_rng(0).random((2, 3, 4, 4)).astype(np.float32)
    hint = _hint(tmp_path / "x.npz", IMAGE, image=image)
    fix = "(x * 255).round().astype('uint8')"
    assert hint.startswith(f"give it as uint8[batch, 3, 4, 4], e.g. {fix}"), hint
    assert "x.astype" not in hint and "torch" not in hint, hint  # an .npz holds numpy arrays
    np.savez(tmp_path / "y.npz", image=(image * 255).round().astype("uint8"))  # the fix, as written
    assert read_feed(tmp_path / "y.npz", IMAGE, "the model")["image"].max() > 1  # the fix keeps the pixels


def test_floats_with_fractions_get_no_cast_that_cuts_them_off(tmp_path: Path) -> None:
    ids = np.random.default_rng(0).random((2, 6)) * 5  # not whole numbers: no cast makes them ids
    hint = _hint(tmp_path / "x.npz", IDS, ids=ids)
    assert "astype" not in hint and "fractions" in hint, hint
    pixels = np.random.default_rng(0).random((2, 3, 4, 4)) * 300  # past uint8's 255
    hint = _hint(tmp_path / "y.npz", IMAGE, image=pixels.round())
    assert "astype" not in hint and "outside what uint8 holds" in hint, hint
    whole = _hint(tmp_path / "z.npz", IDS, ids=np.arange(12, dtype=np.float64).reshape(2, 6))
    assert whole == "give it as int64[batch, 6], e.g. x.astype('int64')"  # whole numbers cast as they are


def test_a_data_functions_arrays_get_the_torch_conversion_too() -> None:
    """Arrays that may come from a data function's tensors: the fix says the torch tensor's conversion beside
    numpy's."""
    ids = torch.arange(12, dtype=torch.int32).reshape(2, 6).numpy()
    with pytest.raises(InputFileError) as err:
        check_feed({"ids": ids}, IDS, "dataset 'mine:load' val_x", "model.onnx m.onnx")
    assert err.value.hint == "give it as int64[batch, 6], e.g. x.astype('int64') (a torch tensor: x.to(torch.int64))"


@pytest.mark.parametrize("fill", ["all", "some"])
def test_floats_with_nan_get_no_cast_to_an_integer_input(tmp_path: Path, fill: str) -> None:
    """x.astype('int64') turned NaN into -9223372036854775808; the fix now says the data holds NaN."""
    ids = np.full((2, 6), np.nan) if fill == "all" else np.arange(12, dtype=np.float64).reshape(2, 6)
    ids[0, 1] = np.nan
    hint = _hint(tmp_path / "x.npz", IDS, ids=ids)
    assert "astype" not in hint and "NaN" in hint, hint
    inf = _hint(tmp_path / "y.npz", IMAGE, image=np.full((2, 3, 4, 4), np.inf, np.float32))
    assert "astype" not in inf and "infinite" in inf, inf
