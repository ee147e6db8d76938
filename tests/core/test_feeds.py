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


TWO_TOWER = [
    TensorSpec(name="input_ids", shape=["texts", "seq"], dtype="int64"),
    TensorSpec(name="attention_mask", shape=["texts", "seq"], dtype="int64"),
    TensorSpec(name="pixel_values", shape=["images", 3, 4, 4], dtype="float32"),
]


def _two_tower_npz(path: Path, texts: int, masks: int, images: int) -> Path:
    np.savez(
        path,
        input_ids=np.ones((texts, 8), np.int64),
        attention_mask=np.ones((masks, 8), np.int64),
        pixel_values=np.zeros((images, 3, 4, 4), np.float32),
    )
    return path


def test_inputs_on_first_axes_of_their_own_take_counts_of_their_own(tmp_path: Path) -> None:
    """10 texts beside 3 images, as the engine's `infer` and `kiln serve` take them. Before: refused for 'different
    row counts', with the fix to give every input one row per sample."""
    feed = read_feed(_two_tower_npz(tmp_path / "x.npz", 10, 10, 3), TWO_TOWER, "the engine", batched=True)
    assert {k: len(v) for k, v in feed.items()} == {"input_ids": 10, "attention_mask": 10, "pixel_values": 3}


def test_inputs_sharing_a_first_axis_take_one_row_count(tmp_path: Path) -> None:
    path = _two_tower_npz(tmp_path / "x.npz", 10, 9, 3)
    with pytest.raises(InputFileError) as err:
        read_feed(path, TWO_TOWER, "the engine")
    assert "different row counts {'input_ids': 10, 'attention_mask': 9} on their shared axis 0 'texts'" in (
        err.value.message
    )
    assert err.value.hint == (
        "give input_ids, attention_mask (axis 0 'texts') one row count; inputs on another axis 0 take counts of "
        "their own (pixel_values on 'images')"
    )
    one_axis = [s.model_copy(update={"shape": ["batch", *s.shape[1:]]}) for s in TWO_TOWER]
    with pytest.raises(InputFileError, match="different row counts") as err:
        read_feed(_two_tower_npz(tmp_path / "y.npz", 10, 10, 3), one_axis, "the engine")
    assert err.value.hint == "give every input one row per sample"


def test_batches_of_inputs_in_counts_of_their_own_hold_rows_of_every_input() -> None:
    """40 texts beside 3 images in batches of 16: each batch holds texts and images, none more than 16 of either."""
    feed = {"texts": np.arange(40), "images": np.arange(3)}
    parts = in_batches(feed, 16)
    assert [(len(p["texts"]), len(p["images"])) for p in parts] == [(14, 1), (13, 1), (13, 1)]
    assert np.concatenate([p["texts"] for p in parts]).tolist() == list(range(40))
    two = in_batches({"texts": np.arange(40), "images": np.arange(2)}, 16)  # fewer images than batches: repeated
    assert [p["images"].tolist() for p in two] == [[0], [1], [0]]


def test_arrays_named_apart_from_the_inputs_are_named(tmp_path: Path) -> None:
    """A file missing one input and holding another under a wrong name says which is which."""
    path = tmp_path / "x.npz"
    np.savez(path, txt=np.zeros((2, 4), np.float32), image=np.zeros((2, 3, 4, 4), np.float32))
    specs = [*FIXED, TensorSpec(name="text", shape=["batch", 4], dtype="float32")]
    with pytest.raises(InputFileError) as err:
        read_feed(path, specs, "the model")
    assert "(missing 'text'; not an input: 'txt')" in err.value.message


def test_integers_given_to_a_float_input_are_told_to_scale_them_too(tmp_path: Path) -> None:
    """A uint8 image given to a float32 input was told only to cast it, which feeds 0-255 to a model of 0-1."""
    spec = [TensorSpec(name="image", shape=["batch", 3, 4, 4], dtype="float32")]
    path = tmp_path / "x.npz"
    np.savez(path, image=np.full((2, 3, 4, 4), 200, np.uint8))
    with pytest.raises(InputFileError) as err:
        read_feed(path, spec, "the model")
    assert "scale the values as the model expects" in err.value.hint
    assert "x.astype('float32') / 255" in err.value.hint
    np.savez(path, image=np.full((2, 3, 4, 4), 7, np.int64))
    with pytest.raises(InputFileError) as err:
        read_feed(path, spec, "the model")
    assert "scale the values as the model expects" in err.value.hint and "/ 255" not in err.value.hint


def test_a_batch_level_scalar_is_stacked_one_value_a_batch() -> None:
    """A 0-D output (an aux loss over the batch) has no rows to join: one value per batch run."""
    feed = {"x": np.arange(10, dtype=np.float32)[:, None]}
    out = run_batched(lambda f: {"y": f["x"] * 2, "loss": np.float32(f["x"].mean())}, feed, 4)
    assert out["y"].shape == (10, 1) and out["loss"].shape == (3,)
    assert np.allclose(out["loss"], [1.5, 5.5, 8.5])
