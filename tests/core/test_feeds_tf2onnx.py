"""The fixes read_feed gives for a tf2onnx file's inputs: names that are no Python identifier
(``serving_default_input_1:0``), NHWC images given as NCHW, and one sample without its batch axis."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from kiln.core.errors import InputFileError
from kiln.core.feeds import check_feed, read_feed
from kiln.core.records import TensorSpec

NAME = "serving_default_input_1:0"
NHWC = [TensorSpec(name=NAME, shape=["unk__42", 32, 32, 3], dtype="float32")]


def _hint(path: Path, specs: list[TensorSpec], arrays: dict[str, np.ndarray]) -> str:
    """The fix read_feed gives for an .npz of ``arrays``."""
    np.savez(path, **arrays)
    with pytest.raises(InputFileError) as err:
        read_feed(path, specs, "the model")
    return err.value.hint


def _savez_call(hint: str) -> str:
    """The ``np.savez(...)`` a hint ends with, checked to parse as Python."""
    call = hint[hint.index("np.savez(") :]
    ast.parse(call)  # a SyntaxError fails the test
    return call


def test_input_names_that_are_no_identifiers_are_given_as_a_dict(tmp_path: Path) -> None:
    """``np.savez(path, serving_default_input_1:0=...)`` does not parse: the fix spells the names as dict keys."""
    specs = [*NHWC, TensorSpec(name="mask", shape=["unk__42", 4], dtype="float32")]
    call = _savez_call(_hint(tmp_path / "x.npz", specs, {"other": np.zeros((1, 4), np.float32)}))
    assert call == 'np.savez(path, **{"serving_default_input_1:0": ..., "mask": ...})'


def test_names_that_are_identifiers_keep_the_keyword_form(tmp_path: Path) -> None:
    specs = [TensorSpec(name=n, shape=["batch", 4], dtype="float32") for n in ("ids", "mask")]
    call = _savez_call(_hint(tmp_path / "x.npz", specs, {"other": np.zeros((1, 4), np.float32)}))
    assert call == "np.savez(path, ids=..., mask=...)"
    keyword = [TensorSpec(name="lambda", shape=["batch", 4], dtype="float32")]  # an identifier, yet a keyword
    assert _savez_call(_hint(tmp_path / "y.npz", keyword, {})) == 'np.savez(path, **{"lambda": ...})'


def test_an_nchw_array_for_an_nhwc_input_is_told_the_transpose(tmp_path: Path) -> None:
    images = np.random.default_rng(0).random((64, 3, 32, 32)).astype(np.float32)
    hint = _hint(tmp_path / "x.npz", NHWC, {NAME: images})
    assert hint == (
        "give it as float32[unk__42, 32, 32, 3] (it looks like NCHW, and the model takes NHWC: x.transpose(0, 2, 3, 1))"
    )
    np.savez(tmp_path / "y.npz", **{NAME: images.transpose(0, 2, 3, 1)})  # the fix, as written
    assert read_feed(tmp_path / "y.npz", NHWC, "the model")[NAME].shape == (64, 32, 32, 3)


def test_the_transpose_follows_the_actual_permutation() -> None:
    """NHWC given for NCHW, and axes in an order no layout names; a torch tensor's data are told ``permute``."""
    nchw = [TensorSpec(name="image", shape=["batch", 3, 8, 6], dtype="float32")]
    with pytest.raises(InputFileError) as err:
        check_feed({"image": np.zeros((2, 8, 6, 3), np.float32)}, nchw, "the data", "the model")
    assert err.value.hint == (
        "give it as float32[batch, 3, 8, 6] (it looks like NHWC, and the model takes NCHW: x.transpose(0, 3, 1, 2); "
        "a torch tensor: x.permute(0, 3, 1, 2))"
    )
    seq = [TensorSpec(name="x", shape=["batch", 5, 7], dtype="float32")]
    with pytest.raises(InputFileError) as err:
        check_feed({"x": np.zeros((2, 7, 5), np.float32)}, seq, "the data", "the model", npz=True)
    assert err.value.hint == "give it as float32[batch, 5, 7] (its axes are in another order: x.transpose(0, 2, 1))"


def test_one_sample_without_its_batch_axis_is_told_to_add_it(tmp_path: Path) -> None:
    image = np.zeros((32, 32, 3), np.float32)
    hint = _hint(tmp_path / "x.npz", NHWC, {NAME: image})
    assert hint == "give it as float32[unk__42, 32, 32, 3] (one sample without its batch axis: x[None])"
    np.savez(tmp_path / "y.npz", **{NAME: image[None]})  # the fix, as written
    assert read_feed(tmp_path / "y.npz", NHWC, "the model")[NAME].shape == (1, 32, 32, 3)


def test_a_shape_that_is_no_permutation_gets_the_shape_alone(tmp_path: Path) -> None:
    hint = _hint(tmp_path / "x.npz", NHWC, {NAME: np.zeros((64, 3, 28, 28), np.float32)})
    assert hint == "give it as float32[unk__42, 32, 32, 3]"
