"""`kiln precision` on a graph older than per-channel Q/DQ (opset 13), and a variant that fails in the direct command:
the INT8 variant is made from a raised copy, and a failed variant leaves the ones made written."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from click.testing import CliRunner
from onnx import numpy_helper

from kiln.calibration.config import CalibrationConfig
from kiln.calibration.quantize import per_channel_graph
from kiln.cli import main
from kiln.core.errors import ModelError
from kiln.pipeline.config import config_from_dict
from kiln.pipeline.runner import settings_for
from kiln.pipeline.stage_list import stage_named
from kiln.stages.precision.direct import precision_direct
from tests.calibration.calib_graphs import batches, conv_model


def _opset11(tmp: Path) -> tuple[Path, Path]:
    """The calibration tests' Conv -> Relu -> pool -> MatMul -> Gemm classifier at opset 11, and a feed for it."""
    model = conv_model()
    model.opset_import[0].version = 11
    model.ir_version = 6
    onnx.checker.check_model(model)
    path, feed = tmp / "model.onnx", tmp / "x.npz"
    onnx.save(model, path)
    np.savez(feed, input=np.concatenate(batches()))
    return path, feed


def _opset(path: Path) -> int:
    return next(o.version for o in onnx.load(path).opset_import if o.domain in ("", "ai.onnx"))


def _run(model: Path, out: Path, feed: Path, variants: str = "fp16,int8") -> object:
    return CliRunner().invoke(
        main, ["precision", str(model), "-o", str(out), "--variants", variants, "--calibration", str(feed)]
    )


def test_an_opset_11_graph_gets_a_per_channel_int8_variant_that_runs(tmp_path: Path) -> None:
    model, feed = _opset11(tmp_path)
    result = _run(model, tmp_path / "v", feed)
    assert result.exit_code == 0, result.output
    assert "raised to opset 13" in " ".join(result.output.split()), result.output  # the log says what was done
    int8 = tmp_path / "v" / "int8" / "model.onnx"
    q = onnx.load(int8)
    onnx.checker.check_model(q)
    assert _opset(int8) == 13 and _opset(tmp_path / "v" / "fp32" / "model.onnx") == 11
    inits = {i.name: numpy_helper.to_array(i) for i in q.graph.initializer}
    conv_w = next(n for n in q.graph.node if n.op_type == "DequantizeLinear" and n.input[0] == "cw_quantized")
    assert inits[conv_w.input[1]].shape == (8,)  # one scale per output channel
    x = np.load(feed)["input"][:16]
    want = ort.InferenceSession(str(model)).run(None, {"input": x})[0]
    for graph in (int8, int8.with_name("model.ort_cpu.onnx")):  # TensorRT's Q/DQ graph and ONNX Runtime CPU's
        got = ort.InferenceSession(str(graph)).run(None, {"input": x})[0]
        assert np.abs(got - want).max() < 0.05 * np.abs(want).max(), graph.name
    record = json.loads((tmp_path / "v" / "variants.json").read_text())["variants"]
    assert set(record) == {"fp32", "fp16", "int8"}
    assert record["int8"]["report"]["calibration"]["opset"] == 13


def test_where_the_converter_cannot_raise_the_graph_weights_are_per_tensor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from onnx import version_converter

    def refuses(*args, **kwargs):
        raise RuntimeError("no adapter for op Foo")

    monkeypatch.setattr(version_converter, "convert_version", refuses)
    model, feed = _opset11(tmp_path)
    raised, cfg = per_channel_graph(onnx.load(model), CalibrationConfig())
    assert raised is None and not cfg.per_channel
    result = _run(model, tmp_path / "v", feed, "int8")
    assert result.exit_code == 0, result.output
    assert "quantized per tensor" in " ".join(result.output.split()), result.output
    int8 = tmp_path / "v" / "int8" / "model.onnx"
    q = onnx.load(int8)
    assert _opset(int8) == 11 and any(n.op_type == "DequantizeLinear" for n in q.graph.node)
    assert all(numpy_helper.to_array(i).ndim == 0 for i in q.graph.initializer if i.name.endswith("_scale"))
    ort.InferenceSession(str(int8)).run(None, {"input": np.load(feed)["input"][:4]})


def test_a_graph_at_opset_13_or_per_tensor_weights_is_quantized_as_it_is() -> None:
    model = conv_model()  # opset 18
    assert per_channel_graph(model, CalibrationConfig()) == (None, CalibrationConfig())
    model.opset_import[0].version = 11
    per_tensor = CalibrationConfig(per_channel=False)
    assert per_channel_graph(model, per_tensor) == (None, per_tensor)


def _fp16_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """FP16 fails as ONNX Runtime does, quoting the path of the graph inside the folder being written."""
    import kiln.stages.precision.stage as stage

    def broken(src, out, *args, **kwargs):
        raise ModelError(f"ONNX Runtime cannot load the model: Load model from {out} failed", hint="planted hint")

    monkeypatch.setattr(stage, "build_fp16", broken)


def test_a_failing_variant_leaves_the_others_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fp16_fails(monkeypatch)
    model, feed = _opset11(tmp_path)
    settings = settings_for(stage_named("precision"), config_from_dict({}))
    staged = tmp_path / ".v.staging-1-abc"
    summary = precision_direct(model, staged, ["fp16", "int8"], feed, settings)
    assert set(summary["variants"]) == {"fp32", "int8"} and set(summary["failed"]) == {"fp16"}
    assert (staged / "int8" / "model.onnx").is_file() and not (staged / "fp16").exists()
    assert set(json.loads((staged / "variants.json").read_text())["variants"]) == {"fp32", "int8"}
    error = summary["missing"]
    assert isinstance(error, ModelError) and error.hint.startswith("planted hint")
    assert "fp16 failed" in error.message and "the others were written: fp32, int8" in error.message
    assert "Load model from fp16/model.onnx failed" in error.message and "staging" not in error.message


def test_the_command_writes_the_variants_made_and_names_the_one_that_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fp16_fails(monkeypatch)
    model, feed = _opset11(tmp_path)
    result = _run(model, tmp_path / "v", feed)
    assert (tmp_path / "v" / "int8" / "model.onnx").is_file() and not (tmp_path / "v" / "fp16").exists()
    assert result.exit_code == 2, result.output  # a script going on to build v/fp16 must not be told all went well
    errors = [line for line in result.output.splitlines() if line.startswith(("error:", "fix:"))]
    assert len(errors) == 2 and errors[0].startswith("error: precision variant fp16 failed"), result.output
    assert "(the others were written: fp32, int8)" in errors[0] and "staging" not in result.output, result.output


def test_nothing_asked_for_made_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fp16_fails(monkeypatch)
    model, feed = _opset11(tmp_path)
    result = _run(model, tmp_path / "v", feed, "fp16")
    assert result.exit_code == 2 and not (tmp_path / "v").exists(), result.output
    assert "fp16: ONNX Runtime cannot load the model" in result.output and "staging" not in result.output
