"""Calibration data from the run's dataset or a user reader; config validation; the TensorRT table."""

from __future__ import annotations

import logging
import struct
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from kiln.calibration.config import CalibrationConfig
from kiln.calibration.data import calibration_batches, hash_batches
from kiln.calibration.ranges import calibrate
from kiln.calibration.trt_table import read_trt_table, write_trt_table
from kiln.core.data import DatasetSplits
from kiln.core.errors import ConfigError
from kiln.core.records import TensorSpec
from kiln.models.datasets import synthetic
from kiln.pipeline.config import config_from_dict
from tests.calibration.calib_graphs import batches, saved


def test_dataset_batches_fixed_count_deterministic_and_like_validation() -> None:
    data = synthetic(shape=(1, 8, 8), size=400)
    cfg = CalibrationConfig(num_batches=3, batch_size=16)
    a, b = calibration_batches(data, cfg), calibration_batches(data, cfg)
    assert len(a) == 3 and all(x.shape == (16, 1, 8, 8) for x in a)
    assert a[0].dtype == data.val_x.numpy().dtype
    assert hash_batches(a) == hash_batches(b)
    assert hash_batches(a) != hash_batches(calibration_batches(data, cfg, seed=1))


def test_user_reader_by_import_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_calib.py").write_text(
        textwrap.dedent("""
        import numpy as np
        def reader(scale=1.0):
            rng = np.random.default_rng(0)
            while True:  # endless: Kiln takes num_batches
                yield {"input": (rng.random((4, 1, 8, 8)) * scale)}
        def wrong_shape():
            return [np.zeros((4, 3, 8, 8), np.float32)]
        """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    data = synthetic(shape=(1, 8, 8), size=64)
    got = calibration_batches(
        data, CalibrationConfig(reader="my_calib:reader", reader_params={"scale": 2.0}, num_batches=5)
    )
    assert len(got) == 5 and got[0].dtype == np.float32 and got[0].max() > 1.0
    with pytest.raises(ConfigError, match="model takes"):
        calibration_batches(data, CalibrationConfig(reader="my_calib:wrong_shape"))
    with pytest.raises(ConfigError, match="rejected its params"):
        calibration_batches(data, CalibrationConfig(reader="my_calib:wrong_shape", reader_params={"x": 1}))
    with pytest.raises(ConfigError):
        calibration_batches(data, CalibrationConfig(reader="no_such_module_xyz:reader"))


def test_a_reader_batch_that_cannot_calibrate_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """NaN, no rows or values that are no numbers would give NaN ranges, or none, and INT8 would be dropped quietly:
    each is one error naming the batch; tensors that need grad or are bfloat16 are read as numbers."""
    (tmp_path / "odd_calib.py").write_text(
        textwrap.dedent("""
        import numpy as np, torch
        def nan():
            x = np.ones((4, 1, 8, 8), np.float32); x[0, 0, 0, 0] = np.nan
            return [x]
        def empty():
            return [np.zeros((0, 1, 8, 8), np.float32)]
        def text():
            return [np.full((4, 1, 8, 8), "a")]
        def grad_and_bf16():
            return [torch.ones(4, 1, 8, 8, requires_grad=True), torch.ones(4, 1, 8, 8, dtype=torch.bfloat16)]
        """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    data = synthetic(shape=(1, 8, 8), size=64)
    for reader, says in (("nan", "1 NaN or infinite values"), ("empty", "has no rows"), ("text", "not real numbers")):
        with pytest.raises(ConfigError, match=f"calibration batch 0 of reader 'odd_calib:{reader}' .*{says}"):
            calibration_batches(data, CalibrationConfig(reader=f"odd_calib:{reader}"))
    got = calibration_batches(data, CalibrationConfig(reader="odd_calib:grad_and_bf16"))
    assert [b.dtype for b in got] == [np.float32, np.float32] and all((b == 1).all() for b in got)


def test_unknown_calibration_key_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown key 'calibration.methd'"):
        config_from_dict({"calibration": {"methd": "entropy"}})
    with pytest.raises(ConfigError, match="calibration.method"):
        config_from_dict({"calibration": {"method": "kl"}})


def test_trt_calibration_table_format(tmp_path: Path) -> None:
    ranges = calibrate(saved(tmp_path), batches(), "input", "minmax", cache_dir=None)
    amax = ranges.amax()
    table = write_trt_table(amax, tmp_path / "calibration.cache")
    lines = table.read_text().splitlines()
    assert lines[0] == "TRT-8601-EntropyCalibration2"
    name, _, hexval = lines[1].rpartition(": ")
    assert len(hexval) == 8 and int(hexval, 16) >= 0
    # big-endian IEEE float32 of amax / 127, exactly what IInt8Calibrator::readCalibrationCache expects
    assert struct.unpack(">f", bytes.fromhex(hexval))[0] == pytest.approx(amax[name] / 127, rel=1e-6)
    header, scales = read_trt_table(table)
    assert set(scales) == set(amax) and {"input", "c", "r", "logits"} <= set(scales)


TEXT_INPUTS = [
    TensorSpec(name="input_ids", shape=["batch", "seq"], dtype="int64"),
    TensorSpec(name="attention_mask", shape=["batch", "seq"], dtype="int64"),
]


def _text_data(seq: int = 16) -> DatasetSplits:
    x = {"input_ids": torch.ones(32, seq, dtype=torch.long), "attention_mask": torch.ones(32, seq, dtype=torch.long)}
    return DatasetSplits(x, torch.zeros(32, dtype=torch.long), x, torch.zeros(32, dtype=torch.long), num_classes=2)


@pytest.fixture
def text_readers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "text_calib.py").write_text(
        textwrap.dedent("""
        import numpy as np, torch
        def both(seq=8):
            for _ in range(2):
                yield {"input_ids": np.ones((4, seq), np.int32), "attention_mask": np.ones((4, seq), np.int32)}
        def ids_only(seq=8):
            yield {"input_ids": np.ones((4, seq), np.int64)}
        def ids_and_extra():
            yield {"input_ids": np.ones((4, 8)), "attention_mask": np.ones((4, 8)), "token_type_ids": np.ones((4, 8))}
        def array():
            yield np.ones((4, 8), np.int64)
        def ragged():
            yield {"input_ids": np.ones((4, 8)), "attention_mask": np.ones((4, 7))}
        def wrong_key():
            for _ in range(2):
                yield {"ids": np.full((4, 8), 5, np.int64), "labels": np.zeros(4, np.int64)}
        def two_wrong_keys():
            yield {"ids": np.ones((4, 8), np.int64), "mask": np.ones((4, 8), np.int64)}
        def with_labels():
            yield {"input_ids": np.ones((4, 8), np.int64), "labels": np.zeros(4, np.int64)}
        def in_order():
            for _ in range(2):
                yield [np.full((4, 8), 3, np.int32), torch.zeros(4, 8)]
        def three():
            yield (np.ones((4, 8)), np.ones((4, 8)), np.zeros(4))
        def dict_and_labels():
            yield {"input_ids": np.ones((4, 8)), "attention_mask": np.ones((4, 8))}, np.zeros(4)
        def pair_and_labels():
            yield (np.ones((4, 8)), np.ones((4, 8))), np.zeros(4)
        def array_and_labels():
            yield np.ones((4, 8)), np.zeros(4)
        def array_and_ragged_targets():
            yield np.ones((4, 8)), [[1], [1, 2]]
        """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))


def test_a_reader_batch_takes_any_size_of_a_dynamic_axis(text_readers: None) -> None:
    """The graph's named axes, not the data's example shape, say what a batch may be: seq 8 for a model whose data
    holds seq 16; a fixed axis is still checked."""
    data = _text_data(seq=16)
    got = calibration_batches(data, CalibrationConfig(reader="text_calib:ids_only"), inputs=TEXT_INPUTS[:1])
    assert [b.shape for b in got] == [(4, 8)] and got[0].dtype == np.int64  # one input: its array, as before
    fixed = [TensorSpec(name="input_ids", shape=["batch", 16], dtype="int64")]
    with pytest.raises(ConfigError, match=r"has shape \(4, 8\), the model takes \[batch, 16\]"):
        calibration_batches(data, CalibrationConfig(reader="text_calib:ids_only"), inputs=fixed)


def test_a_reader_feeds_every_input_of_a_model_by_name(text_readers: None) -> None:
    data = _text_data()
    got = calibration_batches(data, CalibrationConfig(reader="text_calib:both"), inputs=TEXT_INPUTS)
    assert len(got) == 2 and all(isinstance(b, dict) and set(b) == {"input_ids", "attention_mask"} for b in got)
    assert all(a.dtype == np.int64 and a.shape == (4, 8) for b in got for a in b.values())  # the graph's dtype
    cases = {
        "ids_only": "lacks 'attention_mask'",
        "ids_and_extra": "has 'token_type_ids', which the model does not take",
        "array": "is one array; the model takes 2 inputs",
        "ragged": "input 'attention_mask' has seq = 7 and input 'input_ids' seq = 8",
    }
    for reader, says in cases.items():
        with pytest.raises(ConfigError, match=f"calibration batch 0.*{says}"):
            calibration_batches(data, CalibrationConfig(reader=f"text_calib:{reader}"), inputs=TEXT_INPUTS)


def test_a_single_input_reader_batch_is_keyed_by_its_name_and_its_labels_left_out(
    text_readers: None, caplog: pytest.LogCaptureFixture
) -> None:
    """One input: a dict batch keyed by the input's name, a DataLoader-style batch's labels left out; a dict whose
    one key not named like labels names no input gives that key's array, said once in a warning; two such keys
    are an error naming the keys and the inputs (either could be the wrong field)."""
    got = calibration_batches(_text_data(), CalibrationConfig(reader="text_calib:with_labels"), inputs=TEXT_INPUTS[:1])
    assert [b.shape for b in got] == [(4, 8)]
    with caplog.at_level(logging.WARNING, logger="kiln.calibration"):
        got = calibration_batches(
            _text_data(), CalibrationConfig(reader="text_calib:wrong_key"), inputs=TEXT_INPUTS[:1]
        )
    assert len(got) == 2 and all((b == 5).all() for b in got)
    said = [r.getMessage() for r in caplog.records if "took its key" in r.getMessage()]
    assert said == [
        "calibration reader 'text_calib:wrong_key' yields no key 'input_ids': took its key 'ids' as the model's "
        "input 'input_ids'"
    ]  # once for the run, not once per batch
    with pytest.raises(
        ConfigError,
        match=r"reader 'text_calib:two_wrong_keys' has keys \['ids', 'mask'\]; the model takes \['input_ids'\]\n",
    ):
        calibration_batches(_text_data(), CalibrationConfig(reader="text_calib:two_wrong_keys"), inputs=TEXT_INPUTS[:1])


def test_a_reader_may_yield_a_tuple_of_one_array_per_input_in_input_order(text_readers: None) -> None:
    """A tuple or list of arrays, one per model input, feeds them by position (as a tuple does in the data); a
    ``(x, labels)`` pair still gives its ``x``, whatever ``x`` is; another count is said as the tuple it is."""
    data = _text_data()
    got = calibration_batches(data, CalibrationConfig(reader="text_calib:in_order"), inputs=TEXT_INPUTS)
    assert len(got) == 2 and all(list(b) == ["input_ids", "attention_mask"] for b in got)
    assert (got[0]["input_ids"] == 3).all() and (got[0]["attention_mask"] == 0).all()
    assert got[0]["input_ids"].dtype == np.int64 and got[0]["attention_mask"].shape == (4, 8)
    for reader in ("dict_and_labels", "pair_and_labels"):
        got = calibration_batches(data, CalibrationConfig(reader=f"text_calib:{reader}"), inputs=TEXT_INPUTS)
        assert [sorted(b) for b in got] == [["attention_mask", "input_ids"]], reader
    for reader in ("array_and_labels", "array_and_ragged_targets"):
        got = calibration_batches(data, CalibrationConfig(reader=f"text_calib:{reader}"), inputs=TEXT_INPUTS[:1])
        assert [b.shape for b in got] == [(4, 8)], reader
    with pytest.raises(ConfigError, match=r"calibration batch 0 .* is a tuple of 3 arrays; the model takes 2 inputs"):
        calibration_batches(data, CalibrationConfig(reader="text_calib:three"), inputs=TEXT_INPUTS)


IMAGE_INPUTS = [TensorSpec(name="pixel_values", shape=["batch", 3, 4, 4], dtype="float32")]


@pytest.fixture
def image_readers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "image_calib.py").write_text(
        textwrap.dedent("""
        import numpy as np
        rng = np.random.default_rng(0)
        def two_batches():
            yield rng.random((4, 3, 4, 4)), rng.random((4, 3, 4, 4))
        def three():
            yield rng.random((4, 3, 4, 4)), np.zeros(4, np.int64), np.ones(4)
        def with_labels():
            yield rng.random((4, 3, 4, 4)), np.zeros(4, np.int64)
        def with_float_targets():
            yield rng.random((4, 3, 4, 4)), rng.random((4, 10))
        def ids_and_tags():
            yield np.full((4, 8), 3, np.int64), np.ones((4, 8), np.int64)
        def zeros(n=2):
            for _ in range(n):
                yield {"pixel_values": np.zeros((4, 3, 4, 4), np.float32)}
        def state_of_zeros():
            for _ in range(2):
                yield {"x": rng.random((4, 5, 3)), "h0": np.zeros((4, 6), np.float32)}
        def all_zeros():
            yield {"x": np.zeros((4, 5, 3)), "h0": np.zeros((4, 6), np.float32)}
        def one_zero_batch():
            yield {"pixel_values": np.zeros((4, 3, 4, 4), np.float32)}
            yield {"pixel_values": rng.random((4, 3, 4, 4))}
        """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))


def test_a_tuple_for_one_input_gives_its_first_array(image_readers: None) -> None:
    """For a model of one input, a tuple is a DataLoader's (x, y) or (x, y, ...) batch and gives its x, whatever y
    is: labels, targets of another shape, float targets of x's shape (a denoiser's clean image, a forecaster's
    target window), or integer labels of the ids' shape (a tagger's)."""
    data = _text_data()
    for reader in ("with_labels", "with_float_targets", "two_batches", "three"):
        got = calibration_batches(data, CalibrationConfig(reader=f"image_calib:{reader}"), inputs=IMAGE_INPUTS)
        assert [b.shape for b in got] == [(4, 3, 4, 4)], reader
    got = calibration_batches(data, CalibrationConfig(reader="image_calib:ids_and_tags"), inputs=TEXT_INPUTS[:1])
    assert [b.shape for b in got] == [(4, 8)] and (got[0] == 3).all()  # a tagger's ids and tags, of one shape: x


def test_float_inputs_that_are_zero_in_every_sample_are_an_error(image_readers: None, text_readers: None) -> None:
    """Calibration data of all zeros has no range: the reader's mistake, said with the reader and the input, not
    INT8 (and FP16) variants dropped later; one zero batch among real ones, integer inputs of zeros, or one float
    input of zeros beside one that varies (an RNN's initial state: INT8's own range check judges it) are fine."""
    data = _text_data()
    with pytest.raises(
        ConfigError,
        match="reader 'image_calib:zeros' yields input 'pixel_values' as 0 in every sample of its 2 batches",
    ):
        calibration_batches(data, CalibrationConfig(reader="image_calib:zeros"), inputs=IMAGE_INPUTS)
    got = calibration_batches(data, CalibrationConfig(reader="image_calib:one_zero_batch"), inputs=IMAGE_INPUTS)
    assert len(got) == 2
    got = calibration_batches(data, CalibrationConfig(reader="text_calib:in_order"), inputs=TEXT_INPUTS)
    assert (got[0]["attention_mask"] == 0).all()  # an integer input all 0 (token type ids): no mistake
    state = [
        TensorSpec(name="x", shape=["batch", 5, 3], dtype="float32"),
        TensorSpec(name="h0", shape=["batch", 6], dtype="float32"),
    ]
    got = calibration_batches(data, CalibrationConfig(reader="image_calib:state_of_zeros"), inputs=state)
    assert len(got) == 2 and not got[0]["h0"].any() and got[0]["x"].any()
    with pytest.raises(ConfigError, match=r"yields every float input \(x, h0\) as 0 in every sample of its 1 batch:"):
        calibration_batches(data, CalibrationConfig(reader="image_calib:all_zeros"), inputs=state)
