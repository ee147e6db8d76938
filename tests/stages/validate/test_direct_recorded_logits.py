"""``kiln validate ENGINE``: a packaged engine of a run with ``signature.logits_output`` records the class-logit
output's name in its ``kiln-engine.json``, and validating it again on its own holds that output to top-1 agreement
as its run did (a multi-label head's to decision agreement); ``--set signature.logits_output`` still wins."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kiln.core.records import Baseline, EngineMetadata, EngineValidation, ValidationResult
from kiln.pipeline.config import config_from_dict
from kiln.stages.engines.backend import SIDECAR, read_metadata
from kiln.stages.engines.config import BuildConfig
from kiln.stages.engines.stage import build_engine
from kiln.stages.package.stage import run
from tests.conftest import stage_context, tiny_config_dict
from tests.pipeline.test_faults import invoke


def _two_outputs(path: Path) -> Path:
    """input [batch, 4] -> output_0 [batch, 3] (class logits) and output_1 [batch, 8] (a hidden state): tf2onnx's
    names, none of them 'logits'."""
    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array(rng.standard_normal((4, n)).astype(np.float32), f"w{n}") for n in (3, 8)]
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["input", "w3"], ["output_0"]),
            helper.make_node("MatMul", ["input", "w8"], ["output_1"]),
        ],
        "two_outputs",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 4])],
        [
            helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", d])
            for n, d in (("output_0", 3), ("output_1", 8))
        ],
        weights,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
    return path


def _validated(tmp_path: Path, engine: Path, model: Path, *sets: str) -> tuple[str, dict[str, Any]]:
    """What ``kiln validate ENGINE`` logs before its JSON, and the JSON, with each ``--set`` of ``sets``."""
    inputs = tmp_path / "x.npz"
    np.savez(inputs, input=np.random.default_rng(1).standard_normal((32, 4)).astype(np.float32))
    out = invoke("validate", engine, "--reference", model, "--inputs", inputs, *(a for s in sets for a in ("--set", s)))
    assert out.exit_code == 0, out.output
    start = out.output.index("{")
    return " ".join(out.output[:start].split()), json.loads(out.output[start:])


def _packaged(
    tmp_path: Path, model: Path, logits_output: str | int | None, held: bool = True, agreement: str = "top1"
) -> Path:
    """The package stage of a run with ``signature.logits_output`` over one validated FP32 engine of ``model``,
    whose validation held it to top-1 agreement where ``held`` (counting ``agreement``: "decision" for a multi-label
    head's)."""
    meta = build_engine(model, tmp_path / "build" / "e", "onnxruntime", "cpu", "fp32", BuildConfig(), tmp_path / "c")
    checked = EngineValidation(
        name=meta.name, backend=meta.backend, precision="fp32", device="cpu", status="validated", passed=True
    )
    checked.top1_agreement = 1.0 if held else None
    checked.agreement = agreement
    (tmp_path / "validate").mkdir()
    ValidationResult(
        passed=True, baseline=Baseline(accuracy=None, samples=8, latency_ms={}), engines=[checked], failures=[]
    ).write(tmp_path / "validate" / "validation.json")
    cfg = config_from_dict(tiny_config_dict(**{"signature.logits_output": logits_output}))
    inputs = {"build": tmp_path / "build", "validate": tmp_path / "validate"}
    run(stage_context("package", cfg, tmp_path, tmp_path / "package", inputs))
    return tmp_path / "package" / "engines" / meta.name


def test_the_runs_logits_output_is_recorded_and_held_to_top1_when_validated_alone(tmp_path: Path) -> None:
    model = _two_outputs(tmp_path / "m.onnx")
    engine = _packaged(tmp_path, model, "output_0")
    assert read_metadata(engine).logits_output == "output_0"
    said, got = _validated(tmp_path, engine, model)
    assert "no top-1 agreement" not in said, said
    assert got["top1_agreement"] == 1.0 and got["outputs"]["output_1"]["top1_agreement"] is None, got
    said, got = _validated(tmp_path, engine, model, "signature.logits_output=output_1")  # the user's --set wins
    assert got["outputs"]["output_1"]["top1_agreement"] == 1.0 and got["outputs"]["output_0"]["top1_agreement"] is None
    said, got = _validated(tmp_path, engine, model, "signature.logits_output=null")  # null too: no output named
    assert got.get("top1_agreement") is None and "no top-1 agreement" in said, said


def test_an_output_the_runs_validation_did_not_hold_to_top1_is_not_recorded(tmp_path: Path) -> None:
    """A regression head named by signature.logits_output, whose values no top-1 agreement guarded in the run: not
    recorded, so validating the engine alone does not gate a top-1 the run never gated."""
    engine = _packaged(tmp_path, _two_outputs(tmp_path / "m.onnx"), "output_0", held=False)
    assert read_metadata(engine).logits_output is None


def test_an_index_is_recorded_by_name_and_a_run_that_named_none_records_none(tmp_path: Path) -> None:
    """``signature.logits_output: 0`` names the first output; an engine of a run that named none records None, and a
    record written before the field existed still loads."""
    model = _two_outputs(tmp_path / "m.onnx")
    assert read_metadata(_packaged(tmp_path / "a", model, 0)).logits_output == "output_0"
    engine = _packaged(tmp_path / "b", model, None)
    assert read_metadata(engine).logits_output is None
    old = json.loads((engine / SIDECAR).read_text())
    old.pop("logits_output", None)
    assert EngineMetadata.model_validate(old).logits_output is None


def test_a_multi_label_heads_decision_agreement_is_recorded_and_counted_again(tmp_path: Path) -> None:
    """A run that held its multi-label head to decision agreement records so; validating the engine alone counts
    each (sample, label) pair's decision, not the argmax of labels that are no classes of one answer."""
    model = _two_outputs(tmp_path / "m.onnx")
    engine = _packaged(tmp_path / "a", model, "output_0", agreement="decision")
    assert read_metadata(engine).logits_agreement == "decision"
    got = _validated(tmp_path, engine, model)[1]
    assert got["agreement"] == "decision" and got["top1_agreement"] == 1.0, got
    single = _packaged(tmp_path / "b", model, "output_0")
    assert read_metadata(single).logits_agreement == "top1" and _validated(tmp_path, single, model)[1]["agreement"] == (
        "top1"
    )
