"""Tiny ONNX graphs for the optimize tests, and a TensorRT-RTX parse+build check."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.stages.optimize.api import optimize_model
from kiln.stages.optimize.config import OptimizeConfig
from kiln.stages.optimize.verify import run_ort


def make_model(
    nodes: list[onnx.NodeProto],
    inputs: Sequence[tuple[str, list[Any], int]],
    outputs: Sequence[str],
    inits: dict[str, np.ndarray],
    opset: int = 18,
) -> onnx.ModelProto:
    """A checked model; ``inputs`` are (name, shape, elem type); output types are left to shape inference."""
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, t, s) for n, s, t in inputs],
        [helper.make_empty_tensor_value_info(o) for o in outputs],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 9
    model = onnx.shape_inference.infer_shapes(model)
    onnx.checker.check_model(model, full_check=True)
    return model


def f32(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def run_pass(model: onnx.ModelProto, name: str, **params: Any) -> tuple[onnx.ModelProto, dict[str, Any]]:
    """One pass with the safety net on; fails the test if the net had to roll it back, or had to check the pass
    on its own (the pass crashed, or its result differed from the original model's)."""
    entry: Any = {"name": name, **params} if params else name
    out, summary = optimize_model(model, OptimizeConfig(passes=[entry, "toposort"]))
    assert not summary["rolled_back"], summary["passes"]
    assert summary["checks"] <= 1, summary["passes"]  # one check of the whole result, no pass checked again
    return out, summary


def ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def same_outputs(a: onnx.ModelProto, b: onnx.ModelProto, feed: dict[str, np.ndarray], rtol: float = 1e-4) -> None:
    ra, rb = run_ort(a, feed), run_ort(b, feed)
    for k in ra:
        np.testing.assert_allclose(rb[k], ra[k], rtol=rtol, atol=1e-5 + rtol * float(np.abs(ra[k]).max()))


FLOAT = TensorProto.FLOAT
INT64 = TensorProto.INT64


def trt_build(path: Path, max_batch: int = 8) -> int:
    """Parse with TensorRT-RTX's ONNX parser into a strongly typed network and build it (CPU works);
    returns the serialized engine's size. Skips when tensorrt_rtx is not installed."""
    trt = pytest.importorskip("tensorrt_rtx", reason="tensorrt_rtx (pip install tensorrt-rtx) is not installed")
    logger = trt.Logger(trt.Logger.ERROR)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(path)):
        errs = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        pytest.fail(f"TensorRT-RTX cannot parse {path.name}: {errs}")
    config = builder.create_builder_config()
    profile = builder.create_optimization_profile()
    for i in range(network.num_inputs):
        t = network.get_input(i)
        dims = list(t.shape)
        lo, opt, hi = (
            [1 if d < 0 else d for d in dims],
            [min(2, max_batch) if d < 0 else d for d in dims],
            [max_batch if d < 0 else d for d in dims],
        )
        profile.set_shape(t.name, lo, opt, hi)
    config.add_optimization_profile(profile)
    engine = builder.build_serialized_network(network, config)
    assert engine is not None, f"TensorRT-RTX build of {path.name} failed"
    return engine.nbytes
