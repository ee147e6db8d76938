"""kiln.core.records: files written and read through typed records; damaged ones refused clearly."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kiln.core.errors import InputFileError
from kiln.core.records import (
    SCHEMA_VERSION,
    Baseline,
    EngineMetadata,
    EngineSource,
    EngineValidation,
    Percentiles,
    TensorSpec,
    ValidationResult,
)


def _meta() -> EngineMetadata:
    spec = TensorSpec(name="input", shape=["batch", 4], dtype="float32")
    return EngineMetadata(
        name="e",
        backend="onnxruntime",
        device="cpu",
        precision="fp32",
        inputs=[spec],
        outputs=[spec],
        source=EngineSource(file="m.onnx", sha256="0" * 64),
        files={"model": "engine.onnx"},
        flavour="onnxruntime",
        versions={"onnxruntime": "1"},
    )


def test_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "kiln-engine.json"
    _meta().write(path)
    assert EngineMetadata.read(path, hint="rebuild") == _meta()
    assert json.loads(path.read_text())["schema_version"] == SCHEMA_VERSION


@pytest.mark.parametrize(
    "damage, needle",
    [
        (lambda d: "{not json", "not JSON"),
        (lambda d: json.dumps({**d, "backend": 7}), "backend"),
        (lambda d: json.dumps({k: v for k, v in d.items() if k != "inputs"}), "inputs"),
        (lambda d: json.dumps({**d, "surprise": 1}), "surprise"),
        (lambda d: json.dumps({**d, "schema_version": SCHEMA_VERSION + 1}), "schema version"),
        (lambda d: json.dumps([d]), "not a valid EngineMetadata"),
    ],
)
def test_damaged_files_are_refused_with_the_reason(tmp_path: Path, damage, needle: str) -> None:
    path = tmp_path / "kiln-engine.json"
    _meta().write(path)
    path.write_text(damage(json.loads(path.read_text())))
    with pytest.raises(InputFileError, match=needle) as err:
        EngineMetadata.read(path, hint="rebuild the engine")
    assert err.value.hint == "rebuild the engine"


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(InputFileError, match="missing"):
        EngineMetadata.read(tmp_path / "nope.json", hint="x")


def test_max_batch_from_the_batch_range() -> None:
    meta = _meta()
    assert meta.max_batch() is None
    meta.batch_range = (1, 16)
    assert meta.max_batch() == 16


def test_batches_past_the_largest_validated_are_refused_and_bound_the_served_batch() -> None:
    """Validation compared the engine at batches 1 and 8: servers form no larger batch and refuse a request of more
    rows, though the engine itself would run it."""
    meta = _meta()
    meta.validated_batch_sizes = [1, 8]
    assert meta.validated_max_batch() == 8 and meta.max_batch() == 8
    meta.batch_range = (1, 4)  # a profile smaller than what was validated: the profile bounds it
    assert meta.max_batch() == 4
    meta.batch_range = None
    assert meta.refusal({"input": np.zeros((8, 4), np.float32)}) is None
    assert meta.refusal({"input": np.zeros((9, 4), np.float32)}) == (
        "input 'input' has 9 rows: engine e was validated for batches up to 8"
    )
    meta.inputs = [TensorSpec(name="input", shape=[16, 4], dtype="float32")]  # a fixed batch: nothing to hold
    assert meta.outside_batch({"input": (16, 4)}) is None


def test_metadata_without_validated_batches_loads_and_bounds_nothing(tmp_path: Path) -> None:
    """A kiln-engine.json written before validated batches were recorded: the engine's own batch range alone."""
    path = tmp_path / "kiln-engine.json"
    _meta().write(path)
    data = json.loads(path.read_text())
    data.pop("validated_batch_sizes")
    path.write_text(json.dumps(data))
    meta = EngineMetadata.read(path, hint="rebuild")
    assert meta.validated_batch_sizes == [] and meta.max_batch() is None
    assert meta.refusal({"input": np.zeros((512, 4), np.float32)}) is None


def test_validation_hands_servers_the_batches_each_engine_was_validated_at() -> None:
    meta = _meta()
    entry = EngineValidation(
        name="e", backend="onnxruntime", precision="fp32", device="cpu", status="validated", batch_sizes=[8, 1]
    )
    baseline = Baseline(accuracy=None, samples=1, latency_ms={})
    result = ValidationResult(passed=True, baseline=baseline, engines=[entry], failures=[], batch_coupled=["y"])
    served = result.served_metadata(meta)
    assert served.validated_batch_sizes == [1, 8] and served.unbatched_outputs == ["y"]
    entry.batch_sizes = []
    older = ValidationResult(passed=True, baseline=baseline, engines=[entry], failures=[])
    assert older.served_metadata(meta) is meta  # a validation.json that predates them: the engine as built


PROBED = "(steps found at export or build, not each validated)"


def test_inputs_outside_the_validated_axis_sizes_are_named() -> None:
    meta = _meta()
    meta.inputs = [TensorSpec(name="ids", shape=["batch", "seq"], dtype="int64")]
    assert meta.outside_range({"ids": (2, 100)}) is None  # no range recorded: nothing to hold it to
    meta.axis_ranges = {"seq": [8, 16]}
    assert meta.outside_range({"ids": (2, 8)}) is None and meta.outside_range({"ids": (64, 16)}) is None
    assert (  # an engine no one validated (kiln build alone) is not said to be validated
        meta.outside_range({"ids": (2, 17)})
        == "input 'ids' axis 1 (seq) is 17: engine e was built for seq from 8 to 16"
    )
    meta.validated_batch_sizes = [1, 64]  # what validation records once it compared the engine
    assert (
        meta.outside_range({"ids": (2, 17)})
        == "input 'ids' axis 1 (seq) is 17: engine e was validated for seq from 8 to 16"
    )
    meta.axis_steps = {"seq": [4, 0]}  # torch.export's h = 4*_h: the sizes between the steps are refused too
    assert meta.outside_range({"ids": (2, 12)}) is None
    assert meta.outside_range({"ids": (2, 10)}) == (  # the steps were probed, not validated: said so
        f"input 'ids' axis 1 (seq) is 10: engine e's graph takes seq only in steps of 4 {PROBED}; the nearest sizes "
        "it takes are 8 and 12"
    )
    meta.axis_steps = {"seq": [4, 0, 3]}  # an FPN's rounding: runs of sizes per period
    assert meta.outside_range({"ids": (2, 11)}) is None and meta.outside_range({"ids": (2, 12)}) is None
    assert meta.outside_range({"ids": (2, 10)}) == (
        f"input 'ids' axis 1 (seq) is 10: engine e's graph takes seq only at sizes 8, 11, 12, 15, 16 {PROBED}; the "
        "nearest sizes it takes are 8 and 11"
    )
    meta.axis_ranges, meta.axis_steps = {"seq": [16, 32]}, {"seq": [17, 15, 16]}  # a period as long as the range
    assert meta.outside_range({"ids": (2, 24)}) == (
        f"input 'ids' axis 1 (seq) is 24: engine e's graph takes seq only at sizes 16, 32 {PROBED}; the nearest sizes "
        "it takes are 16 and 32"
    )
    meta.axis_steps = {"seq": [8, 0, 5, 6, 7]}  # an FPN's, over a range too wide to list: never "validated at"
    meta.axis_ranges = {"seq": [64, 96]}
    assert meta.outside_range({"ids": (2, 65)}) == (
        f"input 'ids' axis 1 (seq) is 65: engine e's graph takes seq only at sizes 0, 5-7 modulo 8 {PROBED}; the "
        "nearest sizes it takes are 64 and 69"
    )


def test_a_refused_size_names_only_the_rule_it_breaks() -> None:
    """A size within the validated range but off the graph's steps is said as the steps, with the sizes next to it
    the engine takes; a size past the range as the range alone, whether or not it is on the steps."""
    meta = _meta()
    meta.inputs = [TensorSpec(name="x", shape=["batch", 3, "h", "w"], dtype="float32")]
    meta.axis_ranges, meta.axis_steps, meta.validated_batch_sizes = {"h": [8, 16]}, {"h": [2, 0]}, [1]
    off_step = meta.outside_range({"x": (1, 3, 15, 4)})
    assert off_step == (
        f"input 'x' axis 2 (h) is 15: engine e's graph takes h only in steps of 2 {PROBED}; the nearest sizes it "
        "takes are 14 and 16"
    )
    assert "from 8 to 16" not in off_step
    for size in (20, 21, 6):
        assert meta.outside_range({"x": (1, 3, size, 4)}) == (
            f"input 'x' axis 2 (h) is {size}: engine e was validated for h from 8 to 16"
        )
    meta.axis_ranges = {"h": [8, 9]}  # one size of the steps in the range: said as the one
    meta.axis_steps = {"h": [4, 0]}
    assert meta.outside_range({"x": (1, 3, 9, 4)}).endswith("; the nearest size it takes is 8")


def test_inputs_that_differ_on_a_shared_axis_are_named() -> None:
    meta = _meta()
    meta.inputs = [
        TensorSpec(name="ids", shape=["batch", "seq"], dtype="int64"),
        TensorSpec(name="mask", shape=["batch", "seq"], dtype="int64"),
        TensorSpec(name="pixels", shape=["batch", "?", "?"], dtype="float32"),  # "?": no name, nothing tied
    ]
    assert meta.outside_range({"ids": (2, 8), "mask": (2, 8), "pixels": (2, 3, 5)}) is None
    assert meta.outside_range({"ids": (2, 8), "mask": (2, 7), "pixels": (2, 3, 3)}) == (
        "inputs 'ids' and 'mask' differ on axis seq (8 against 7): engine e takes them at one size"
    )
    assert "differ on axis batch (2 against 1)" in meta.outside_range({"ids": (2, 8), "mask": (1, 8)})
    meta.inputs = [TensorSpec(name="image", shape=["batch", 3, "side", "side"], dtype="float32")]  # square
    assert meta.outside_range({"image": (1, 3, 8, 16)}) == (
        "input 'image' differs on axes 2 and 3, both side, (8 against 16): engine e takes them at one size"
    )


def test_an_empty_input_is_refused_naming_it_unless_validated_at_0() -> None:
    # ONNX Runtime's LSTM/GRU kernels abort the process on 0 rows: every server refuses such a request first
    meta = _meta()
    meta.inputs = [TensorSpec(name="ids", shape=["batch", "seq"], dtype="int64")]
    assert meta.refusal({"ids": np.zeros((1, 4), np.int64)}) is None
    assert meta.refusal({"ids": np.zeros((0, 4), np.int64)}) == "input 'ids' has 0 rows: engine e takes no empty inputs"
    no_range = "input 'ids' axis 1 (seq) is 0: engine e takes no empty inputs"
    assert meta.refusal({"ids": np.zeros((2, 0), np.int64)}) == no_range  # no range recorded: refused still
    meta.axis_ranges = {"seq": [0, 16]}  # validated at 0 (a decoder's empty past): taken
    assert meta.refusal({"ids": np.zeros((2, 0), np.int64)}) is None
    assert meta.refusal({"ids": np.zeros((0, 0), np.int64)}).startswith("input 'ids' has 0 rows")


def test_an_empty_axis_says_the_sizes_validated_and_the_batch_is_never_empty() -> None:
    meta = _meta()
    meta.inputs = [TensorSpec(name="past", shape=["batch", "past", 8], dtype="float32")]
    meta.axis_ranges, meta.validated_batch_sizes = {"past": [4, 16]}, [1, 8]
    assert meta.refusal({"past": np.zeros((2, 0, 8), np.float32)}) == (
        "input 'past' axis 1 (past) is 0: engine e was validated for past from 4 to 16"
    )
    assert meta.empty_axis({"past": (2, 0, 8)}) == ("past", 1, "past")
    # an axis 0 of its own name validated from 0 (a two-tower model's texts, counted apart from the batch) takes 0,
    # as validation ran it; the batch never does, nor an axis 0 of no range of its own (another file's batch name)
    meta.inputs = [TensorSpec(name="texts", shape=["texts", 8], dtype="float32")]
    meta.axis_ranges = {"texts": [0, 16]}
    assert meta.refusal({"texts": np.zeros((0, 8), np.float32)}) is None
    for name in ("batch", "batch_size"):
        meta.inputs = [TensorSpec(name="x", shape=[name, 8], dtype="float32")]
        meta.axis_ranges = {"texts": [0, 16]} if name != "batch" else {"batch": [0, 16]}
        assert (
            meta.refusal({"x": np.zeros((0, 8), np.float32)}) == "input 'x' has 0 rows: engine e takes no empty inputs"
        )


def test_a_fixed_axis_at_another_size_is_refused_naming_it() -> None:
    """An image exported at 3x64x96: a request at 128x192 is refused as a fixed size of the graph, before a server
    hands it to a backend whose own error does not say so."""
    meta = _meta()
    meta.inputs = [TensorSpec(name="pixel_values", shape=["batch", 3, 64, 96], dtype="float32")]
    assert meta.refusal({"pixel_values": np.zeros((1, 3, 64, 96), np.float32)}) is None
    assert meta.refusal({"pixel_values": np.zeros((1, 3, 128, 192), np.float32)}) == (
        "input 'pixel_values' axis 2 is 128: engine e takes 64 there (a fixed size of its graph)"
    )
    assert meta.fixed_axis({"pixel_values": (1, 3, 128, 192)}) == ("pixel_values", 2, 128, 64)
    assert meta.refusal({"pixel_values": np.zeros((1, 64, 96), np.float32)}) == (
        "input 'pixel_values' has 3 axes [1, 64, 96]: engine e takes 4 ([batch, 3, 64, 96])"
    )


def test_packed_columns_are_each_held_to_their_own_table(tmp_path: Path) -> None:
    """A recommender's ids packed in ``sparse [batch, 2]`` (tables of 10 and 1000 rows) record a range per column: 50
    in column 0 is refused naming the column (the input's one range, [0, 999], passed it to ONNX Runtime, whose
    error a server answered with HTTP 500). The record reads back in either form (one range: older engines)."""
    meta = _meta()
    meta.inputs = [TensorSpec(name="sparse", shape=["batch", 2], dtype="int64")]
    meta.index_ranges = {"sparse": [[0, 9], [0, 999]]}
    assert meta.refusal({"sparse": np.array([[9, 999], [0, 0]])}) is None
    assert meta.refusal({"sparse": np.array([[3, 900], [50, 1]])}) == (
        "input 'sparse' holds 50 in column 0 (sparse[..., 0]): engine e takes values from 0 to 9 there "
        "(the positions of the axis it indexes: a table's rows, a graph's nodes)"
    )
    assert meta.refusal({"sparse": np.array([[3, 1000]])}).startswith("input 'sparse' holds 1000 in column 1 ")
    three = np.array([[3, 4, 1000]])  # columns the record does not have: held to the widest range, [0, 999]
    assert meta.outside_values({"sparse": three}).startswith("input 'sparse' holds 1000: ")
    path = tmp_path / "kiln-engine.json"
    meta.write(path)
    assert EngineMetadata.read(path, hint="rebuild").index_ranges == {"sparse": [[0, 9], [0, 999]]}
    meta.index_ranges = {"sparse": [0, 999]}
    meta.write(path)
    assert EngineMetadata.read(path, hint="rebuild").index_ranges == {"sparse": [0, 999]}


def test_an_index_past_the_table_is_named_and_the_table_s_own_rows_pass() -> None:
    meta = _meta()
    meta.inputs = [TensorSpec(name="ids", shape=["batch", "seq"], dtype="int64")]
    assert meta.refusal({"ids": np.array([[-1, 5]])}) is None  # no range recorded: nothing to hold it to
    meta.index_ranges = {"ids": [0, 9]}
    assert meta.refusal({"ids": np.array([[0, 9]])}) is None
    assert meta.outside_values({"ids": np.zeros((0, 4), np.int64)}) is None
    assert meta.refusal({"ids": np.array([[3, -1]])}) == (
        "input 'ids' holds -1: engine e takes values from 0 to 9 "
        "(the positions of the axis it indexes: a table's rows, a graph's nodes)"
    )
    assert meta.refusal({"ids": np.array([[10, 2]])}).startswith("input 'ids' holds 10:")


def test_a_float_input_cast_to_an_index_is_held_to_its_range_as_the_cast_truncates_it() -> None:
    """A diffusion model's timestep, float, looked up in a table of 1000 rows: 999.5 is row 999 (Cast truncates),
    -1.5 and 5000 are refused naming the value given, and a NaN, which no Cast makes a row, is refused too."""
    meta = _meta()
    meta.inputs = [TensorSpec(name="t", shape=["batch"], dtype="float32")]
    meta.index_ranges = {"t": [0, 999]}
    assert meta.refusal({"t": np.array([0.0, -0.5, 999.5], np.float32)}) is None
    assert meta.refusal({"t": np.array([5000.0], np.float32)}).startswith("input 't' holds 5000: engine e takes")
    assert meta.refusal({"t": np.array([3.0, -1.5], np.float32)}).startswith("input 't' holds -1.5:")
    for bad in (np.nan, np.inf):
        said = meta.refusal({"t": np.array([3.0, bad], np.float32)})
        assert said.startswith(f"input 't' holds {float(bad)}: engine e takes values from 0 to 999"), said


def test_every_axis_outside_its_validated_sizes_is_named() -> None:
    """An encoder-decoder's source and target lengths both past their ranges: the user learns both at once."""
    meta = _meta()
    meta.inputs = [
        TensorSpec(name="input_ids", shape=["batch", "src"], dtype="int64"),
        TensorSpec(name="attention_mask", shape=["batch", "src"], dtype="int64"),
        TensorSpec(name="decoder_input_ids", shape=["batch", "tgt"], dtype="int64"),
    ]
    meta.axis_ranges = {"src": [6, 12], "tgt": [6, 13]}
    said = meta.outside_range({"input_ids": (2, 5), "attention_mask": (2, 5), "decoder_input_ids": (2, 25)})
    assert said == (
        "input 'input_ids' axis 1 (src) is 5: engine e was built for src from 6 to 12; "
        "input 'decoder_input_ids' axis 1 (tgt) is 25: engine e was built for tgt from 6 to 13"
    )


def test_a_row_index_among_an_outputs_statistics_stays_an_integer_in_json() -> None:
    """worst_sample is a row of the batch axis: 15, not 15.0, in validation.json and kiln validate's JSON."""
    import json

    from kiln.core.records import EngineValidation

    e = EngineValidation(
        name="e", backend="onnxruntime", precision="fp32", device="cpu", status="validated",
        outputs={"logits": {"worst_sample": 15, "sample_cosine": 0.5}},
    )  # fmt: skip
    said = json.loads(e.model_dump_json())["outputs"]["logits"]
    assert said["worst_sample"] == 15 and isinstance(said["worst_sample"], int)
    assert isinstance(said["sample_cosine"], float)


def test_percentiles_of_calls_are_ordered_and_interpolated() -> None:
    p = Percentiles.of(list(np.arange(1, 101, dtype=float)))
    assert (p.p50, p.p90, p.p99) == pytest.approx((50.5, 90.1, 99.01)) and p.rounds == [] and p.ci95 is None


def test_steps_without_a_range_hold_the_servers_check_too() -> None:
    """An engine built from an exported file given no sizes keeps the steps its export recorded and no range: the
    check every server runs (outside_range) refuses a size off them and takes the others, however large."""
    spec = TensorSpec(name="input", shape=["batch", 3, "H"], dtype="float32")
    meta = _meta().model_copy(update={"inputs": [spec], "axis_steps": {"H": [4, 0]}})
    assert "(H) is 6: engine e's graph takes H only in steps of 4" in (meta.outside_range({"input": (1, 3, 6)}) or "")
    assert meta.outside_range({"input": (1, 3, 8)}) is None and meta.outside_range({"input": (1, 3, 4096)}) is None
