"""Each pass fires on its pattern (and the safety net agrees it kept the function) and does not fire where
rewriting would be wrong."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from onnx import helper as h
from onnx import numpy_helper

from tests.stages.optimize.optimize_helpers import FLOAT, INT64, f32, make_model, ops, run_pass, same_outputs

TESTED: set[str] = set()  # filled by the tests below; test_optimize_registry checks every pass is here


def covers(*names: str):
    TESTED.update(names)
    return lambda fn: fn


def conv_bn(extra_reader: bool = False):
    nodes = [
        h.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
        h.make_node("BatchNormalization", ["c", "g", "b", "m", "v"], ["y"]),
    ]
    outs = ["y"]
    if extra_reader:
        nodes.append(h.make_node("Relu", ["c"], ["r"]))
        outs.append("r")
    rng = np.random.default_rng(1)
    inits = {
        "w": f32(4, 3, 3, 3),
        "g": f32(4) + 2,
        "b": f32(4),
        "m": f32(4),
        "v": rng.random(4, dtype=np.float32) + 0.5,
    }
    return make_model(nodes, [("x", ["N", 3, 6, 6], FLOAT)], outs, inits)


@covers("fold_conv_bn")
def test_conv_bn_folds_and_respects_other_readers():
    out, s = run_pass(conv_bn(), "fold_conv_bn")
    assert ops(out) == ["Conv"] and s["passes"][0]["max_abs_err"] < 1e-5
    out, s = run_pass(conv_bn(extra_reader=True), "fold_conv_bn")
    assert "BatchNormalization" in ops(out) and s["passes"][0]["changes"] == 0


@covers("fold_conv_add")
def test_conv_add_bias():
    def model(c: np.ndarray):
        return make_model(
            [h.make_node("Conv", ["x", "w"], ["c"]), h.make_node("Add", ["c", "k"], ["y"])],
            [("x", ["N", 3, 4, 4], FLOAT)],
            ["y"],
            {"w": f32(5, 3, 1, 1), "k": c},
        )

    out, _ = run_pass(model(f32(1, 5, 1, 1)), "fold_conv_add")
    assert ops(out) == ["Conv"]
    out, s = run_pass(model(f32(1, 5, 4, 4)), "fold_conv_add")  # varies over space: not a bias
    assert ops(out) == ["Conv", "Add"]


@covers("matmul_add_to_gemm")
def test_matmul_add_gemm_only_for_2d():
    def model(shape):
        return make_model(
            [h.make_node("MatMul", ["x", "w"], ["m"]), h.make_node("Add", ["m", "b"], ["y"])],
            [("x", shape, FLOAT)],
            ["y"],
            {"w": f32(8, 4), "b": f32(4)},
        )

    out, _ = run_pass(model(["N", 8]), "matmul_add_to_gemm")
    assert ops(out) == ["Gemm"]
    out, _ = run_pass(model(["N", 3, 8]), "matmul_add_to_gemm")
    assert ops(out) == ["MatMul", "Add"]


@covers("merge_transposes")
def test_transposes_compose_or_vanish():
    def model(p2):
        return make_model(
            [
                h.make_node("Relu", ["x"], ["r"]),
                h.make_node("Transpose", ["r"], ["t"], perm=[0, 2, 1, 3]),
                h.make_node("Transpose", ["t"], ["u"], perm=p2),
                h.make_node("Relu", ["u"], ["y"]),
            ],
            [("x", ["N", 2, 3, 4], FLOAT)],
            ["y"],
            {},
        )

    out, _ = run_pass(model([0, 1, 3, 2]), "merge_transposes")
    assert ops(out) == ["Relu", "Transpose", "Relu"]
    out, _ = run_pass(model([0, 2, 1, 3]), "merge_transposes")
    assert ops(out) == ["Relu", "Relu"]


@covers("merge_reshapes")
def test_reshape_chain_merges_unless_zero_copies_axis():
    def model(shape, allowzero=0):
        return make_model(
            [
                h.make_node("Reshape", ["x", "s1"], ["a"]),
                h.make_node("Reshape", ["a", "s2"], ["y"], allowzero=allowzero),
            ],
            [("x", [2, 3, 4], FLOAT)],
            ["y"],
            {"s1": np.array([6, 4]), "s2": np.array(shape)},
        )

    out, _ = run_pass(model([4, 6]), "merge_reshapes")
    assert ops(out) == ["Reshape"]
    out, s = run_pass(model([0, -1]), "merge_reshapes")  # 0 copies the intermediate's first axis (6, not 2)
    assert ops(out) == ["Reshape", "Reshape"] and s["passes"][0]["changes"] == 0


def linear_scaled(scale: float, op: str = "Div"):
    return make_model(
        [
            h.make_node("MatMul", ["x", "w"], ["m"]),
            h.make_node("Add", ["m", "b"], ["a"]),
            h.make_node(op, ["a", "s"], ["y"]),
        ],
        [("x", ["N", 5, 8], FLOAT)],
        ["y"],
        {"w": f32(8, 8), "b": f32(8), "s": np.array(scale, np.float32)},
    )


@covers("fold_scalar_mul")
def test_scalar_folds_into_weights_when_exact():
    out, _ = run_pass(linear_scaled(8.0), "fold_scalar_mul")
    assert ops(out) == ["MatMul", "Add"]
    out, s = run_pass(linear_scaled(3.0), "fold_scalar_mul")  # 1/3 is not exact in binary
    assert ops(out) == ["MatMul", "Add", "Div"] and s["passes"][0]["changes"] == 0
    out, _ = run_pass(linear_scaled(3.0), "fold_scalar_mul", exact_only=False)
    assert ops(out) == ["MatMul", "Add"]


def test_scalar_fold_reaches_through_attention_scores():
    # (x Wq + bq) reshaped/transposed, times K^T, divided by sqrt(d): the scale lands in Wq and bq
    def proj(p: str) -> list:
        return [
            h.make_node("MatMul", ["x", f"w{p}"], [f"{p}0"]),
            h.make_node("Add", [f"{p}0", f"b{p}"], [f"{p}1"]),
            h.make_node("Reshape", [f"{p}1", "shp"], [f"{p}2"]),
            h.make_node("Transpose", [f"{p}2"], [p], perm=[0, 2, 1, 3]),
        ]

    nodes = (
        proj("q")
        + proj("k")
        + [
            h.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
            h.make_node("MatMul", ["q", "kt"], ["sc"]),
            h.make_node("Div", ["sc", "d"], ["y"]),
        ]
    )
    inits = {
        "wq": f32(8, 8),
        "bq": f32(8),
        "wk": f32(8, 8, seed=1),
        "bk": f32(8, seed=2),
        "shp": np.array([2, 4, 2, 4]),
        "d": np.array(2.0, np.float32),
    }
    out, s = run_pass(make_model(nodes, [("x", [2, 4, 8], FLOAT)], ["y"], inits), "fold_scalar_mul")
    assert "Div" not in ops(out) and s["passes"][0]["max_abs_err"] == 0.0  # a power of two scales exactly
    shared = make_model(
        proj("q")
        + [
            h.make_node("Transpose", ["q"], ["kt"], perm=[0, 1, 3, 2]),
            h.make_node("MatMul", ["q", "kt"], ["sc"]),
            h.make_node("Div", ["sc", "d"], ["y"]),
        ],
        [("x", [2, 4, 8], FLOAT)],
        ["y"],
        inits,
    )
    out, s = run_pass(shared, "fold_scalar_mul")  # q feeds both operands: scaling Wq would scale twice
    assert "Div" in ops(out)


def qkv(n_branches: int, shared_input: bool = True):
    nodes, inits, outs = [], {}, []
    for i in range(n_branches):
        src = "x" if shared_input or i == 0 else "x2"
        nodes += [h.make_node("MatMul", [src, f"w{i}"], [f"m{i}"]), h.make_node("Add", [f"m{i}", f"b{i}"], [f"y{i}"])]
        inits.update({f"w{i}": f32(8, 8, seed=i), f"b{i}": f32(8, seed=10 + i)})
        outs.append(f"y{i}")
    ins = [("x", ["N", 3, 8], FLOAT)] + ([] if shared_input else [("x2", ["N", 3, 8], FLOAT)])
    return make_model(nodes, ins, outs, inits)


@covers("merge_qkv")
def test_qkv_merge():
    out, _ = run_pass(qkv(3), "merge_qkv")
    assert sorted(ops(out)) == ["Add", "MatMul", "Split"]
    assert [o.name for o in out.graph.output] == ["y0", "y1", "y2"]
    out, s = run_pass(qkv(2, shared_input=False), "merge_qkv")  # different inputs: nothing to share
    assert s["passes"][0]["changes"] == 0


def decomposed_layernorm(axes=(-1,)):
    nodes = [
        h.make_node("ReduceMean", ["x", "ax"], ["mu"]),
        h.make_node("Sub", ["x", "mu"], ["d"]),
        h.make_node("Pow", ["d", "two"], ["d2"]),
        h.make_node("ReduceMean", ["d2", "ax"], ["var"]),
        h.make_node("Add", ["var", "eps"], ["ve"]),
        h.make_node("Sqrt", ["ve"], ["sd"]),
        h.make_node("Div", ["d", "sd"], ["n"]),
        h.make_node("Mul", ["n", "g"], ["ng"]),
        h.make_node("Add", ["ng", "b"], ["y"]),
    ]
    return make_model(
        nodes,
        [("x", ["N", 3, 8], FLOAT)],
        ["y"],
        {
            "ax": np.array(axes),
            "two": np.array(2.0, np.float32),
            "eps": np.array(1e-5, np.float32),
            "g": f32(8) + 1,
            "b": f32(8),
        },
    )


@covers("fuse_layernorm")
def test_layernorm_fusion():
    out, _ = run_pass(decomposed_layernorm(), "fuse_layernorm")
    assert ops(out) == ["LayerNormalization"]
    out, s = run_pass(decomposed_layernorm(axes=(1,)), "fuse_layernorm")  # not the trailing axis
    assert s["passes"][0]["changes"] == 0


def erf_gelu(opset: int, exporter_form: bool = True, c: float = math.sqrt(2)):
    tail = (
        [h.make_node("Mul", ["half", "e1"], ["hm"]), h.make_node("Mul", ["x", "hm"], ["y"])]
        if exporter_form
        else [h.make_node("Mul", ["x", "e1"], ["xm"]), h.make_node("Mul", ["xm", "half"], ["y"])]
    )
    nodes = [
        h.make_node("Div", ["x", "c"], ["u"]),
        h.make_node("Erf", ["u"], ["e"]),
        h.make_node("Add", ["e", "one"], ["e1"]),
    ] + tail
    return make_model(
        nodes,
        [("x", ["N", 8], FLOAT)],
        ["y"],
        {"c": np.array(c, np.float32), "one": np.array(1.0, np.float32), "half": np.array(0.5, np.float32)},
        opset=opset,
    )


@covers("fuse_gelu")
def test_gelu_fusion():
    out, _ = run_pass(erf_gelu(20), "fuse_gelu")
    assert ops(out) == ["Gelu"]
    out, s = run_pass(erf_gelu(18), "fuse_gelu")  # no Gelu before opset 20: canonical erf form
    assert ops(out) == ["Div", "Erf", "Add", "Mul", "Mul"] and s["passes"][0]["changes"] == 1
    out, s = run_pass(erf_gelu(18, exporter_form=False), "fuse_gelu")  # already canonical
    assert s["passes"][0]["changes"] == 0
    out, s = run_pass(erf_gelu(20, c=1.5), "fuse_gelu")  # not GELU's constant
    assert s["passes"][0]["changes"] == 0


def test_tanh_gelu_fusion():
    k = math.sqrt(2 / math.pi)
    nodes = [
        h.make_node("Pow", ["x", "three"], ["x3"]),
        h.make_node("Mul", ["x3", "c"], ["x3c"]),
        h.make_node("Add", ["x", "x3c"], ["inner"]),
        h.make_node("Mul", ["inner", "k"], ["ik"]),
        h.make_node("Tanh", ["ik"], ["t"]),
        h.make_node("Add", ["t", "one"], ["t1"]),
        h.make_node("Mul", ["x", "t1"], ["xm"]),
        h.make_node("Mul", ["xm", "half"], ["y"]),
    ]
    m = make_model(
        nodes,
        [("x", ["N", 8], FLOAT)],
        ["y"],
        {
            "three": np.array(3.0, np.float32),
            "c": np.array(0.044715, np.float32),
            "k": np.array(k, np.float32),
            "one": np.array(1.0, np.float32),
            "half": np.array(0.5, np.float32),
        },
        opset=20,
    )
    out, _ = run_pass(m, "fuse_gelu")
    assert ops(out) == ["Gelu"] and out.graph.node[0].attribute[0].s == b"tanh"


@covers("canonical_softmax")
def test_softmax_axis_made_negative():
    m = make_model([h.make_node("Softmax", ["x"], ["y"], axis=2)], [("x", ["N", 3, 4], FLOAT)], ["y"], {})
    out, s = run_pass(m, "canonical_softmax")
    assert s["passes"][0]["changes"] == 1 and out.graph.node[0].attribute[0].i == -1
    m = make_model([h.make_node("Softmax", ["x"], ["y"], axis=1)], [("x", ["N", 3, 4], FLOAT)], ["y"], {})
    assert run_pass(m, "canonical_softmax")[1]["passes"][0]["changes"] == 0


@covers("fold_constants", "cleanup", "toposort", "remove_unused_initializers")
def test_fold_constants_turns_batch_only_shape_subgraphs_into_constants():
    nodes = [
        h.make_node("Shape", ["x"], ["s"], start=0, end=1),
        h.make_node("Concat", ["s", "rest"], ["shp"], axis=0),
        h.make_node("Reshape", ["x", "shp"], ["r"]),
        h.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]),
        h.make_node("MatMul", ["r", "wt"], ["y"]),
        h.make_node("CastLike", ["zero", "x"], ["z"]),
        h.make_node("Add", ["y", "z"], ["y2"]),
    ]
    m = make_model(
        nodes,
        [("x", ["N", 2, 4], FLOAT)],
        ["y2"],
        {"rest": np.array([8]), "w": f32(3, 8), "zero": np.array(0.0, np.float64), "unused": f32(3)},
    )
    out, _ = run_pass(m, "fold_constants")
    assert ops(out) == ["Reshape", "MatMul", "Add"]
    assert "unused" not in {i.name for i in out.graph.initializer}
    out, _ = run_pass(out, "remove_unused_initializers")
    out, _ = run_pass(out, "cleanup")


@covers("eliminate_identity")
def test_identity_and_dropout_removed_but_graph_io_names_kept():
    m = make_model(
        [
            h.make_node("Identity", ["x"], ["a"]),
            h.make_node("Relu", ["a"], ["b"]),
            h.make_node("Dropout", ["b"], ["c"]),
            h.make_node("Identity", ["c"], ["y"]),
        ],
        [("x", ["N", 4], FLOAT)],
        ["y"],
        {},
    )
    out, _ = run_pass(m, "eliminate_identity")
    assert ops(out) == ["Relu"] and out.graph.output[0].name == "y" and out.graph.input[0].name == "x"


@covers("eliminate_noop")
def test_noop_and_cast_chains():
    nodes = [
        h.make_node("Cast", ["x"], ["a"], to=FLOAT),
        h.make_node("Transpose", ["a"], ["b"], perm=[0, 1]),
        h.make_node("Reshape", ["b", "same"], ["c"]),
        h.make_node("Cast", ["c"], ["d"], to=11),  # f64
        h.make_node("Cast", ["d"], ["e"], to=FLOAT),
        h.make_node("Slice", ["e", "st", "en"], ["f"]),
        h.make_node("Relu", ["f"], ["y"]),
    ]
    m = make_model(
        nodes,
        [("x", ["N", 4], FLOAT)],
        ["y"],
        {"same": np.array([-1, 4]), "st": np.array([0]), "en": np.array([2**63 - 1])},
    )
    out, _ = run_pass(m, "eliminate_noop")
    assert ops(out) == ["Relu"]
    lossy = make_model(
        [h.make_node("Cast", ["x"], ["a"], to=TensorProto_FLOAT16), h.make_node("Cast", ["a"], ["y"], to=FLOAT)],
        [("x", ["N", 4], FLOAT)],
        ["y"],
        {},
    )
    out, _ = run_pass(lossy, "eliminate_noop")
    assert ops(out) == ["Cast", "Cast"]  # float32 -> float16 rounds: both casts stay


TensorProto_FLOAT16 = 10


@covers("eliminate_noop")
def test_zero_pads_ones_tiles_full_slices_and_same_shape_expands_go_but_real_ones_stay():
    def chain(pads: list[int], repeats: list[int], end: int, expand: list[int]) -> Any:
        nodes = [
            h.make_node("Pad", ["x", "pads"], ["a"], mode="constant"),
            h.make_node("Tile", ["a", "reps"], ["b"]),
            h.make_node("Slice", ["b", "st", "en", "ax"], ["c"]),
            h.make_node("Expand", ["c", "shape"], ["d"]),
            h.make_node("Relu", ["d"], ["y"]),
        ]
        inits = {
            "pads": np.array(pads, np.int64),
            "reps": np.array(repeats, np.int64),
            "st": np.array([0]),
            "en": np.array([end]),
            "ax": np.array([2]),
            "shape": np.array(expand, np.int64),
        }
        return make_model(nodes, [("x", ["N", 3, 8, 8], FLOAT)], ["y"], inits)

    out, s = run_pass(chain([0] * 8, [1, 1, 1, 1], 8, [1, 3, 8, 8]), "eliminate_noop")
    assert ops(out) == ["Relu"] and sum(e["changes"] for e in s["passes"]) == 4  # over its rounds
    real = chain([0, 0, 1, 1, 0, 0, 1, 1], [1, 1, 2, 1], 4, [2, 3, 1, 1])
    out, _ = run_pass(real, "eliminate_noop")
    assert ops(out) == ["Pad", "Tile", "Slice", "Expand", "Relu"]


@covers("cse")
def test_cse_merges_duplicates_not_random_ops():
    nodes = [
        h.make_node("Relu", ["x"], ["a"]),
        h.make_node("Relu", ["x"], ["b"]),
        h.make_node("Add", ["a", "c1"], ["a1"]),
        h.make_node("Add", ["b", "c2"], ["b1"]),
        h.make_node("Mul", ["a1", "b1"], ["y"]),
    ]
    m = make_model(nodes, [("x", ["N", 4], FLOAT)], ["y"], {"c1": np.ones(4, np.float32), "c2": np.ones(4, np.float32)})
    out, _ = run_pass(m, "cse")
    assert ops(out) == ["Relu", "Add", "Mul"]
    rnd = make_model(
        [
            h.make_node("RandomNormalLike", ["x"], ["a"]),
            h.make_node("RandomNormalLike", ["x"], ["b"]),
            h.make_node("Add", ["a", "b"], ["y"]),
        ],
        [("x", ["N", 4], FLOAT)],
        ["y"],
        {},
    )
    from kiln.stages.optimize.api import optimize_model
    from kiln.stages.optimize.config import OptimizeConfig

    out, s = optimize_model(rnd, OptimizeConfig(passes=["cse"], verify=False))
    assert ops(out).count("RandomNormalLike") == 2


def test_cse_merges_big_duplicate_weights_by_content_not_by_their_first_and_last_bytes():
    w = f32(16, 16)
    middle = w.copy()
    middle[8, 8] += 1.0  # same shape, first and last bytes as w: must stay apart
    nodes = [h.make_node("MatMul", ["x", name], [f"m{i}"]) for i, name in enumerate(["w", "w2", "wm", "wt"])]
    nodes += [h.make_node("Sum", ["m0", "m1", "m2", "m3"], ["y"])]
    m = make_model(nodes, [("x", ["N", 16], FLOAT)], ["y"], {"w": w, "w2": w.copy(), "wm": middle, "wt": w.copy()})
    typed = h.make_tensor("wt", FLOAT, [16, 16], w.ravel().tolist(), raw=False)  # w again, as float_data
    m.graph.initializer[3].CopyFrom(typed)
    out, _ = run_pass(m, "cse")
    assert ops(out).count("MatMul") == 2
    feed = {"x": f32(3, 16, seed=2)}
    same_outputs(m, out, feed)


def test_int64_inputs_are_respected_by_the_safety_net():
    m = make_model(
        [h.make_node("Gather", ["table", "ids"], ["e"]), h.make_node("Identity", ["e"], ["y"])],
        [("ids", ["N", 3], INT64)],
        ["y"],
        {"table": f32(17, 4)},
    )
    out, s = run_pass(m, "eliminate_identity")  # ids beyond 16 would make ORT fail: inputs must stay in range
    assert s["verified"] and ops(out) == ["Gather"]


def _typed_constant(name: str, attr: str, value: list | float | int) -> Any:
    import onnx

    node = h.make_node("Constant", [], [name])
    kind = {"value_floats": onnx.AttributeProto.FLOATS, "value_ints": onnx.AttributeProto.INTS}.get(attr)
    node.attribute.append(h.make_attribute(attr, value, attr_type=kind) if kind else h.make_attribute(attr, value))
    return node


@covers("fold_constants")
def test_fold_constants_keeps_value_floats_and_empty_value_ints_typed():
    # Before: graphsurgeon lowered these with np.array(attr) -> float64 tensors; ORT refused the folded graph and
    # the safety net rolled the whole pass back.
    nodes = [
        _typed_constant("f", "value_floats", [1.0, 2.0, 3.0, 4.0]),
        _typed_constant("s", "value_float", 0.5),
        _typed_constant("e", "value_ints", []),
        _typed_constant("dims", "value_ints", [-1, 4]),
        h.make_node("Mul", ["f", "s"], ["fs"]),
        h.make_node("Add", ["x", "fs"], ["a"]),
        h.make_node("Concat", ["e", "dims"], ["shp"], axis=0),
        h.make_node("Reshape", ["a", "shp"], ["y"]),
    ]
    m = make_model(nodes, [("x", ["N", 4], FLOAT)], ["y"], {})
    out, s = run_pass(m, "fold_constants")
    assert ops(out) == ["Add", "Reshape"] and s["passes"][0]["max_abs_err"] == 0.0
    init = {i.name: i.data_type for i in out.graph.initializer}
    assert 11 not in init.values(), "no float64 tensor may come out of float32 constants"


@covers("eliminate_identity")
def test_identity_elimination_survives_empty_list_attributes():
    # Before: the graph could not be written back (`Could not infer attribute value_ints type from empty iterator`),
    # so the pass crashed and every Identity stayed.
    nodes = [
        _typed_constant("e", "value_ints", []),
        h.make_node("Identity", ["x"], ["a"]),
        h.make_node("Concat", ["a", "e"], ["c"], axis=0),
        h.make_node("Identity", ["c"], ["y"]),
    ]
    m = make_model(nodes, [("x", ["N"], INT64)], ["y"], {})
    out, _ = run_pass(m, "eliminate_identity")
    assert "Identity" not in ops(out)
    empty = [a for n in out.graph.node for a in n.attribute if n.op_type == "Constant"]
    assert len(empty) == 1 and empty[0].name == "value" and empty[0].t.data_type == INT64


@covers("fold_shapes")
def test_shape_reads_of_static_axes_become_constants():
    nodes = [
        h.make_node("Shape", ["x"], ["s_end"], start=1, end=3),  # static axes 1..2 of [N, 4, 5]
        h.make_node("Shape", ["x"], ["s"]),
        h.make_node("Gather", ["s", "i2"], ["d2"], axis=0),  # static axis 2
        h.make_node("Slice", ["s", "st1", "big"], ["tail"]),  # axes 1.. -> static
        h.make_node("Gather", ["s", "i0"], ["d0"], axis=0),  # the batch: must stay
        h.make_node("Concat", ["s_end", "d2", "tail", "d0"], ["y"], axis=0),
    ]
    m = make_model(
        nodes,
        [("x", ["N", 4, 5], FLOAT)],
        ["y"],
        {"i2": np.array([2]), "st1": np.array([1]), "big": np.array([2**62]), "i0": np.array([0])},
    )
    out, s = run_pass(m, "fold_shapes")
    assert sorted(ops(out)) == ["Concat", "Gather", "Shape"] and s["passes"][0]["changes"] == 3
    dyn = make_model([h.make_node("Shape", ["x"], ["y"], start=0, end=1)], [("x", ["N", 4], FLOAT)], ["y"], {})
    assert run_pass(dyn, "fold_shapes")[1]["passes"][0]["changes"] == 0


@covers("eliminate_neutral")
def test_adding_zeros_and_multiplying_by_ones_vanish_unless_they_broadcast():
    nodes = [
        h.make_node("MatMul", ["x", "w"], ["m"]),
        h.make_node("Add", ["m", "zero_bias"], ["a"]),
        h.make_node("Mul", ["ones", "a"], ["b"]),
        h.make_node("Div", ["b", "one"], ["c"]),
        h.make_node("Sub", ["zero", "c"], ["d"]),  # 0 - c is -c: stays
        h.make_node("Add", ["d", "zero_wide"], ["y"]),
    ]  # [N,4] + zeros[3,1,4] grows the shape: stays
    m = make_model(
        nodes,
        [("x", ["N", 4], FLOAT)],
        ["y"],
        {
            "w": f32(4, 4),
            "zero_bias": np.zeros(4, np.float32),
            "ones": np.ones((1, 4), np.float32),
            "one": np.array(1.0, np.float32),
            "zero": np.array(0.0, np.float32),
            "zero_wide": np.zeros((3, 1, 4), np.float32),
        },
    )
    out, s = run_pass(m, "eliminate_neutral")
    assert ops(out) == ["MatMul", "Sub", "Add"] and s["passes"][0]["max_abs_err"] == 0.0


@covers("eliminate_zero_rnn_state")
def test_zero_initial_rnn_states_are_dropped():
    hidden = 3
    nodes = [
        h.make_node("Shape", ["x"], ["s"], start=1, end=2),
        h.make_node("Concat", ["one", "s", "hid"], ["hshape"], axis=0),
        h.make_node("Expand", ["zero", "hshape"], ["h0"]),
        h.make_node("ConstantOfShape", ["hshape"], ["c0"]),
        h.make_node("LSTM", ["x", "W", "R", "B", "", "h0", "c0"], ["Y"], hidden_size=hidden),
        h.make_node("GRU", ["x", "Wg", "Rg", "", "", "h1"], ["Yg"], hidden_size=hidden),
    ]
    m = make_model(
        nodes,
        [("x", [5, "N", 2], FLOAT), ("h1", [1, "N", hidden], FLOAT)],
        ["Y", "Yg"],
        {
            "one": np.array([1]),
            "hid": np.array([hidden]),
            "zero": np.array(0.0, np.float32),
            "W": f32(1, 4 * hidden, 2),
            "R": f32(1, 4 * hidden, hidden),
            "B": f32(1, 8 * hidden),
            "Wg": f32(1, 3 * hidden, 2),
            "Rg": f32(1, 3 * hidden, hidden),
        },
    )  # the GRU's state h1 is an input: it stays
    out, s = run_pass(m, "eliminate_zero_rnn_state")
    lstm, gru = (next(n for n in out.graph.node if n.op_type == t) for t in ("LSTM", "GRU"))
    assert list(lstm.input) == ["x", "W", "R", "B"] and gru.input[5] == "h1" and s["passes"][0]["changes"] == 2
    assert ops(out) == ["LSTM", "GRU"]


def test_passes_repeat_until_a_round_removes_nothing():
    # x * 0 folds to zeros only after eliminate_neutral has run: the second round removes the Add.
    nodes = [
        h.make_node("Mul", ["c", "zero"], ["z"]),
        h.make_node("Add", ["x", "z"], ["y0"]),
        h.make_node("Relu", ["y0"], ["y"]),
    ]
    m = make_model(nodes, [("x", ["N", 4], FLOAT)], ["y"], {"c": f32(4), "zero": np.array(0.0, np.float32)})
    from kiln.stages.optimize.api import optimize_model
    from kiln.stages.optimize.config import OptimizeConfig

    once, s1 = optimize_model(m, OptimizeConfig(passes=["eliminate_neutral", "fold_constants"], rounds=1))
    assert ops(once) == ["Add", "Relu"] and s1["rounds"] == 1
    fix, s3 = optimize_model(m, OptimizeConfig(passes=["eliminate_neutral", "fold_constants"], rounds=3))
    assert ops(fix) == ["Relu"] and s3["rounds"] == 3 and not s3["rolled_back"]
    assert [p["round"] for p in s3["passes"]] == [1, 1, 2, 2, 3, 3]


@covers("fold_constants")
def test_reshape_whose_shape_spells_batch_and_minus_one_gets_a_constant_target():
    # HF attention: view(batch, seq, -1, head_dim) with allowzero=1; shape inference cannot size the -1 axis,
    # so the output has two unknown axes and only the shape's own entries show it is static but for the batch.
    nodes = [
        h.make_node("Shape", ["x"], ["b"], start=0, end=1),
        h.make_node("Concat", ["b", "rest"], ["shp"], axis=0),
        h.make_node("Reshape", ["x", "shp"], ["r"], allowzero=1),
        h.make_node("Relu", ["r"], ["y"]),
    ]
    m = make_model(nodes, [("x", ["N", 6, 8], FLOAT)], ["y"], {"rest": np.array([6, -1, 4])})
    out, _ = run_pass(m, "fold_constants")
    assert ops(out) == ["Reshape", "Relu"]
    target = next(i for i in out.graph.initializer if i.name.endswith("_shape"))
    assert numpy_helper.to_array(target).tolist() == [0, 6, -1, 4]


@covers("fold_constants")
@pytest.mark.parametrize("opset", [13, 18])
def test_reshape_given_a_constant_target_stays_valid_at_its_opset(opset: int) -> None:
    """Opset 13 has no ``allowzero``: an opset-13 BERT's computed Reshapes were rolled back, the graph left
    unoptimized."""
    nodes = [
        h.make_node("Shape", ["x"], ["b"], start=0, end=1) if opset > 13 else h.make_node("Shape", ["x"], ["s"]),
        *([] if opset > 13 else [h.make_node("Gather", ["s", "zero"], ["b"], axis=0)]),
        h.make_node("Concat", ["b", "rest"], ["shp"], axis=0),
        h.make_node("Reshape", ["x", "shp"], ["r"]),
        h.make_node("Relu", ["r"], ["y"]),
    ]
    inits = {"rest": np.array([6, -1, 4]), **({} if opset > 13 else {"zero": np.array([0])})}
    graph = h.make_graph(
        nodes,
        "g",
        [h.make_tensor_value_info("x", FLOAT, ["N", 6, 8])],
        [h.make_tensor_value_info("y", FLOAT, ["N", 6, "k", 4])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    m = h.make_model(graph, opset_imports=[h.make_opsetid("", opset)], ir_version=9)
    out, _ = run_pass(m, "fold_constants")
    assert ops(out) == ["Reshape", "Relu"]
    assert not next(n for n in out.graph.node if n.op_type == "Reshape").attribute


@covers("split_to_sequence")
@pytest.mark.parametrize(
    "split, keepdims, picks",
    [
        (np.array(2, np.int64), 1, [0, -1]),  # torch.split(x, 2): pieces of 2 (the dynamo exporter's form)
        (np.array([1, 2, 3], np.int64), 1, [2, 0]),  # explicit sizes
        (None, 0, [1, 5]),  # one element per piece, squeezed
    ],
)
def test_split_to_sequence_becomes_split(split, keepdims, picks) -> None:
    """TensorRT's parser has no sequence ops: a transformers GPT-2 built no TensorRT engine."""
    inits = {"pos0": np.array(picks[0], np.int64), "pos1": np.array(picks[1], np.int64)}
    inputs = ["x"]
    if split is not None:
        inits["split"] = split
        inputs.append("split")
    m = make_model(
        [
            h.make_node("SplitToSequence", inputs, ["seq"], axis=1, keepdims=keepdims),
            h.make_node("SequenceAt", ["seq", "pos0"], ["a"]),
            h.make_node("SequenceAt", ["seq", "pos1"], ["b"]),
            h.make_node("Mul", ["a", "b"], ["y"]),
        ],
        [("x", ["N", 6], FLOAT)],
        ["y"],
        inits,
    )
    out, _ = run_pass(m, "split_to_sequence")
    assert "Split" in ops(out) and not {"SplitToSequence", "SequenceAt"} & set(ops(out))
    same_outputs(m, out, {"x": f32(3, 6)})
