"""``validate.gates.gated_outputs`` in validation's record and report: the headline values, which the gates stand
beside, are the worst of the outputs the gates hold; an output left out keeps its figures in the per-output table,
marked not gated."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from kiln.core.data import DatasetSplits, as_feed
from kiln.core.records import Baseline, EngineValidation, ValidationResult
from kiln.core.signature import Signature
from kiln.models.config import ModelConfig
from kiln.stages.accuracy.check import held_out
from kiln.stages.engines.config import BuildConfig
from kiln.stages.engines.onnxruntime.config import OnnxRuntimeConfig
from kiln.stages.engines.stage import build_engine
from kiln.stages.validate.config import ValidateConfig
from kiln.stages.validate.report import report_section
from kiln.stages.validate.stage import check_engine, finish_engine, reference
from tests.stages.validate.test_report import _table

RNG = np.random.default_rng(0)
W = RNG.standard_normal((4, 3)).astype(np.float32)  # the class logits' weights
V = RNG.standard_normal((4, 8)).astype(np.float32)  # a hidden state's
OFF = (1.3 * V + 0.5 * RNG.standard_normal((4, 8))).astype(np.float32)  # the engine's hidden state: scaled and turned
X = RNG.standard_normal((96, 4)).astype(np.float32)
Y = torch.from_numpy((X @ W).argmax(1))  # three classes the logits get right


def _reference_model(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {"logits": feed["input"] @ W, "hidden": feed["input"] @ V}


def _engine(folder: Path) -> Path:
    """A real ONNX Runtime FP32 engine whose logits are the reference's and whose hidden state is not (``OFF``)."""
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["input", "w"], ["logits"]),
            helper.make_node("MatMul", ["input", "v"], ["hidden"]),
        ],
        "two_outputs",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 4])],
        [
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 3]),
            helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["batch", 8]),
        ],
        [numpy_helper.from_array(W, "w"), numpy_helper.from_array(OFF, "v")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), folder / "m.onnx")
    cfg = BuildConfig(backends=["onnxruntime"], onnxruntime=OnnxRuntimeConfig(autotune={"cpu": False}))
    build_engine(folder / "m.onnx", folder / "engine", "onnxruntime", "cpu", "fp32", cfg, folder / "cache")
    return folder / "engine"


def _validated(engine_dir: Path, gates: dict[str, Any]) -> EngineValidation:
    """The engine checked and judged by the validate stage's own functions, against the reference model."""
    x = torch.from_numpy(X)
    data = DatasetSplits(x[:32], Y[:32], x[32:], Y[32:], num_classes=3)
    cfg = ValidateConfig(gates=gates, warmup=0, iterations=1)
    ctx = SimpleNamespace(config=SimpleNamespace(signature=Signature(batch_sizes=[1, 8]), model=ModelConfig()))
    feeds = held_out(data, lambda v: as_feed(v, ["input"]), {}, {}, None)
    ref = reference(ctx, data, cfg, _reference_model, feeds, ["logits", "hidden"], {})
    return finish_engine(check_engine(engine_dir, ref, cfg, ctx), ref, [], cfg, 8)


def _report(e: EngineValidation) -> list[str]:
    b = Baseline(accuracy=1.0, samples=64, latency_ms={}, logits_output="logits", compared=["logits", "hidden"])
    return report_section(ValidationResult(passed=bool(e.passed), baseline=b, engines=[e], failures=e.failures))


def test_the_headline_is_the_gated_outputs_and_the_one_left_out_is_marked_not_gated(tmp_path: Path) -> None:
    """The hidden state (scaled by 1.3 and turned) fails FP32's gates while every output is gated. With
    ``gated_outputs: [logits]`` the engine passes, and its headline (record and report) is the logits' alone: no
    value beside a gate it seems to miss; the hidden state's figures stay in the per-output table, marked."""
    engine_dir = _engine(tmp_path)
    every = _validated(engine_dir, {})
    assert not every.passed and any(f.startswith("output 'hidden'") for f in every.failures), every.failures
    e = _validated(engine_dir, {"gated_outputs": ["logits"]})
    assert e.passed and e.failures == [], e.failures
    logits, hidden = e.outputs["logits"], e.outputs["hidden"]
    assert hidden["cosine"] < 0.99 and hidden["rel_err"] > 0.2  # every output's figures kept
    assert (e.cosine, e.max_abs_err, e.rel_err) == (logits["cosine"], logits["max_abs_err"], logits["rel_err"])
    assert e.cosine >= e.gates["min_cosine"] and e.top1_agreement == 1.0

    lines = _report(e)
    header, _, *rows = _table(lines)
    row = dict(zip(header, rows[-1]))
    assert row["cosine"] == f"{logits['cosine']:.6f} (≥ 0.9999)", row
    assert row["worst-sample cosine"] == f"{logits['sample_cosine']:.6f} (≥ 0.9999)", row
    per_output = lines[lines.index("### Per output (worst over shapes and batch sizes)") + 2 :]
    header, _, *rows = _table(per_output)
    shown = {r[1]: dict(zip(header, r)) for r in rows}
    assert set(shown) == {"logits", "hidden (not gated)"}, shown
    assert shown["hidden (not gated)"]["cosine"] == f"{hidden['cosine']:.6f}"
    compared = next(x for x in lines if x.startswith("Compared outputs"))
    assert "not gated: hidden (`validate.gates.gated_outputs`)" in compared, compared


def test_class_logits_left_out_show_no_agreement_beside_the_gate() -> None:
    """Only the hidden state gated: the logits' top-1 agreement is no headline value (none beside
    ``min_top1_agreement``), and the cell says why; the per-output table keeps the figure."""
    stats = {"max_abs_err": 0.1, "rel_err": 0.1, "cosine": 0.99, "sample_cosine": 0.98, "top1_ties": 0.0}
    e = EngineValidation(name="e", backend="onnxruntime", precision="int8", device="cpu", status="validated")
    e.passed, e.max_abs_err, e.rel_err, e.cosine = True, 1e-3, 1e-3, 0.99999
    e.outputs = {"logits": {**stats, "top1_agreement": 0.5}, "hidden": {**stats, "top1_agreement": None}}
    e.gates = {"min_cosine": 0.99, "min_top1_agreement": 0.97, "gated_outputs": ["hidden"]}
    lines = _report(e)
    header, _, *rows = _table(lines)
    assert dict(zip(header, rows[-1]))["top-1 agree"] == "not gated"
    per_output = lines[lines.index("### Per output (worst over shapes and batch sizes)") + 2 :]
    header, _, *rows = _table(per_output)
    assert dict(zip(header, rows[0]))["top-1 agree"] == "0.5000" and rows[0][1] == "logits (not gated)"
    compared = next(x for x in lines if x.startswith("Compared outputs"))
    assert "top-1 agreement and accuracy on 'logits'" in compared, compared
