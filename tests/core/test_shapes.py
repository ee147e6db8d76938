"""The shapes validation runs at: sizes of each dynamic axis, the points, and resizing real inputs to them."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.core.errors import ConfigError
from kiln.core.records import TensorSpec
from kiln.core.shapes import axis_sizes, copy_step, graph_axes, resize, shape_points

IGNORE = -100

AXES = {"ids": {1: "seq"}, "mask": {1: "seq"}}
SECOND = 1 - (5**0.5 - 1) / 2  # the second copy's share of its step (the first copy's is 1)


def feed(seq: int) -> dict[str, np.ndarray]:
    return {"ids": np.arange(2 * seq).reshape(2, seq) + 1, "mask": np.ones((2, seq), np.int64)}


def test_shapes_for_undeclared_axes_say_to_declare_them_or_to_key_by_the_declared_ones() -> None:
    """signature.shapes {seq: [40]} with no signature.dynamic_axes: the fix is to declare the axis (or drop the
    shapes), not to key the shapes by the declared names with the failing value as the example."""
    with pytest.raises(ConfigError) as info:
        axis_sizes([feed(16)], {}, {"seq": [40]})
    assert info.value.hint == (
        "declare seq in signature.dynamic_axes, by input and axis (e.g. {input_ids: {1: seq}}), and export again; "
        "or leave signature.shapes out"
    )
    with pytest.raises(ConfigError) as info:
        axis_sizes([feed(16)], AXES, {"len": [4]})
    assert info.value.hint == "key signature.shapes by the axis names of signature.dynamic_axes, e.g. {seq: [8, 32]}"


def test_sizes_from_the_data_or_the_config() -> None:
    assert axis_sizes([feed(16)], AXES, {}) == {"seq": [8, 16]}  # one size in the data: half and all of it
    assert axis_sizes([feed(12), feed(16)], AXES, {}) == {"seq": [12, 16]}
    assert axis_sizes([feed(16)], AXES, {"seq": [32, 4]}) == {"seq": [4, 32]}
    with pytest.raises(ConfigError, match="signature.shapes names axes \\['len'\\]"):
        axis_sizes([feed(16)], AXES, {"len": [4]})
    assert shape_points({"seq": [8, 16]}) == [{"seq": 8}, {"seq": 16}] and shape_points({}) == [{}]
    # two axes: paired, plus each at its smallest beside the other's largest (a decode step: 1 new token, 32 past),
    # the largest together last
    assert shape_points({"new": [1, 4], "past": [1, 32]}) == [
        {"new": 1, "past": 1},
        {"new": 1, "past": 32},
        {"new": 4, "past": 1},
        {"new": 4, "past": 32},
    ]


def test_resize_cuts_or_repeats_every_tied_axis() -> None:
    short, long = resize(feed(16), AXES, {"seq": 4}), resize(feed(16), AXES, {"seq": 20})
    assert short["ids"].shape == short["mask"].shape == (2, 4) and (short["ids"] == feed(16)["ids"][:, :4]).all()
    assert long["mask"].shape == (2, 20) and long["mask"].all()
    assert (long["ids"][:, 16:] == feed(16)["ids"][:, :4]).all()


def test_graph_axes_are_the_symbolic_dims_after_batch() -> None:
    specs = [
        TensorSpec(name="ids", shape=["batch", "seq"], dtype="int64"),
        TensorSpec(name="x", shape=["b", 3], dtype="float32"),
    ]
    assert graph_axes(specs) == {"ids": {1: "seq"}}


def test_a_float_input_lengthened_for_validation_repeats_itself_and_the_inputs_beside_it_alike() -> None:
    """Audio made longer by silence, a point cloud by points at the origin: inputs the data never held, on which
    gates judged engines (an INT8 Wav2Vec2 dropped for clips three quarters silent)."""
    feed = {"audio": np.array([[1.0, 2.0, 3.0]], np.float32), "ids": np.array([[5, 6, 7]], np.int64)}
    axes = {"audio": {1: "t"}, "ids": {1: "t"}}
    longer = resize(feed, axes, {"t": 7}, repeat_floats=True)
    step = copy_step(feed["audio"], 1)  # the first copy a step of the clip's spread above it, the next a share
    assert np.allclose(longer["audio"], [[1, 2, 3, 1 + step, 2 + step, 3 + step, 1 + SECOND * step]])
    assert longer["ids"].tolist() == [[5, 6, 7, 5, 6, 7, 5]]
    padded = resize(feed, axes, {"t": 5})  # the default: a float axis padded, every input on it alike
    assert padded["audio"].tolist() == [[1, 2, 3, 0, 0]] and padded["ids"].tolist() == [[5, 6, 7, 0, 0]]
    assert resize(feed, axes, {"t": 2}, repeat_floats=True)["audio"].tolist() == [[1, 2]]


LM_AXES = {"input_ids": {1: "seq"}, "attention_mask": {1: "seq"}}


def lm_feed(pad: int = 0, left: bool = False) -> dict[str, np.ndarray]:
    """Two rows of 3 and 5 real tokens (ids 10 and up) in arrays of 6, padded with ``pad`` on the right or left."""
    mask = np.array([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0]], np.int64)
    mask = mask[:, ::-1].copy() if left else mask
    ids = np.where(mask == 1, np.arange(12).reshape(2, 6) + 10, pad)
    return {"input_ids": ids, "attention_mask": mask}


def test_tokens_lengthened_past_the_data_are_real_tokens_that_the_comparison_reads() -> None:
    """Ids padded with 0 beside a mask padded with 0 made every position past the data's length padding, which
    the comparisons leave out: an engine wrong only there passed, and its whole range was recorded as validated."""
    from kiln.core.labels import without_padding

    data = lm_feed()
    longer = resize(data, LM_AXES, {"seq": 15}, repeat_floats=True)
    # each row repeats its own real tokens (3 and 5 of them): no padding lands mid-row, as tiling whole rows put it
    assert (
        longer["input_ids"][0].tolist() == [10, 11, 12] * 5
        and longer["input_ids"][1].tolist() == [16, 17, 18, 19, 20] * 3
    )
    assert longer["attention_mask"].all()
    ref = np.ones((2, 15, 4), np.float32)
    late = ref.copy()
    late[:, 6:] += 1000.0  # wrong at every position past the data's length only
    kept = without_padding(longer, {"logits": ref}), without_padding(longer, {"logits": late})
    assert not np.array_equal(kept[0]["logits"], kept[1]["logits"])
    unpadded = lm_feed()
    unpadded["attention_mask"][:] = 1  # rows without padding tile whole, as before
    assert (resize(unpadded, LM_AXES, {"seq": 15})["input_ids"] == unpadded["input_ids"][:, np.arange(15) % 6]).all()


def test_cutting_left_padded_rows_keeps_their_real_tokens_at_the_end() -> None:
    """Left-padded rows (a batch padded for generation) hold their real tokens at the end: a cut that kept the
    first positions kept padding only, and a shape with nothing to compare passed."""
    left, right = lm_feed(left=True), lm_feed()
    cut = resize(left, LM_AXES, {"seq": 2})
    assert cut["attention_mask"].all() and (cut["input_ids"] == left["input_ids"][:, 4:]).all()
    assert (resize(right, LM_AXES, {"seq": 2})["input_ids"] == right["input_ids"][:, :2]).all()  # as before
    labels = np.where(left["attention_mask"] == 1, 7, IGNORE)
    # labels resized alone follow the ids when told the axes their data pads on the left
    assert (resize({"y": labels}, {"y": {1: "seq"}}, {"seq": 2}, left={"seq"})["y"] == 7).all()


def test_padding_still_added_takes_the_data_pad_token() -> None:
    """A model that pools its last token that is not the pad token (a Llama classifier padded with eos) reads a
    0 past the data as a real token: where an axis is padded, the ids take the pad the data holds."""
    data = {**lm_feed(pad=2), "frames": np.ones((2, 6), np.float32)}
    axes = {**LM_AXES, "frames": {1: "seq"}}
    padded = resize(data, axes, {"seq": 8})  # a float input and no repeat_floats: padded
    assert (padded["input_ids"][:, 6:] == 2).all() and not padded["attention_mask"][:, 6:].any()
    assert (padded["frames"][:, 6:] == 0).all()


def test_repeated_float_copies_hold_no_value_of_the_data_so_no_score_ties_with_it() -> None:
    """An 8x8 image grown to 12x12 by exact copies held each pixel twice: a detector's peaks tied, and PyTorch's and
    ONNX Runtime's top-k ordered them apart, failing a right graph. Each copy is shifted (zeros too), differently
    along each axis; integer inputs and a float mask still repeat exactly."""
    image = np.random.default_rng(0).random((2, 3, 8, 8)).astype(np.float32)
    image[:, :, :2] = 0.0  # zeros move too
    flags = np.array([[1.0, 1.0, 0.0]], np.float32)
    feed = {"image": image, "grid": np.arange(2 * 64).reshape(2, 1, 8, 8), "attention_mask": flags}
    axes = {"image": {2: "h", 3: "w"}, "grid": {2: "h", 3: "w"}, "attention_mask": {1: "t"}}
    grown = resize(feed, axes, {"h": 12, "w": 12, "t": 5}, repeat_floats=True)
    assert np.array_equal(grown["image"][:, :, :8, :8], image)
    assert not np.isin(grown["image"][:, :, 8:], image).any() and not np.isin(grown["image"][..., 8:], image).any()
    # the copy below and the copy to the right hold the same pixels, each moved by its own axis's step
    below, right = grown["image"][:, :, 8:, :4], grown["image"][:, :, :4, 8:]
    assert np.abs(below - right).min() > 1e-4 * image.std()
    assert np.array_equal(grown["grid"], feed["grid"][:, :, np.arange(12) % 8][..., np.arange(12) % 8])
    assert grown["attention_mask"].tolist() == [[1, 1, 0, 1, 1]]


def test_rows_repeating_their_real_positions_shift_each_float_copy_and_keep_their_mask() -> None:
    """A clip padded at its end plays again from its start, each replay shifted; its mask and ids stay exact."""
    mask = np.array([[1, 1, 1, 0, 0, 0]], np.int64)
    feed = {"audio": np.array([[0.0, 1.0, 2.0, 0.0, 0.0, 0.0]], np.float32), "attention_mask": mask}
    axes = {"audio": {1: "t"}, "attention_mask": {1: "t"}}
    longer = resize(feed, axes, {"t": 8}, repeat_floats=True)
    step = copy_step(feed["audio"], 1)
    assert step > 0 and longer["attention_mask"].tolist() == [[1] * 8]
    assert np.allclose(longer["audio"], [[0, 1, 2, step, 1 + step, 2 + step, SECOND * step, 1 + SECOND * step]])


def test_the_shift_of_many_copies_stays_within_one_step_and_no_two_copies_share_one() -> None:
    """4 real samples grown to 4096: each copy moved one step further than the one before drifted 1.3 standard
    deviations from the data; shifted up or down, every copy is within a step of it, each by its own amount."""
    audio = np.random.default_rng(0).standard_normal((1, 4)).astype(np.float32)
    step = copy_step(audio, 1)
    for sign in (1, -1):
        longer = resize({"audio": audio}, {"audio": {1: "t"}}, {"t": 4096}, repeat_floats=True, step_sign=sign)
        shifts = (longer["audio"].reshape(1024, 4) - audio).mean(axis=1)
        assert shifts[0] == 0 and np.isclose(shifts[1], sign * step, rtol=1e-3)
        assert np.all(np.abs(shifts) <= step * (1 + 1e-3)) and np.all(sign * shifts[1:] > 0)
        assert np.unique(np.round(shifts / step, 5)).size == 1024  # no two copies alike, so no scores tie


@pytest.mark.parametrize(
    "flags",
    [
        np.array([[0.0, -np.inf, 0.0, -np.inf]]),  # an additive mask, not named like one
        np.array([[0.0, -1e9, -1e9, 0.0]]),
        np.array([[1.0, 0.0, 1.0, 1.0]]),
        np.array([[1.0, 1.0, 1.0, 1.0]]),
        np.eye(4)[None, [0, 2, 1, 3]],  # one-hot rows along the grown axis
    ],
)
def test_float_flags_repeat_exactly_where_other_floats_shift(flags: np.ndarray) -> None:
    """A float key_padding_mask's padding 0 became 7e-4 in its copies: a value no client sends. Floats of two values
    at most are flags and repeat as they are, beside a float signal whose copies shift."""
    feed = {"key_padding_mask": flags.astype(np.float32), "x": np.arange(4.0, dtype=np.float32)[None, :]}
    axes = {"key_padding_mask": {1: "t"}, "x": {1: "t"}}
    longer = resize(feed, axes, {"t": 10}, repeat_floats=True)
    assert np.array_equal(longer["key_padding_mask"], feed["key_padding_mask"][:, np.arange(10) % 4])
    assert copy_step(feed["key_padding_mask"], 1) == 0.0 and not np.array_equal(longer["x"][0, 4:8], feed["x"][0])


def test_axes_named_in_the_signature_lie_over_the_graphs_own() -> None:
    """A user who names the one axis a file left unnamed keeps the names the file gives the rest (precision and
    validation both vary them)."""
    from kiln.core.shapes import graph_axes_with

    specs = [
        TensorSpec(name="x", shape=["N", "seq", 8], dtype="float32"),
        TensorSpec(name="z", shape=["N", 0, 8], dtype="float32"),
    ]
    assert graph_axes_with({"z": {1: "zlen"}}, specs) == {"x": {1: "seq"}, "z": {1: "zlen"}}
    assert graph_axes_with({"x": {1: "tokens"}}, specs) == {"x": {1: "tokens"}}
    assert graph_axes_with(None, specs) == {"x": {1: "seq"}}


def test_cutting_rows_left_padded_by_a_padding_mask_keeps_their_real_tokens() -> None:
    """A boolean padding mask (True marks padding, PyTorch's ``src_key_padding_mask``) padded on the left: the cut
    keeps the last positions, the real tokens, as for an attention mask; a cut to the first kept padding only, and
    the exported graph's NaN on such rows failed a good export."""
    pad = np.arange(6)[None, :] < np.array([[4], [2]])  # two rows, 4 and 2 pads first
    data = {"tokens": np.where(pad, 0, np.arange(12).reshape(2, 6) + 1), "padding_mask": pad}
    axes = {"tokens": {1: "seq"}, "padding_mask": {1: "seq"}}
    cut = resize(data, axes, {"seq": 2})
    assert not cut["padding_mask"].any() and (cut["tokens"] == data["tokens"][:, 4:]).all()
    grown = resize({**data, "frames": np.ones((2, 6), np.float32)}, {**axes, "frames": {1: "seq"}}, {"seq": 8})
    assert grown["padding_mask"][:, 6:].all()  # padded where it cannot tile: marked padding, True
