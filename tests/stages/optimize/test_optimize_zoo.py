"""The zoo's exported graphs: optimized with the default pipeline (safety net on), still the PyTorch function,
smaller, and accepted by TensorRT-RTX's parser and builder. Also the file API with external data."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from kiln.models.registry import build_model
from kiln.pipeline.config import KilnConfig
from kiln.stages.export.torch_export import export_onnx
from kiln.stages.optimize import stage
from kiln.stages.optimize.api import optimize_file, optimize_model
from kiln.stages.optimize.config import OptimizeConfig
from kiln.stages.optimize.verify import run_ort
from tests.conftest import stage_context
from tests.stages.optimize.optimize_helpers import trt_build

EXAMPLES = {
    "cnn": lambda: torch.randn(2, 1, 8, 8),
    "transformer": lambda: torch.randn(2, 1, 8, 8),
    "mlp_embed": lambda: torch.randint(0, 17, (2, 64)),
}


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> dict:
    """name -> (torch model, raw path, optimized path, summary, example batch)"""
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("zoo")
    out = {}
    for name, example in EXAMPLES.items():
        model = build_model(name).eval()
        raw = root / f"{name}.onnx"
        export_onnx(model, example(), raw)
        opt, summary = optimize_model(onnx.load(str(raw)), OptimizeConfig())
        path = root / f"{name}.opt.onnx"
        onnx.save(opt, str(path))
        out[name] = (model, raw, path, summary, example)
    return out


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_zoo_graph_optimizes_without_rollback_and_matches_pytorch(zoo, name):
    model, raw, path, summary, example = zoo[name]
    assert summary["verified"] and summary["rolled_back"] == [] and summary["checks"] == 1
    assert summary["nodes_after"] < summary["nodes_before"]
    onnx.checker.check_model(str(path), full_check=True)
    x = example()
    x = torch.cat([x] * 4)  # batch 8: the dynamic axis still works
    with torch.no_grad():
        ref = model(x).numpy()
    got = run_ort(onnx.load(str(path)), {"input": x.numpy()})["logits"]
    assert np.max(np.abs(got - ref)) <= 1e-4 * max(1.0, float(np.abs(ref).max()))


def test_zoo_fusions_fire(zoo):
    ops = {n: zoo[n][3]["ops_after"] for n in zoo}
    assert "BatchNormalization" not in ops["cnn"] and ops["cnn"]["Conv"] == 3
    assert ops["transformer"].get("Split") == 2 and "Identity" not in ops["transformer"]
    assert "Shape" not in ops["transformer"] and "Concat" not in ops["transformer"]


@pytest.mark.tensorrt
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_zoo_optimized_graph_builds_with_tensorrt_rtx(zoo, name):
    assert trt_build(zoo[name][2]) > 0


def test_optimize_file_keeps_external_data(zoo, tmp_path):
    src_model = onnx.load(str(zoo["transformer"][1]))
    src = tmp_path / "in" / "model.onnx"
    src.parent.mkdir()
    onnx.save_model(src_model, str(src), save_as_external_data=True, location="model.onnx.data", size_threshold=0)
    dst = tmp_path / "out" / "opt.onnx"
    summary = optimize_file(src, dst, OptimizeConfig())
    assert summary["external_data"] and (dst.parent / "opt.onnx.data").is_file()
    assert dst.stat().st_size < 200_000  # the weights are in the data file, not the protobuf
    feed = {"input": np.random.default_rng(0).standard_normal((3, 1, 8, 8)).astype(np.float32)}
    ref = run_ort(onnx.load(str(src)), feed)["logits"]
    got = run_ort(onnx.load(str(dst)), feed)["logits"]
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)
    optimize_file(src, dst, OptimizeConfig())  # re-running must not append to the old data file
    assert onnx.load(str(dst)) is not None
    np.testing.assert_allclose(run_ort(onnx.load(str(dst)), feed)["logits"], ref, rtol=1e-4, atol=1e-5)


def test_stage_run_reads_export_and_writes_model(zoo, tmp_path):
    exp = tmp_path / "export"
    exp.mkdir()
    onnx.save(onnx.load(str(zoo["cnn"][1])), str(exp / "model.onnx"))
    out = tmp_path / "optimize"
    out.mkdir()
    ctx = stage_context("optimize", KilnConfig(), tmp_path, out, {"export": exp})
    summary = stage.run(ctx)
    assert (out / "model.onnx").is_file() and summary.nodes_after < summary.nodes_before
    assert {"name", "nodes_before", "nodes_after", "ops_delta", "seconds", "rolled_back"} <= set(summary.passes[0])
    import json

    json.dumps(summary.model_dump(mode="json"))  # what the manifest holds
