"""The safety net and the passes on graphs that once fooled them: tensor attributes, random ops, stale recorded
shapes, NaN and sequence outputs, name clashes, rank-raising 'scalars', empty reduce axes."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper as h

from kiln.core.errors import ModelError
from kiln.stages.optimize.api import optimize_model, unrunnable_hint
from kiln.stages.optimize.config import OptimizeConfig
from kiln.stages.optimize.verify import Verifier, random_inputs, run_ort
from tests.stages.optimize.optimize_helpers import FLOAT, INT64, f32, make_model, ops, run_pass

N = h.make_node


def test_cse_keeps_constant_of_shape_nodes_with_different_values():
    fill = lambda v: h.make_tensor("value", onnx.TensorProto.FLOAT, [1], [v])  # noqa: E731
    m = make_model(
        [
            N("Shape", ["x"], ["s"]),
            N("ConstantOfShape", ["s"], ["zeros"], value=fill(0.0)),
            N("ConstantOfShape", ["s"], ["ones"], value=fill(1.0)),
            N("Add", ["zeros", "ones"], ["a"]),
            N("Add", ["x", "a"], ["y"]),
        ],
        [("x", ["N", 4], FLOAT)],
        ["y"],
        {},
    )
    out, s = optimize_model(m, OptimizeConfig(passes=["cse"], verify=False))  # the net is off: the pass alone
    assert ops(out).count("ConstantOfShape") == 2
    x = f32(3, 4)
    np.testing.assert_allclose(run_ort(out, {"x": x})["y"], x + 1)


def test_fold_constants_does_not_freeze_random_ops():
    """An unseeded RandomUniform has no variable inputs, so it looks constant; folding would freeze one draw."""
    m = make_model(
        [N("RandomUniform", [], ["r"], shape=[1, 4]), N("Add", ["x", "r"], ["y"])], [("x", ["N", 4], FLOAT)], ["y"], {}
    )
    out, s = optimize_model(m, OptimizeConfig(passes=["fold_constants"]))
    assert "RandomUniform" in ops(out)


def test_random_model_is_checked_for_shapes_only_and_not_rolled_back():
    """Two runs of one graph agree (ONNX Runtime seeds every session alike), but a rewritten graph draws other
    numbers: comparing values rolled back every pass of such a model."""
    from kiln.stages.optimize.verify import Verifier

    m = make_model(
        [
            N("Identity", ["x"], ["i"]),
            N("Mul", ["i", "two"], ["d"]),
            N("RandomNormalLike", ["d"], ["r"]),
            N("Add", ["d", "r"], ["y"]),
        ],
        [("x", ["N", 4], FLOAT)],
        ["y"],
        {"two": np.array(2.0, np.float32)},
    )
    assert Verifier(m, OptimizeConfig()).random
    out, s = run_pass(m, "eliminate_identity")
    assert "Identity" not in ops(out) and s["verified"]


def test_a_recorded_batch_in_value_info_is_not_baked_into_reshapes():
    """The file says 'r' is [2, 12] (the export batch) while the input is dynamic: folding must not trust it."""
    m = make_model(
        [
            N("Relu", ["x"], ["r"]),
            N("Shape", ["r"], ["s"]),
            N("Gather", ["s", "i0"], ["b"], axis=0),
            N("Unsqueeze", ["b", "ax"], ["bu"]),
            N("Concat", ["bu", "tail"], ["shp"], axis=0),
            N("Reshape", ["r", "shp"], ["y"]),
        ],
        [("x", ["N", 12], FLOAT)],
        ["y"],
        {"i0": np.array(0), "ax": np.array([0]), "tail": np.array([3, 4])},
    )
    del m.graph.value_info[:]
    m.graph.value_info.append(h.make_tensor_value_info("r", FLOAT, [2, 12]))
    out, _ = optimize_model(m, OptimizeConfig(verify=False))
    for batch in (1, 2, 3):
        assert run_ort(out, {"x": f32(batch, 12)})["y"].shape == (batch, 3, 4)


def test_nan_in_the_reference_does_not_roll_everything_back():
    m = make_model([N("Log", ["x"], ["l"]), N("Identity", ["l"], ["y"])], [("x", ["N", 4], FLOAT)], ["y"], {})
    out, s = run_pass(m, "eliminate_identity")  # random normal inputs: Log of negatives is NaN
    assert ops(out) == ["Log"]


def test_sequence_outputs_are_compared():
    graph = h.make_graph(
        [
            N("Relu", ["x"], ["r"]),
            N("Identity", ["r"], ["i"]),
            N("SplitToSequence", ["i"], ["seq"], axis=0, keepdims=1),
        ],
        "g",
        [h.make_tensor_value_info("x", FLOAT, ["N", 4])],
        [h.make_tensor_sequence_value_info("seq", FLOAT, None)],
    )
    m = h.make_model(graph, opset_imports=[h.make_opsetid("", 18)])
    m.ir_version = 9
    out, s = run_pass(m, "eliminate_identity")
    assert ops(out) == ["Relu", "SplitToSequence"] and s["verified"]


def test_static_reshape_constant_gets_a_free_name():
    m = make_model(
        [
            N("Shape", ["x"], ["s"]),
            N("Gather", ["s", "i0"], ["b"], axis=0),
            N("Unsqueeze", ["b", "ax"], ["bu"]),
            N("Concat", ["bu", "tail"], ["y_shape"], axis=0),
            N("Reshape", ["x", "y_shape"], ["y"]),
            N("Relu", ["y"], ["out"]),
            N("Cast", ["y_shape"], ["z"], to=FLOAT),
        ],
        [("x", ["N", 12], FLOAT)],
        ["out", "z"],
        {"i0": np.array(0), "ax": np.array([0]), "tail": np.array([3, 4])},
    )
    out, s = run_pass(m, "fold_constants")
    onnx.checker.check_model(out, full_check=True)


def test_a_pass_whose_graph_fails_the_checker_is_rolled_back(monkeypatch):
    from kiln.stages.optimize import registry

    def bogus_attribute(graph, p):  # the ONNX checker rejects an attribute Relu does not have
        for node in graph.nodes:
            node.attrs["bogus"] = 1
        return 1

    monkeypatch.setitem(registry.PASSES, "bogus", registry.PassSpec("bogus", bogus_attribute, registry.NoParams, "x"))
    m = make_model([N("Relu", ["x"], ["r"]), N("Sigmoid", ["r"], ["y"])], [("x", ["N", 4], FLOAT)], ["y"], {})
    out, s = optimize_model(m, OptimizeConfig(passes=["bogus"]))
    assert s["rolled_back"] == ["bogus"] and "not a valid ONNX graph" in s["passes"][0]["reason"]


def test_one_element_constant_of_higher_rank_is_not_a_scalar():
    m = make_model(
        [N("MatMul", ["x", "w"], ["mm"]), N("Mul", ["mm", "s"], ["y"])],
        [("x", ["N", 16], FLOAT)],
        ["y"],
        {"w": f32(16, 8), "s": np.full((1, 1, 1), 0.5, np.float32)},
    )
    out, s = optimize_model(m, OptimizeConfig(passes=["fold_scalar_mul"], verify=False))
    assert run_ort(out, {"x": f32(2, 16)})["y"].shape == (1, 2, 8)


def test_layernorm_fusion_skips_empty_axes_and_still_fuses_the_real_one():
    def ln(x: str, tag: str, axes: str) -> list[onnx.NodeProto]:
        return [
            N("ReduceMean", [x, axes], [f"{tag}m"]),
            N("Sub", [x, f"{tag}m"], [f"{tag}d"]),
            N("Pow", [f"{tag}d", "two"], [f"{tag}p"]),
            N("ReduceMean", [f"{tag}p", axes], [f"{tag}v"]),
            N("Add", [f"{tag}v", "eps"], [f"{tag}e"]),
            N("Sqrt", [f"{tag}e"], [f"{tag}s"]),
            N("Div", [f"{tag}d", f"{tag}s"], [f"{tag}o"]),
        ]

    nodes = ln("x", "a", "last") + ln("x", "b", "none") + [N("Add", ["ao", "bo"], ["y"])]
    m = make_model(
        nodes,
        [("x", [2, 8], FLOAT)],
        ["y"],
        {
            "last": np.array([-1]),
            "none": np.array([], np.int64),
            "two": np.array(2.0, np.float32),
            "eps": np.array(1e-5, np.float32),
        },
    )
    out, s = run_pass(m, "fuse_layernorm")
    assert ops(out).count("LayerNormalization") == 1


def test_net_that_cannot_run_the_model_is_a_clear_error():
    """ids * 2 index a 5-row table: the net's integers (0..int_high) run past it."""
    m = make_model(
        [N("Mul", ["ids", "two"], ["doubled"]), N("Gather", ["table", "doubled"], ["y"])],
        [("ids", ["N", 3], INT64)],
        ["y"],
        {"table": f32(5, 4), "two": np.array(2, np.int64)},
    )
    with pytest.raises(ModelError, match="safety net cannot run") as err:
        optimize_model(m, OptimizeConfig())
    assert "int_high" in err.value.hint and "verify: false" in err.value.hint
    out, s = optimize_model(m, OptimizeConfig(int_high=2))
    assert s["verified"]


def test_ids_that_index_a_table_are_drawn_from_its_rows():
    """An ONNX file from elsewhere has no recorded data: token ids (vocab 50) and token types (2 rows) take their
    tables' rows, where 0..int_high ran past the token types' table."""
    m = make_model(
        [N("Gather", ["vocab", "ids"], ["a"]), N("Gather", ["kinds", "types"], ["b"]), N("Add", ["a", "b"], ["y"])],
        [("ids", ["N", 3], INT64), ("types", ["N", 3], INT64)],
        ["y"],
        {"vocab": f32(50, 4), "kinds": f32(2, 4)},
    )
    feed = random_inputs(m, OptimizeConfig(), batch=64)
    assert feed["types"].min() == 0 and feed["types"].max() == 1 and feed["ids"].max() > 16
    assert optimize_model(m, OptimizeConfig())[1]["verified"]


def _packed() -> onnx.ModelProto:
    """A recommender's ids packed in ``sparse [N, 2]``: column 0 into a 10-row table, column 1 into 1000 rows (the
    dynamo exporter's ``table_i(sparse[:, i])``: Gather of a constant column, then Gather over the table)."""
    return make_model(
        [
            N("Gather", ["sparse", "c0"], ["col0"], axis=1),
            N("Gather", ["sparse", "c1"], ["col1"], axis=1),
            N("Gather", ["small", "col0"], ["a"]),
            N("Gather", ["big", "col1"], ["b"]),
            N("Concat", ["a", "b"], ["y"], axis=1),
        ],
        [("sparse", ["N", 2], INT64)],
        ["y"],
        {"small": f32(10, 4), "big": f32(1000, 4), "c0": np.array(0, np.int64), "c1": np.array(1, np.int64)},
    )


@pytest.mark.parametrize("recorded", [[[0, 9], [1, 996]], [0, 996]], ids=["per-column", "one-range"])
def test_packed_columns_are_drawn_within_their_own_tables(recorded: list) -> None:
    """The export recorded the data's values per column (or, in an older int_ranges.json, one range for the input:
    the widest column's): each column is drawn within its own table, where every column drawn from [0, 996] ran
    column 0 past its 10 rows and the net refused to run the model."""
    m = _packed()
    feed = random_inputs(m, OptimizeConfig(), batch=64, int_ranges={"sparse": recorded})
    assert feed["sparse"][:, 0].max() <= 9 and feed["sparse"][:, 1].max() > 16
    assert optimize_model(m, OptimizeConfig(), int_ranges={"sparse": recorded})[1]["verified"]


def test_the_fix_says_int_high_does_not_change_an_input_drawn_from_the_data():
    """ids * 2 index a 10-row table and the data's range recorded for ids is 5..9: the net draws ids there, whatever
    optimize.int_high is, and every index drawn runs past the table (ONNX Runtime's "out of data bounds"), so the
    fix offers neither int_high nor verify_batch (which change nothing there): the data's range per column."""
    m = make_model(
        [N("Mul", ["ids", "two"], ["doubled"]), N("Gather", ["table", "doubled"], ["y"])],
        [("ids", ["N", 3], INT64)],
        ["y"],
        {"table": f32(10, 4), "two": np.array(2, np.int64)},
    )
    for high in (16, 3):
        with pytest.raises(ModelError, match="out of data bounds") as err:
            optimize_model(m, OptimizeConfig(int_high=high), int_ranges={"ids": [5, 9]})
    assert err.value.hint == (
        "the integers the safety net drew for 'ids' index past a table of the graph: rerun the export (kiln run "
        "--force export) to record the data's range of each column of 'ids' in export/int_ranges.json, one "
        "[low, high] per column; or set optimize.verify: false to rewrite without checking"
    )


@pytest.mark.parametrize("recorded", [{"sparse": [0, 996]}, None], ids=["data", "tables"])
def test_tables_taken_apart_before_a_dynamic_axis_get_a_fix_about_the_layout(recorded: dict | None) -> None:
    """``sparse [N, 2, S]``, ``sparse[:, 0]`` into 10 rows and ``sparse[:, 1]`` into 1000, ``S`` dynamic: Kiln keeps
    one range, the larger table's, and the net draws past the small one. The fix names the layout Kiln ranges per
    table, not a rerun of the export, which records the same one range again."""
    m = make_model(
        [
            N("Gather", ["sparse", "c0"], ["ids0"], axis=1),
            N("Gather", ["sparse", "c1"], ["ids1"], axis=1),
            N("Gather", ["small", "ids0"], ["a"]),
            N("Gather", ["big", "ids1"], ["b"]),
            N("Concat", ["a", "b"], ["y"], axis=1),
        ],
        [("sparse", ["N", 2, "S"], INT64)],
        ["y"],
        {"small": f32(10, 4), "big": f32(1000, 4), "c0": np.array(0, np.int64), "c1": np.array(1, np.int64)},
    )
    with pytest.raises(ModelError, match="out of data bounds") as err:
        optimize_model(m, OptimizeConfig(), int_ranges=recorded)
    assert err.value.hint == (
        "the integers the safety net drew for 'sparse' index past a table of the graph: where 'sparse' packs ids "
        "for tables of their own, Kiln ranges the tables one by one only where every axis after the one they are "
        "taken apart along is fixed (sparse [batch, tables, ids] read as sparse[:, i]): fix the size of those axes "
        "at export, or give one input per table; or set optimize.verify: false to rewrite without checking"
    )


def test_a_dynamic_axis_the_graph_fixes_is_named_as_such():
    """A TorchScript export of attention reshapes to the example's length: the net's random inputs cannot run it,
    and the fix says why and what to re-export, not to lower int_high."""
    m = make_model(
        [N("Reshape", ["x", "shape"], ["y"])], [("x", ["N", "seq", 4], FLOAT)], ["y"], {"shape": np.array([-1, 10, 4])}
    )
    with pytest.raises(ModelError, match="cannot be reshaped") as err:
        optimize_model(m, OptimizeConfig())
    assert "fixes the size of an axis its inputs declare dynamic" in err.value.hint
    out, s = optimize_model(m, OptimizeConfig(verify_batch=10))
    assert s["verified"]
    # `kiln optimize FILE` sizes the axes from signature.shapes: a size the model's own arithmetic refuses (frames
    # stacked by 4 at a length of 2) is the likelier cause, said first
    with pytest.raises(ModelError, match="cannot be reshaped") as err:
        optimize_model(m, OptimizeConfig(), by_shapes=True)
    assert err.value.hint.startswith("give sizes the model takes on axis 'seq': --set 'signature.shapes={seq: [")


def test_dynamic_spatial_axes_are_not_forced_to_one():
    """Batch 1 is checked on the batch axis only: a dynamic H/W that cannot be 1 keeps verify_batch (it once made
    the net refuse such models outright)."""
    m = make_model(
        [N("Conv", ["x", "w"], ["c"]), N("Identity", ["c"], ["y"])],
        [("x", ["N", 3, "H", "W"], FLOAT)],
        ["y"],
        {"w": f32(4, 3, 2, 2)},
    )
    out, s = run_pass(m, "eliminate_identity")  # 2x2 Conv without padding: H = W = 1 would be refused
    assert ops(out) == ["Conv"] and s["verified"]


def test_dynamic_axes_take_the_sizes_the_data_has():
    """A 1-D convolution over audio (kernel 20) cannot run at verify_batch samples, nor at 16: with the sizes the
    export saw in the data (export/dynamic_sizes.json) the net runs the model at the largest of them, and the
    smallest."""
    m = make_model(
        [N("Conv", ["x", "w"], ["c"]), N("Identity", ["c"], ["y"])],
        [("x", ["N", 1, "T"], FLOAT)],
        ["y"],
        {"w": f32(4, 1, 20)},
    )
    with pytest.raises(ModelError, match="safety net cannot run"):
        optimize_model(m, OptimizeConfig(passes=["eliminate_identity"]))
    out, s = optimize_model(m, OptimizeConfig(passes=["eliminate_identity"]), {"x": {2: [400, 800]}})
    assert ops(out) == ["Conv"] and s["verified"]
    one_length = Verifier(m, OptimizeConfig(), {"x": {2: [400, 400]}})  # one length L: L and L/2, as validation
    assert [f["x"].shape for f in one_length.feeds] == [(2, 1, 400), (1, 1, 200)]


def _audio() -> onnx.ModelProto:
    """A 1-D convolution over audio (kernel 20, past every size tried without data) on a dynamic ``samples`` axis,
    and no integer input."""
    return make_model(
        [N("Conv", ["x", "w"], ["c"]), N("Identity", ["c"], ["y"])],
        [("x", ["N", 1, "samples"], FLOAT)],
        ["y"],
        {"w": f32(4, 1, 20)},
    )


def test_the_fix_for_a_float_model_names_no_int_high():
    """Before: every fix began with optimize.int_high, which draws integer inputs only, for a Wav2Vec2 export
    without any; the fix names the axes optimize.verify_batch would size besides the batch."""
    with pytest.raises(ModelError, match="safety net cannot run") as err:
        optimize_model(_audio(), OptimizeConfig())
    assert "int_high" not in err.value.hint
    assert err.value.hint == (
        "set optimize.verify_batch to a size the batch and axis 'samples' all take; or set optimize.verify: false "
        "to rewrite without checking"
    )


def test_the_fix_names_signature_shapes_where_the_caller_sizes_axes_by_it():
    """``kiln optimize FILE`` sizes named axes from signature.shapes (``by_shapes``): its fix names that setting
    with the graph's axis names; the pipeline's optimize (the data's sizes) does not."""
    with pytest.raises(ModelError, match="safety net cannot run") as err:
        optimize_model(_audio(), OptimizeConfig(), {}, by_shapes=True)
    assert err.value.hint.startswith(
        "give the sizes the model takes on axis 'samples': --set 'signature.shapes={samples: [MIN, MAX]}'; or set "
        "optimize.verify_batch to a size the batch and axis 'samples' all take"
    )


def test_the_fix_for_a_model_with_integer_inputs_names_int_high_and_no_sized_axis():
    """Integer inputs drawn from [0, int_high] (ids * 2 index the table: no range of their own): int_high applies.
    An axis the data sized is not verify_batch's: the batch alone is."""
    m = make_model(
        [N("Mul", ["ids", "two"], ["doubled"]), N("Gather", ["table", "doubled"], ["g"]), N("Conv", ["x", "w"], ["y"])],
        [("ids", ["N", "seq"], INT64), ("x", ["N", 1, "samples"], FLOAT)],
        ["y", "g"],
        {"table": f32(5, 4), "w": f32(4, 1, 10), "two": np.array(2, np.int64)},
    )
    hint = unrunnable_hint(m, "Invalid input shape", {"ids": {1: [4, 8]}}, by_shapes=False)
    assert hint == (
        "set optimize.int_high below the smallest vocabulary / index range; or set optimize.verify_batch to a size "
        "the batch and axis 'samples' all take; or set optimize.verify: false to rewrite without checking"
    )
    sized = unrunnable_hint(m, "Invalid input shape", {"ids": {1: [4, 8]}, "x": {2: [400, 800]}}, by_shapes=False)
    assert "set optimize.verify_batch to a batch size the model takes" in sized
    direct = make_model([N("Gather", ["table", "ids"], ["g"])], [("ids", ["N", 3], INT64)], ["g"], {"table": f32(5, 4)})
    assert unrunnable_hint(direct, "Invalid input shape", None, by_shapes=True) == (  # drawn from the table's rows
        "set optimize.verify_batch to a batch size the model takes; or set optimize.verify: false to rewrite without "
        "checking (optimize.int_high does not change 'ids': drawn from the rows of the tables indexed)"
    )


def test_an_index_drawn_past_a_table_is_fixed_by_the_integers_not_the_batch_size():
    """ONNX Runtime's Gather stops at an index past its table ("out of data bounds"): for ids drawn from
    [0, int_high] the fix is a lower int_high, not verify_batch, which changes no value."""
    m = make_model(
        [N("Mul", ["ids", "two"], ["doubled"]), N("Gather", ["table", "doubled"], ["g"])],
        [("ids", ["N", 3], INT64)],
        ["g"],
        {"table": f32(10, 4), "two": np.array(2, np.int64)},
    )
    with pytest.raises(ModelError, match="out of data bounds") as err:
        optimize_model(m, OptimizeConfig(int_high=100))
    assert err.value.hint == (
        "the integers the safety net drew for 'ids' index past a table of the graph: set optimize.int_high below "
        "the rows of the smallest table 'ids' index; or set optimize.verify: false to rewrite without checking"
    )


def test_an_input_model_that_fails_the_checker_is_still_optimized():
    """The checker cannot judge passes on a graph it already rejects (IR 3: an initializer that is not an input):
    every pass was rolled back as 'not a valid ONNX graph'."""
    m = make_model(
        [N("MatMul", ["x", "W"], ["h"]), N("Identity", ["h"], ["y"])], [("x", ["N", 4], FLOAT)], ["y"], {"W": f32(4, 4)}
    )
    m.ir_version = 3
    out, s = optimize_model(m, OptimizeConfig(passes=["eliminate_identity"]))
    assert s["rolled_back"] == [] and ops(out) == ["MatMul"]


def test_rollback_reason_keeps_the_type_error_at_the_end_of_a_nested_message():
    # Before: cut at 200 characters, which ended inside "Mismatched tensor element type: inferred=flo".
    from kiln.core.text import short_reason

    msg = (
        "[ONNXRuntimeError] : 1 : FAIL : Node (n19_16) Op (Loop) [TypeInferenceError] Graph attribute inferencing "
        "failed: Node (n13_37) Op (If) [TypeInferenceError] "
        + "Graph attribute inferencing failed: " * 12
        + "Mismatched tensor element type: inferred=float64 declared=float32"
    )
    short = short_reason(RuntimeError(msg))
    assert short.startswith("Node (n19_16) Op (Loop)") and short.endswith("inferred=float64 declared=float32")
    assert len(short) <= 400 and " ... " in short
    assert short_reason("one\nline") == "one line"


def test_batch_one_is_checked_at_the_data_s_size_where_the_model_does_not_take_half_of_it() -> None:
    """Two 5x5 convolutions without padding need 9 pixels: the data's 16 runs, half of it (8, the second size) does
    not. The safety net still checks batch 1, at 16, where it checked one feed only and blamed the batch."""
    m = make_model(
        [h.make_node("Conv", ["x", "w"], ["y"]), h.make_node("Conv", ["y", "w"], ["z"])],
        [("x", ["batch", 1, "h", "w_"], FLOAT)],
        ["z"],
        {"w": f32(1, 1, 5, 5)},
    )
    verifier = Verifier(m, OptimizeConfig(), data_sizes={"x": {2: [16], 3: [16]}})
    assert [f["x"].shape for f in verifier.feeds] == [(OptimizeConfig().verify_batch, 1, 16, 16), (1, 1, 16, 16)]


@pytest.mark.parametrize(("training", "random"), [(True, True), (False, False)])
def test_a_dropout_in_training_mode_is_a_random_op(training: bool, random: bool) -> None:
    """An exported F.dropout(x, p, training=True) drops at inference: compared by value, a pass that moved the draw
    (eliminate_identity) was rolled back as if it changed the model. One with training_mode false is deterministic."""
    m = make_model(
        [
            N("Identity", ["x"], ["i"]),
            N("Dropout", ["i", "ratio", "mode"], ["y"]),
        ],
        [("x", ["N", 64], FLOAT)],
        ["y"],
        {"ratio": np.array(0.5, dtype=np.float32), "mode": np.array(training)},
    )
    assert Verifier(m, OptimizeConfig()).random is random


def _seq_model(table: int | None) -> onnx.ModelProto:
    """x [batch, seq] plus a position term: none (any length runs), or the first seq entries of a table of
    ``table`` positions, which refuses a longer sequence."""
    x = [("x", ["batch", "seq"], FLOAT)]
    if table is None:
        return make_model([h.make_node("Relu", ["x"], ["y"])], x, ["y"], {})
    nodes = [
        h.make_node("Shape", ["x"], ["shape"]),
        h.make_node("Gather", ["shape", "one"], ["seq"]),
        h.make_node("Slice", ["table", "zero", "seq", "one"], ["positions"]),
        h.make_node("Add", ["x", "positions"], ["y"]),
    ]
    inits = {"table": np.ones((1, table), np.float32), "zero": np.array([0]), "one": np.array([1])}
    return make_model(nodes, x, ["y"], inits)


def test_the_safety_net_checks_an_axis_without_data_at_a_longer_size_where_the_model_takes_it() -> None:
    """With no data, a sequence of 2 leaves untouched what only longer ones reach (a relative-position bucket past
    the first few): the first feed takes 16 where the model runs it, and the size of verify_batch where it does not
    (a position table of 8)."""
    assert Verifier(_seq_model(None), OptimizeConfig()).feeds[0]["x"].shape == (2, 16)
    assert Verifier(_seq_model(8), OptimizeConfig()).feeds[0]["x"].shape == (2, 2)
