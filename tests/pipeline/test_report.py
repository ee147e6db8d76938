"""report.json and report.md: what the run was validated on."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.core.records import Baseline, ValidationResult
from kiln.pipeline.config import config_from_dict
from kiln.pipeline.report import build_report, render_markdown, result_line
from kiln.pipeline.runner import RunResult, StageRecord
from tests.conftest import tiny_config_dict

# the result line of a run from an ONNX file without data
RANDOM = "on RANDOM inputs (no data: agreement on random arrays says little about real ones)"
VALIDATION = ValidationResult(
    passed=True, baseline=Baseline(accuracy=None, samples=4, latency_ms={}), engines=[], failures=[]
)


@pytest.mark.parametrize(
    "sections,random",
    [
        ({"model": {"onnx": "m.onnx"}}, True),  # an ONNX file and no data: random_splits
        ({"model": {"onnx": "m.onnx"}, "data": {"name": "digits"}}, False),
        ({"model": {"onnx": "m.onnx", "name": "cnn"}}, False),  # a PyTorch model: its default dataset
        ({"model": {"name": "cnn"}}, False),
    ],
    ids=["onnx-no-data", "onnx-digits", "onnx-and-model", "model"],
)
def test_a_run_on_random_inputs_says_so_in_its_report(tmp_path: Path, sections: dict, random: bool) -> None:
    (tmp_path / "m.onnx").write_bytes(b"")
    cfg = config_from_dict({**tiny_config_dict(), **sections}, source=str(tmp_path / "kiln.yaml"), base=tmp_path)
    result = RunResult(tmp_path / "wd", [StageRecord("validate", "ran", 0.1, summary=VALIDATION)])
    report = build_report(result, cfg)
    assert (report.get("inputs", {}).get("kind") == "random") is random
    assert ("**Inputs: RANDOM arrays" in render_markdown(report)) is random


def test_an_engine_validated_at_fewer_shapes_is_named() -> None:
    """A torch engine that takes one length of a dynamic axis is validated at that one: the report says so beside
    the shapes the run validated."""
    from kiln.core.records import EngineValidation
    from kiln.stages.validate.report import _narrower

    def engine(name: str, shapes: list[dict[str, int]]) -> EngineValidation:
        return EngineValidation(
            name=name, backend="b", precision="fp32", device="cpu", status="validated", shapes=shapes
        )

    both = [{"seq": 10}, {"seq": 20}]
    baseline = Baseline(accuracy=None, samples=4, latency_ms={}, shapes=both)
    v = ValidationResult(
        passed=True, baseline=baseline, engines=[engine("ort", both), engine("torch", both[1:])], failures=[]
    )
    assert _narrower(v) == [
        "torch takes fewer sizes and was validated at seq=20 (requests of other sizes are refused)."
    ]


def test_a_precision_asked_for_without_an_engine_is_said_beside_the_verdict() -> None:

    why = "int8 not made: 39% of its FLOPs run in int8, under the 50% an engine labelled int8 must run"
    report = {
        "ok": True,
        "stages": {
            "precision": {"summary": {"variants": {"fp32": {}, "int8": {}}}},
            "build": {"summary": {"skipped": [f"onnxruntime-cpu-int8: {why} (fix: add calibration data)"]}},
        },
        "validation": {"engines": [{"name": "onnxruntime-cpu-fp32", "precision": "fp32", "status": "validated"}]},
    }
    assert result_line(report) == f"PASSED; no int8 engine ({why})"
    # two engines of a precision skipped for two reasons: each said after its engine's name, on one line
    parser = "TensorRT's ONNX parser failed at node 'lstm' (op LSTM) in model.onnx: Invalid Node\nISelectLayer"
    report["stages"]["build"]["summary"]["skipped"].append(f"tensorrt-int8: {parser} (fix: try another opset)")
    assert result_line(report) == (
        f"PASSED; no int8 engine (onnxruntime-cpu-int8: {why}; tensorrt-int8: TensorRT's ONNX parser failed at node "
        "'lstm' (op LSTM) in model.onnx: Invalid Node ISelectLayer)"
    )
    report["validation"]["engines"].append({"name": "x-int8", "precision": "int8", "status": "validated"})
    assert result_line(report) == "PASSED"


def test_a_precision_variant_that_failed_is_said_beside_the_verdict(tmp_path: Path) -> None:
    """A variant the precision stage could not make (its summary's ``failed``) has no engine: the run still passes
    with the others, and the result line names the missing precision with the stage's reason."""
    from kiln.core.records import EngineValidation
    from kiln.stages.engines.declaration import BuildSummary, EngineEntry
    from kiln.stages.precision.declaration import PrecisionSummary

    why = "calibration input 'input' is 0 in every sample: its range is 0"
    fp32 = {"name": "onnxruntime-cpu-fp32", "backend": "onnxruntime", "device": "cpu", "precision": "fp32"}
    validation = VALIDATION.model_copy(update={"engines": [EngineValidation(**fp32, status="validated")]})
    records = [
        StageRecord("precision", "ran", 0.1, summary=PrecisionSummary(variants={"fp32": {}}, failed={"int8": why})),
        StageRecord(
            "build", "ran", 0.1, summary=BuildSummary(engines=[EngineEntry(**fp32, build_seconds=1, size_bytes=1)])
        ),
        StageRecord("validate", "ran", 0.1, summary=validation),
    ]
    cfg = config_from_dict(tiny_config_dict(), source=str(tmp_path / "kiln.yaml"))
    report = build_report(RunResult(tmp_path / "wd", records), cfg)
    assert report["ok"] and result_line(report) == f"PASSED; no int8 engine ({why})"
    assert f"**Result: PASSED; no int8 engine ({why})**" in render_markdown(report)


def test_one_engine_not_validated_here_is_said_in_the_singular() -> None:

    engine = {"name": "tensorrt-fp32", "device": "cuda", "status": "not-runnable"}
    line = result_line({"ok": True, "validation": {"engines": [engine]}})
    assert line == (
        "PASSED, 1 engine built but not validated: tensorrt-fp32 (it targets CUDA, which this machine does not "
        "have; validate it where it will run)"
    )
    # a GPU host whose ONNX Runtime has no CUDA provider: the engine's own reason, not "no such device"
    engine = {**engine, "name": "onnxruntime-cuda-fp16", "reason": "CUDAExecutionProvider not available"}
    line = result_line({"ok": True, "validation": {"engines": [engine]}})
    assert line == (
        "PASSED, 1 engine built but not validated: onnxruntime-cuda-fp16 (it targets CUDA: CUDAExecutionProvider "
        "not available; validate it where it will run)"
    )


def test_engines_of_a_graph_not_made_are_named_beside_the_verdict(tmp_path: Path) -> None:
    """An INT8 Q/DQ graph short of the gates while ONNX Runtime CPU's own INT8 graph passed: int8 has an engine,
    yet the engines that read the Q/DQ graph (TensorRT's) are not built, and the result line names them and why."""
    from kiln.core.records import EngineValidation
    from kiln.stages.engines.declaration import BuildSummary, EngineEntry
    from kiln.stages.precision.declaration import PrecisionSummary

    why = "int8 (Q/DQ graph) not made: no fallback round passed the gates its engines face (cosine 0.99 < 0.999)"
    fp16 = "engine onnxruntime-cpu-fp16 is labelled fp16, it computes 0% in fp16"
    made = {"backend": "onnxruntime", "device": "cpu", "precision": "int8", "name": "onnxruntime-cpu-int8"}
    trt = {"backend": "tensorrt", "device": "cuda", "precision": "fp16", "name": "tensorrt-fp16"}
    variants = {"fp16": {}, "int8": {"unmade": why, "backend_paths": {"onnxruntime-cpu": "int8/model.ort_cpu.onnx"}}}
    skipped = [f"onnxruntime-cpu-fp16: {fp16} (fix: none needed)", f"tensorrt-int8: {why}"]
    built = [EngineEntry(**e, build_seconds=1, size_bytes=1) for e in (made, trt)]
    engines = [
        EngineValidation(**made, status="validated"),
        EngineValidation(**trt, status="not-runnable", reason="no CUDA GPU"),
    ]
    records = [
        StageRecord("precision", "ran", 0.1, summary=PrecisionSummary(variants=variants)),
        StageRecord("build", "ran", 0.1, summary=BuildSummary(engines=built, skipped=skipped)),
        StageRecord("validate", "ran", 0.1, summary=VALIDATION.model_copy(update={"engines": engines})),
    ]
    cfg = config_from_dict(tiny_config_dict(), source=str(tmp_path / "kiln.yaml"))
    report = build_report(RunResult(tmp_path / "wd", records), cfg)
    line = result_line(report)
    assert line.startswith("PASSED, 1 engine built but not validated: tensorrt-fp16 "), line
    assert line.endswith(f"; no tensorrt-int8 engine ({why})"), line
    assert "onnxruntime-cpu-fp16" not in line  # fp16 has an engine: a backend that runs it in fp32 is no news


def _run_from_onnx(tmp_path: Path, *sets: str) -> tuple[int, str, str]:
    """``kiln run`` of a tiny ONNX file with ``build.backends: [onnxruntime]`` and the default variants (fp32, fp16,
    int8) on this CPU, with each ``--set`` of ``sets``: its exit code, its report's result line and its output."""
    import json

    import yaml

    from tests.pipeline.test_faults import invoke, tiny_onnx

    cfg = tmp_path / "kiln.yaml"
    model = tiny_onnx(tmp_path / "model.onnx")
    run = {"model": {"onnx": str(model)}, "build": {"backends": ["onnxruntime"]}, "validate": {"time_budget_s": 0.1}}
    cfg.write_text(yaml.safe_dump(run))
    wd = tmp_path / "wd"
    result = invoke("run", cfg, "-w", wd, "--quiet", *(a for s in sets for a in ("--set", s)))
    return result.exit_code, result_line(json.loads((wd / "report.json").read_text())), result.output


def test_fp16_skipped_on_the_cpu_is_said_as_an_expected_skip(tmp_path: Path) -> None:
    """ONNX Runtime's CPU runs an FP16 graph in FP32, so the build skips its fp16 engine: with fp16 only among the
    default variants, the result line says it as the expected skip it is, not as a missing engine."""
    code, line, _ = _run_from_onnx(tmp_path)
    assert code == 0, line
    assert line.startswith(
        f"PASSED {RANDOM}; fp16 skipped on CPU, as expected: no fp16 kernels there for onnxruntime-cpu-fp16"
    ), line
    assert "no fp16 engine" not in line and "is labelled fp16" not in line, line


def test_a_required_precision_skipped_on_the_cpu_is_still_said_missing(tmp_path: Path) -> None:
    """With fp16 in ``precision.required`` the same skip fails the run: the result line names the missing engine and
    the build's reason, with no word of it being expected."""
    code, line, output = _run_from_onnx(tmp_path, "precision.required=[fp16]")
    assert code == 3, line
    assert line.startswith(f"FAILED {RANDOM}; no fp16 engine (engine onnxruntime-cpu-fp16 is labelled fp16"), line
    assert "as expected" not in line, line
    fix = next(x for x in output.splitlines() if x.startswith("fix: "))
    assert "built on a GPU" in fix and "take it out of precision.required" in fix, fix


def test_a_gpu_only_plan_of_another_backend_is_part_of_the_expected_skip() -> None:
    """The torch backend plans FP16 engines on the GPU only: beside ONNX Runtime's CPU skip, still the expected one."""
    from kiln.pipeline.report import _expected_skip

    skipped = [
        "onnxruntime-cpu-fp16: engine onnxruntime-cpu-fp16 is labelled fp16, it computes 0% in fp16 (fix: none needed)",
        "torch-cpu-fp16: AOTInductor engines are FP32, or FP16 on the GPU",
    ]
    said = _expected_skip(skipped, "fp16", [])
    assert said is not None and said.startswith("fp16 skipped on CPU, as expected"), said
    assert _expected_skip([*skipped, "tensorrt-cuda-fp16: its build failed"], "fp16", []) is None
