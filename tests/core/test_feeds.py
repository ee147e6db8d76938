"""Named input arrays from an .npz checked against the inputs a model declares."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from kiln.core.errors import InputFileError
from kiln.core.feeds import fixed_batch, in_batches, read_feed, run_batched
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


def test_a_fixed_batch_graph_takes_every_row_one_batch_at_a_time(tmp_path: Path) -> None:
    """A batch-1 file (the TorchScript exporter's) was calibrated and validated on one sample: read ``batched``, a
    file of 40 rows is taken whole and fed one row at a time."""
    path = tmp_path / "x.npz"
    images = np.random.default_rng(0).random((40, 3, 4, 4), np.float32)
    np.savez(path, image=images)
    feed = read_feed(path, FIXED, "the model", batched=True)
    assert feed["image"].shape == (40, 3, 4, 4) and fixed_batch(FIXED) == 1
    assert [len(part["image"]) for part in in_batches(feed, 1)] == [1] * 40

    def run(part: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        assert len(part["image"]) == 1  # what the graph takes
        return {"sum": part["image"].sum(axis=(1, 2, 3))}

    assert np.allclose(run_batched(run, feed, fixed_batch(FIXED))["sum"], images.sum(axis=(1, 2, 3)))


def test_rows_past_the_last_whole_batch_are_dropped_with_a_warning(tmp_path: Path, caplog) -> None:
    spec = [TensorSpec(name="image", shape=[4, 3, 4, 4], dtype="float32")]
    path = tmp_path / "x.npz"
    np.savez(path, image=np.zeros((10, 3, 4, 4), np.float32))
    with caplog.at_level(logging.WARNING, logger="kiln"):
        assert read_feed(path, spec, "the model", batched=True)["image"].shape == (8, 3, 4, 4)
    assert "the last 2 are left out" in caplog.text
    np.savez(path, image=np.zeros((3, 3, 4, 4), np.float32))
    with pytest.raises(InputFileError, match="have 3 rows; the model fixes its batch axis at 4"):
        read_feed(path, spec, "the model", batched=True)


def test_only_a_batch_every_input_fixes_alike_is_fixed() -> None:
    assert fixed_batch([TensorSpec(name="x", shape=["batch", 4], dtype="float32")]) is None
    two = [TensorSpec(name="a", shape=[1, 4], dtype="float32"), TensorSpec(name="b", shape=[2, 4], dtype="float32")]
    assert fixed_batch(two) is None
