"""The result line of a run whose precision has engines for another machine only (a TensorRT INT8 engine on a CPU
host) while this machine's engine of it was skipped: that precision is named as having no validated engine here,
with each skip's reason; an expected skip beside engines built for a GPU stays unsaid."""

from __future__ import annotations

from typing import Any

from kiln.pipeline.report import result_line
from kiln.stages.validate.declaration import REQUIRED, UNVALIDATED

WHY = (
    "engine onnxruntime-cpu-int8 is labelled int8, it computes 0% in int8 (fp32 100%; engine graph, by FLOPs); "
    "ConvTranspose x4 run in float on the dequantized values: the runtime fused no integer op for them"
)
SKIPPED = [
    "onnxruntime-cpu-fp16: engine onnxruntime-cpu-fp16 is labelled fp16, it computes 0% in fp16 (fix: none needed "
    "where other engines are built)",
    f"onnxruntime-cpu-int8: {WHY} (fix: ONNX Runtime's CPU provider has no integer kernel for ConvTranspose)",
]


def _report(failures: tuple[str, ...] = ()) -> dict[str, Any]:
    """A CPU host's run: fp32 validated on ONNX Runtime, TensorRT's fp16 and int8 engines not runnable here."""
    trt = [
        {"name": f"tensorrt-{p}", "precision": p, "device": "cuda", "status": "not-runnable"} for p in ("fp16", "int8")
    ]
    engines = [{"name": "onnxruntime-cpu-fp32", "precision": "fp32", "device": "cpu", "status": "validated"}, *trt]
    return {
        "ok": not failures,
        "stages": {
            "precision": {"summary": {"variants": {"fp32": {}, "fp16": {}, "int8": {}}}},
            "build": {"summary": {"skipped": SKIPPED}},
        },
        "validation": {"engines": engines, "failures": list(failures)},
    }


def test_a_precision_built_only_for_another_machine_names_its_skip_here() -> None:
    line = result_line(_report())
    assert line.startswith("PASSED, 2 engines built but not validated: tensorrt-fp16, tensorrt-int8 "), line
    said = WHY.removeprefix("engine ")
    assert line.endswith(f"; no int8 engine validated on this machine ({said})"), line
    assert "fp16 engine" not in line and "onnxruntime-cpu-fp16" not in line  # no kernels on a CPU: no news


def test_a_required_precision_names_even_an_expected_skip() -> None:
    failures = [f"{REQUIRED}fp16 engines {UNVALIDATED} (tensorrt-fp16: no CUDA GPU)"]
    line = result_line(_report(tuple(failures)))
    assert line.startswith("FAILED, 2 engines built but not validated"), line
    assert "; no fp16 engine validated on this machine (onnxruntime-cpu-fp16 is labelled fp16" in line, line
