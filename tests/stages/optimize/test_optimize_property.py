"""Property: random small graphs stitched from the patterns the passes target, optimized by the default
pipeline with the safety net OFF, still compute the same function (checked here, independently)."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import helper as h

from kiln.stages.optimize.api import optimize_model
from kiln.stages.optimize.config import OptimizeConfig
from tests.stages.optimize.optimize_helpers import FLOAT, f32, make_model, same_outputs

D = 8


class Builder:
    def __init__(self, seed: int) -> None:
        self.nodes, self.inits, self.i, self.seed = [], {}, 0, seed

    def name(self, p: str) -> str:
        self.i += 1
        return f"{p}{self.i}"

    def const(self, v: np.ndarray) -> str:
        n = self.name("c")
        self.inits[n] = v
        return n

    def op(self, op: str, ins: list[str], **attrs) -> str:
        out = self.name(op.lower())
        self.nodes.append(h.make_node(op, ins, [out], name=self.name("n"), **attrs))
        return out

    def w(self, *shape: int) -> str:
        self.seed += 1
        return self.const((f32(*shape, seed=self.seed) / np.sqrt(shape[0])).astype(np.float32))


def linear(b: Builder, x: str, scale: float | None) -> str:
    y = b.op("Add", [b.op("MatMul", [x, b.w(D, D)]), b.w(D)])
    return b.op("Div", [y, b.const(np.array(scale, np.float32))]) if scale else y


def gelu(b: Builder, x: str) -> str:
    e = b.op("Erf", [b.op("Div", [x, b.const(np.array(np.sqrt(2), np.float32))])])
    e1 = b.op("Add", [e, b.const(np.array(1.0, np.float32))])
    return b.op("Mul", [x, b.op("Mul", [b.const(np.array(0.5, np.float32)), e1])])


def layernorm(b: Builder, x: str) -> str:
    ax = b.const(np.array([-1]))
    d = b.op("Sub", [x, b.op("ReduceMean", [x, ax])])
    var = b.op("ReduceMean", [b.op("Pow", [d, b.const(np.array(2.0, np.float32))]), ax])
    sd = b.op("Sqrt", [b.op("Add", [var, b.const(np.array(1e-5, np.float32))])])
    return b.op("Add", [b.op("Mul", [b.op("Div", [d, sd]), b.w(D)]), b.w(D)])


def qkv_sum(b: Builder, x: str) -> str:
    q, k, v = (linear(b, x, None) for _ in range(3))
    return b.op("Add", [b.op("Mul", [q, k]), v])


def transposes(b: Builder, x: str) -> str:
    return b.op("Transpose", [b.op("Transpose", [x], perm=[0, 2, 1])], perm=[0, 2, 1])


def noops(b: Builder, x: str) -> str:
    y = b.op("Cast", [b.op("Cast", [b.op("Identity", [x])], to=11)], to=FLOAT)
    return b.op("Reshape", [y, b.const(np.array([-1, 3, D]))])


BLOCKS = {
    "linear": lambda b, x: linear(b, x, None),
    "linear_div4": lambda b, x: linear(b, x, 4.0),
    "linear_div3": lambda b, x: linear(b, x, 3.0),
    "gelu": gelu,
    "layernorm": layernorm,
    "qkv": qkv_sum,
    "transposes": transposes,
    "noops": noops,
    "relu": lambda b, x: b.op("Relu", [x]),
}


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(sorted(BLOCKS)), min_size=1, max_size=6), st.integers(0, 1000))
def test_random_pattern_graphs_keep_their_function(blocks, seed):
    b = Builder(seed)
    x = "x"
    for name in blocks:
        x = BLOCKS[name](b, x)
    b.nodes.append(h.make_node("Identity", [x], ["y"]))
    model = make_model(b.nodes, [("x", ["N", 3, D], FLOAT)], ["y"], b.inits)
    out, summary = optimize_model(model, OptimizeConfig(verify=False))
    assert summary["nodes_after"] <= summary["nodes_before"]
    feed = {"x": np.random.default_rng(seed).standard_normal((2, 3, D)).astype(np.float32)}
    same_outputs(model, out, feed)


CONV_BLOCKS = ["conv_bn", "conv_bn_shared", "conv_add", "relu"]


@settings(max_examples=8, deadline=None)
@given(st.lists(st.sampled_from(CONV_BLOCKS), min_size=1, max_size=4), st.integers(0, 1000))
def test_random_conv_graphs_keep_their_function(blocks, seed):
    b = Builder(seed)
    x, extra = "x", []
    rng = np.random.default_rng(seed)
    for name in blocks:
        if name == "relu":
            x = b.op("Relu", [x])
            continue
        c = b.op("Conv", [x, b.w(4, 4, 3, 3)], pads=[1, 1, 1, 1])
        if name == "conv_add":
            x = b.op("Add", [c, b.const(f32(1, 4, 1, 1, seed=seed))])
            continue
        stats = [
            b.const(v.astype(np.float32))
            for v in (rng.random(4) + 0.5, rng.standard_normal(4), rng.standard_normal(4), rng.random(4) + 0.5)
        ]
        x = b.op("BatchNormalization", [c] + stats)
        if name == "conv_bn_shared":
            extra.append(b.op("Relu", [c]))  # the conv output has another reader: BN must not be folded
    outs = [x] + extra
    model = make_model(b.nodes, [("x", ["N", 4, 5, 5], FLOAT)], outs, b.inits)
    out, summary = optimize_model(model, OptimizeConfig(verify=False))
    feed = {"x": rng.standard_normal((2, 4, 5, 5)).astype(np.float32)}
    same_outputs(model, out, feed)
