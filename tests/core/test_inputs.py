"""kiln.core.inputs: the one random-input maker."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.core.errors import ConfigError, ModelError
from kiln.core.inputs import check_batch_axis, random_inputs, recorded_sizes
from kiln.core.records import TensorSpec


def test_batch_axis_dtypes_and_ranges() -> None:
    specs = [
        TensorSpec(name="ids", shape=["batch", 8], dtype="int64"),
        TensorSpec(name="mask", shape=["batch", 8], dtype="bool"),
        TensorSpec(name="x", shape=[3, 4], dtype="float32"),
    ]
    feed = random_inputs(specs, batch=5, int_high=3)
    assert feed["ids"].shape == (5, 8) and feed["ids"].dtype == np.int64 and feed["ids"].max() <= 3
    assert feed["mask"].dtype == np.bool_ and feed["x"].shape == (3, 4)  # a fixed first axis keeps its size
    again = random_inputs(specs, batch=5, int_high=3)
    assert all(np.array_equal(feed[k], again[k]) for k in feed)  # seeded


def test_other_dynamic_axes_need_a_size() -> None:
    spec = [TensorSpec(name="ids", shape=["batch", "seq"], dtype="int64")]
    with pytest.raises(ConfigError, match="besides the batch axis") as err:
        random_inputs(spec, batch=2, hint="give shapes")
    assert err.value.hint == "give shapes"
    assert random_inputs(spec, batch=2, dynamic=7)["ids"].shape == (2, 7)


def test_an_engines_recorded_ranges_size_the_axes_they_name_and_only_those(caplog: pytest.LogCaptureFixture) -> None:
    specs = [
        TensorSpec(name="ids", shape=["batch", "seq"], dtype="int64"),
        TensorSpec(name="mask", shape=["batch", "seq"], dtype="int64"),
        TensorSpec(name="pixels", shape=["batch", 3, "height"], dtype="float32"),
    ]
    sizes = recorded_sizes(specs, {"seq": [4, 32]})
    assert sizes == {"ids": {1: 32}, "mask": {1: 32}}  # "height" has no recorded range: left out
    assert "seq=32 (of [4, 32])" in caplog.text
    with pytest.raises(ConfigError, match="'pixels' has dynamic axes besides the batch axis"):
        random_inputs(specs, batch=2, dynamic=sizes)
    feed = random_inputs(specs[:2], batch=2, dynamic=sizes)
    assert feed["ids"].shape == (2, 32) and feed["ids"].min() >= 0 and feed["ids"].max() <= 1


def test_only_a_dynamic_batch_axis_is_set() -> None:
    specs = [
        TensorSpec(name="x", shape=["batch", 3, 4], dtype="float32"),
        TensorSpec(name="ids", shape=[0, 5], dtype="int64"),
        TensorSpec(name="fixed", shape=[1, 3], dtype="float32"),
    ]
    feed = random_inputs(specs, batch=7)
    assert feed["x"].shape == (7, 3, 4) and feed["x"].dtype == np.float32
    assert feed["ids"].shape == (7, 5) and set(np.unique(feed["ids"])) <= {0, 1}
    assert feed["fixed"].shape == (1, 3)  # a model exported with batch 1 keeps it


@pytest.mark.parametrize("shape", [["batch", "seq", 4], ["batch", 0, 4]])
def test_unknown_axes_besides_the_batch_are_refused(shape) -> None:
    # Before: `kiln validate` on files filled a 0-sized axis anywhere with the batch size.
    with pytest.raises(ConfigError, match="dynamic axes") as err:
        random_inputs([TensorSpec(name="x", shape=shape, dtype="float32")], batch=2, hint="pass arrays")
    assert err.value.hint == "pass arrays"


def test_largest_sizes_puts_each_axis_at_its_own_largest_size() -> None:
    """An encoder-decoder's source and target axes take different lengths: each gets its own largest, an axis not
    named in the sizes the largest of all; no sizes, no mapping (callers pass their own one size)."""
    from kiln.core.inputs import largest_sizes

    specs = [
        TensorSpec(name="src", shape=["batch", "src"], dtype="int64"),
        TensorSpec(name="tgt", shape=["batch", "tgt"], dtype="int64"),
        TensorSpec(name="extra", shape=["batch", "other", 4], dtype="float32"),
    ]
    sizes = largest_sizes(specs, {"src": [6, 12], "tgt": [3, 6]})
    assert sizes == {"src": {1: 12}, "tgt": {1: 6}, "extra": {1: 12}}
    feed = random_inputs(specs, 2, dynamic=sizes)
    assert feed["src"].shape == (2, 12) and feed["tgt"].shape == (2, 6) and feed["extra"].shape == (2, 12, 4)
    assert largest_sizes(specs, {}) is None


def test_named_sizes_map_axis_names_to_each_input_and_axis() -> None:
    """``signature.shapes`` by the names a graph gives its axes, per input and axis (what ``kiln optimize FILE``
    sizes its safety net's inputs with): an axis it does not name, and the batch, are left out."""
    from kiln.core.inputs import named_sizes

    specs = [
        TensorSpec(name="ids", shape=["batch", "seq"], dtype="int64"),
        TensorSpec(name="mask", shape=["batch", "seq"], dtype="int64"),
        TensorSpec(name="audio", shape=["batch", 1, "samples", "other"], dtype="float32"),
    ]
    sizes = named_sizes(specs, {"seq": [16, 8, 16], "samples": [1600, 800], "batch": [4]})
    assert sizes == {"ids": {1: [8, 16]}, "mask": {1: [8, 16]}, "audio": {2: [800, 1600]}}
    assert named_sizes(specs, {}) == {}


def test_integers_ranged_per_column_take_each_column_s_own_range() -> None:
    """A packed categorical input (column 0 into a 10-row table, column 1 into 1000 rows): each column is drawn in
    its own range, where drawing every column from the widest ran column 0 past its table; at another width the
    columns do not match and the widest range holds; one range draws as before."""
    specs = [TensorSpec(name="sparse", shape=["batch", 2], dtype="int64")]
    feed = random_inputs(specs, batch=400, int_ranges={"sparse": [[0, 9], [-5, 999]]})["sparse"]
    assert feed.dtype == np.int64 and feed[:, 0].min() == 0 and feed[:, 0].max() == 9
    assert feed[:, 1].min() < 0 and feed[:, 1].max() > 900
    wide = [TensorSpec(name="sparse", shape=["batch", 3], dtype="int64")]
    assert random_inputs(wide, batch=400, int_ranges={"sparse": [[0, 9], [-5, 999]]})["sparse"][:, 0].max() > 9
    one = random_inputs(specs, batch=400, int_ranges={"sparse": [0, 9]})["sparse"]
    assert one.min() == 0 and one.max() == 9


def _gnn(nodes: int | str = "nodes", edges: int | str = "edges") -> list[TensorSpec]:
    """A graph neural network's inputs in their own layout: no batch axis."""
    return [
        TensorSpec(name="x", shape=[nodes, 8], dtype="float32"),
        TensorSpec(name="edge_index", shape=[2, edges], dtype="int64"),
    ]


def test_an_input_with_a_fixed_axis_0_beside_a_dynamic_one_is_refused_with_the_batch_of_one_recipe() -> None:
    """edge_index's static 2 was taken for a batch (8 rows of it made, or 0 sliced: ONNX Runtime's traceback)."""
    with pytest.raises(ModelError) as err:
        check_batch_axis(_gnn(), "model.onnx gcn.onnx")
    assert err.value.message == (
        "model.onnx gcn.onnx: input 'edge_index' [2, edges] has a fixed axis 0 (2) while axis 0 of input 'x' "
        "[nodes, 8] is dynamic: Kiln takes axis 0 of every input as the batch, and these inputs have no common one"
    )
    hint = err.value.hint or ""
    assert "x [1, nodes, 8], edge_index [1, 2, edges]" in hint and "x[0], edge_index[0]" in hint
    assert "signature.batch_sizes: [1]" in hint and "unbatched" in hint


def test_inputs_fixed_at_different_sizes_are_refused() -> None:
    with pytest.raises(ModelError, match=r"fix axis 0 at different sizes \('x' \[200, 8\], 'edge_index' \[2, 988\]\)"):
        check_batch_axis(_gnn(200, 988), "model.onnx gcn.onnx")


def test_inputs_sharing_a_batch_axis_pass() -> None:
    """A symbolic batch on every input, or one fixed size on every input (a published file's batch of 1)."""
    check_batch_axis([TensorSpec(name=s.name, shape=["batch", *s.shape], dtype=s.dtype) for s in _gnn()], "m")
    check_batch_axis([TensorSpec(name=s.name, shape=[1, *s.shape], dtype=s.dtype) for s in _gnn(200, 988)], "m")
    check_batch_axis(
        [TensorSpec(name="x", shape=[1, 8], dtype="float32"), TensorSpec(name="t", shape=[1], dtype="float32")], "m"
    )
    check_batch_axis([TensorSpec(name=n, shape=["T", "batch", 2], dtype="float32") for n in ("x", "m")], "m")


def test_an_input_without_axes_is_refused_with_a_batch_axis_fix() -> None:
    """Before: left out here, a bool flag of shape [] ended in `TypeError: expected np.ndarray (got numpy.bool_)`
    and an int64 trip count in `IndexError: slice() cannot be applied to a 0-dim tensor`, Kiln's own slicing."""
    specs = [
        TensorSpec(name="x", shape=["batch", 8], dtype="float32"),
        TensorSpec(name="use_alt", shape=[], dtype="bool"),
    ]
    with pytest.raises(ModelError) as err:
        check_batch_axis(specs, "model.onnx if.onnx")
    assert err.value.message.startswith("model.onnx if.onnx: input 'use_alt' has no axes (shape []): Kiln takes axis 0")
    assert (err.value.hint or "").startswith("export the model taking use_alt [batch], a batch axis first")


def test_an_input_fixed_at_1_beside_a_dynamic_batch_is_refused() -> None:
    """Before: left out as broadcasting over the batch, though every feed gives it a row per sample: ONNX Runtime's
    "Got: 8 Expected: 1", or a TensorRT profile error about settings the user never made."""
    specs = [
        TensorSpec(name="x", shape=["batch", 8], dtype="float32"),
        TensorSpec(name="t", shape=[1], dtype="float32"),
    ]
    with pytest.raises(ModelError) as err:
        check_batch_axis(specs, "model.onnx temp.onnx")
    assert err.value.message == (
        "model.onnx temp.onnx: input 't' [1] has a fixed axis 0 of 1 while input 'x' [batch, 8] takes a batch "
        "there: Kiln takes axis 0 of every input as the batch, and these inputs have no common one"
    )
    assert (err.value.hint or "").startswith("export the model taking t [batch], a batch axis first")


@pytest.mark.parametrize(
    "shapes",
    [
        {"x": [5, "batch", 2], "h0": [1, "batch", 3]},  # a time-major RNN: its batch is axis 1
        {"x": ["T", "batch", 2], "h0": [1, "batch", 3]},
    ],
)
def test_a_time_major_rnns_inputs_are_refused_with_the_batch_first_fix(shapes: dict) -> None:
    """Before: passed here, then h0 was fed a row per sample (ONNX Runtime's traceback in the export, or h0 [0, ...]
    in `kiln precision`)."""
    with pytest.raises(ModelError) as err:
        check_batch_axis([TensorSpec(name=n, shape=s, dtype="float32") for n, s in shapes.items()], "m")
    x = _written_first(shapes["x"])
    assert f"with the shared axis 'batch' first (x {x}, h0 [batch, 1, 3])" in (err.value.hint or "")
    assert "x.movedim(0, 1)" in (err.value.hint or "")


def _written_first(shape: list) -> str:
    return "[" + ", ".join(str(d) for d in ["batch", shape[0], *shape[2:]]) + "]"


def test_random_booleans_without_axes_are_an_array() -> None:
    """The optimizer's safety net feeds ONNX Runtime, which takes arrays, not a numpy scalar."""
    feed = random_inputs([TensorSpec(name="flag", shape=[], dtype="bool")], batch=4)
    assert isinstance(feed["flag"], np.ndarray) and feed["flag"].shape == ()


def test_a_float_input_with_an_index_range_is_drawn_as_whole_numbers_within_it() -> None:
    """A float timestep the graph casts to an index (a diffusion model's ``emb(t.long())``) records a range: random
    inputs hold whole numbers within it, which the engine's own check accepts; standard normal values (-1.3) it
    refuses. A float input without a range stays standard normal."""
    specs = [
        TensorSpec(name="t", dtype="float32", shape=["batch"]),
        TensorSpec(name="x", dtype="float32", shape=["batch", 4]),
    ]
    feed = random_inputs(specs, 64, int_ranges={"t": [0, 999]})
    t = feed["t"]
    assert t.dtype == np.float32 and (t == np.round(t)).all() and t.min() >= 0 and t.max() <= 999 and t.max() > 1
    assert (feed["x"] != np.round(feed["x"])).any()
