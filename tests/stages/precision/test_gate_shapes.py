"""A variant judged at several validated shapes names the shape each gate it misses was missed at; where those are
only sizes its calibration data lacks, the fix says to calibrate there. The data's batches are calibrated at every
validated shape too, resized as validation resizes its held-out data."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kiln.core.shapes import copy_step
from kiln.stages.accuracy.check import Reference, placed_failure
from kiln.stages.accuracy.config import GatesConfig
from kiln.stages.precision.gate import GateCheck, session_runner
from kiln.stages.precision.stage import at_validated_shapes, uncalibrated

AXES = {"x": {0: "batch", 1: "seq"}}


def mean_over_seq(off_at: int | None = None) -> onnx.ModelProto:
    """x [batch, seq, 4] -> its mean over seq; ``off_at``: plus 1 where seq is that size (a graph that goes wrong at
    one size only, as a Q/DQ graph whose scale clips there)."""
    nodes = [helper.make_node("ReduceMean", ["x"], ["m"], axes=[1], keepdims=0)]
    inits = []
    if off_at is None:
        nodes.append(helper.make_node("Identity", ["m"], ["y"]))
    else:
        inits = [
            numpy_helper.from_array(np.array([1], np.int64), "one"),
            numpy_helper.from_array(np.array([off_at], np.int64), "size"),
        ]
        nodes += [
            helper.make_node("Shape", ["x"], ["shape"]),
            helper.make_node("Gather", ["shape", "one"], ["seq"]),
            helper.make_node("Equal", ["seq", "size"], ["there"]),
            helper.make_node("Cast", ["there"], ["off"], to=TensorProto.FLOAT),
            helper.make_node("Add", ["m", "off"], ["y"]),
        ]
    g = helper.make_graph(
        nodes,
        "mean",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        inits,
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])


def _check() -> GateCheck:
    x = np.random.default_rng(0).standard_normal((16, 16, 4)).astype(np.float32)
    fp32 = mean_over_seq()
    feeds = [({"seq": 8}, {"x": x[:, :8]}), ({"seq": 16}, {"x": x})]
    ref = Reference(session_runner(fp32), feeds, [None, None], None, 4, axes=AXES)
    return GateCheck(fp32, ref, GatesConfig(), [4])


def test_a_gate_missed_at_one_shape_names_it() -> None:
    check = _check()
    verdict = check(mean_over_seq(off_at=8), "int8")
    assert verdict.failures and all(f.endswith(" at seq=8") for f in verdict.failures)
    assert check.missed_at(verdict.failures) == [{"seq": 8}]
    assert check(mean_over_seq(), "int8").passed


def test_missed_only_at_sizes_calibration_lacks_says_to_calibrate_there() -> None:
    check = _check()
    entry = {"fallback": {"passed": False, "failures": check(mean_over_seq(off_at=8), "int8").failures}}
    at_16 = [{"x": np.zeros((4, 16, 4), np.float32)}]
    hint = uncalibrated(check, "int8", entry, at_16)
    assert hint is not None and "misses the gates only at seq=8, sizes its calibration data does not have" in hint
    assert "calibrate at those sizes too" in hint and "signature.shapes" in hint
    at_both = [*at_16, {"x": np.zeros((4, 8, 4), np.float32)}]
    assert uncalibrated(check, "int8", entry, at_both) is None  # calibrated there: the cause is elsewhere
    assert uncalibrated(check, "fp16", entry, at_16) is None  # FP16 takes no calibrated scales


def test_data_batches_are_calibrated_at_each_validated_shape_they_lack() -> None:
    batch = {"x": np.arange(2 * 16 * 4, dtype=np.float32).reshape(2, 16, 4)}
    added = at_validated_shapes([batch], {"x": {1: "seq"}}, {"seq": [8, 16, 24]})
    assert [b["x"].shape for b in added] == [(2, 8, 4), (2, 24, 4)]  # seq=16 is the data's own
    np.testing.assert_array_equal(added[0]["x"], batch["x"][:, :8])  # cut, as validation cuts
    grown = batch["x"][:, :8] + copy_step(batch["x"], 1)  # grown by repeating its values, each copy shifted
    np.testing.assert_allclose(added[1]["x"][:, 16:], grown, rtol=1e-6)
    assert at_validated_shapes([batch], {}, {}) == []


def test_a_variant_s_failure_is_placed_as_validation_places_an_engine_s() -> None:
    """The precision stage places a failure with validation's own wording (:func:`placed_failure`), and remembers
    the shapes it names for the fallback."""
    failure = "cosine 0.5000 < min_cosine 0.99"
    missed = [({"seq": 4}, ["cosine 0.7000 < min_cosine 0.99"]), ({"seq": 8}, [failure])]
    check = GateCheck(mean_over_seq(), None, GatesConfig(), [2])  # type: ignore[arg-type]
    placed = check._placed(failure, missed)
    assert placed == placed_failure(failure, missed)[0] == f"{failure} at seq=8 (and at seq=4)"
    assert check.missed_at([placed]) == [{"seq": 8}, {"seq": 4}]
