"""report.md's precision section: kept nodes with their PyTorch modules, the per-node error plot, failed variants."""

from __future__ import annotations

from kiln.pipeline.report import render_markdown


def _report(precision_summary: dict) -> dict:
    return {
        "name": "t",
        "ok": True,
        "stages": {"precision": {"status": "ran", "seconds": 1.0, "summary": precision_summary}},
        "environment": {"versions": {}, "python": "3.11"},
    }


def test_precision_section_names_modules_plot_and_failures() -> None:
    summary = {
        "variants": {
            "fp32": {"kept_fp32": 0, "kept_fp32_nodes": {}},
            "int8": {
                "kept_fp32": 1,
                "top1_agreement": 0.99,
                "kept_fp32_nodes": {"mm1": "fallback round 1"},
                "kept_fp32_modules": {"mm1": "encoder.q (Linear)"},
                "ort_cpu_scheme": "dynamic",
                "ort_cpu_top1_agreement": 0.985,
                "ort_cpu_kept_fp32": 2,
                "ort_cpu_kept_fp32_nodes": {"mm2": "fallback round 1"},
                "ort_cpu_kept_fp32_modules": {},
            },
        },
        "failed": {"fp16": "FP16 model fails the ONNX checker: x (fix: y)"},
        "node_error_plot": "node_errors.png",
        "node_error_threshold": 0.01,
        "first_divergence": {
            "int8": {"node": "mm1", "error": 0.05, "module": "encoder.q (Linear)"},
            "int8 onnxruntime-cpu": None,
            "fp16": {"node": "log", "error": None, "module": None},  # an infinite error, null in JSON
        },
    }
    md = render_markdown(_report(summary))
    assert "| int8 | `mm1` | encoder.q (Linear) | fallback round 1 |" in md
    assert "| int8 onnxruntime-cpu | `mm2` | - | fallback round 1 |" in md
    assert "![per-node error vs FP32](precision/node_errors.png)" in md
    assert (
        "`mm1` (encoder.q (Linear)), 0.05" in md
        and "int8 onnxruntime-cpu: first node over 0.01 relative error: none" in md
        and "fp16: first node over 0.01 relative error: `log` (module unknown), not finite" in md
    )
    assert "| fp16 | **failed, not built** | - |" in md and "**fp16 failed**: FP16 model fails the ONNX checker" in md
    assert "top-1 agreement 0.9850 with 2 nodes kept in float" in md


def test_an_int8_qdq_graph_not_made_beside_a_made_ort_cpu_graph_says_so() -> None:
    """The Q/DQ graph (TensorRT's) missed the gates while ONNX Runtime CPU's own graph passed: the row and a line
    under the table say the Q/DQ graph was not made, and why, instead of reading as a variant made for every backend."""
    why = "int8 (Q/DQ graph) not made: no fallback round passed the gates its engines face (output 'bbox' ...)"
    int8 = {
        "kept_fp32": 7,
        "top1_agreement": 1.0,
        "unmade": why,
        "backend_paths": {"onnxruntime-cpu": "int8/model.ort_cpu.onnx"},
        "ort_cpu_scheme": "static",
        "ort_cpu_top1_agreement": 1.0,
        "ort_cpu_kept_fp32": 1,
    }
    md = render_markdown(_report({"variants": {"fp32": {"kept_fp32": 0}, "int8": int8}}))
    assert "| int8 (**Q/DQ graph not made**; only for onnxruntime-cpu) | 7 | 1.0000 |" in md
    assert f"- **int8**: {why}; engines that build from it (TensorRT's) are not built" in md


def test_an_ort_cpu_graph_not_made_is_not_said_to_be_loaded() -> None:
    """ONNX Runtime CPU's own graph missed the gates: its engines run the Q/DQ graph, and the report says so."""
    why = "int8 (onnxruntime-cpu graph) not made: no fallback round passed the gates its engines face (...)"
    int8 = {"kept_fp32": 2, "top1_agreement": 0.99, "ort_cpu_unmade": why, "ort_cpu_scheme": "dynamic"}
    md = render_markdown(_report({"variants": {"fp32": {"kept_fp32": 0}, "int8": int8}}))
    assert f"`int8`: {why}; ONNX Runtime CPU engines load the Q/DQ graph instead." in md
    assert "load a graph of their own" not in md


def test_without_class_logits_each_variant_shows_its_cosine_and_relative_error() -> None:
    """A diffusion model's noise prediction (no class logits): the table shows what the check measured, the worst
    sample's cosine and the relative error, not a top-1 column of '-'; so does the ONNX Runtime CPU graph's line."""
    fp16 = {"kept_fp32": 0, "top1_agreement": None, "cosine": 0.9999993, "sample_cosine": 0.999998, "rel_err": 0.0012}
    int8 = {
        "kept_fp32": 2,
        "top1_agreement": None,
        "cosine": 0.99929,
        "sample_cosine": 0.99873,
        "rel_err": 0.0384,
        "ort_cpu_scheme": "static",
        "ort_cpu_top1_agreement": None,
        "ort_cpu_cosine": 0.9991,
        "ort_cpu_sample_cosine": 0.9985,
        "ort_cpu_rel_err": 0.041,
        "ort_cpu_kept_fp32": 1,
    }
    summary = {"variants": {"fp32": {"kept_fp32": 0}, "fp16": fp16, "int8": int8}, "failed": {"fp8": "no FP8 here"}}
    md = render_markdown(_report(summary))
    assert "top-1 agreement" not in md, md
    assert (
        "| variant | nodes kept in FP32 | worst-sample cosine vs FP32 graph | relative error vs FP32 graph |" in md
        and "| fp32 | 0 | - | - |" in md
        and "| fp16 | 0 | 0.999998 | 0.0012 |" in md
        and "| int8 | 2 | 0.998730 | 0.0384 |" in md
        and "| fp8 | **failed, not built** | - | - |" in md
    )
    assert "No output is class logits" in md
    assert (
        "checked on its own: cosine 0.999100, worst-sample cosine 0.998500, relative error 0.041 with 1 nodes kept "
        "in float." in md
    )
    older = {"kept_fp32": 0, "top1_agreement": None, "cosine": 0.9999993}  # a record of the cosine alone
    md = render_markdown(_report({"variants": {"fp32": {"kept_fp32": 0}, "fp16": older}}))
    assert "| variant | nodes kept in FP32 | cosine vs FP32 graph |" in md and "| fp16 | 0 | 0.999999 |" in md, md


def test_the_stage_logs_what_the_check_measured() -> None:
    """The precision stage's line per variant: top-1 agreement where there are class logits, else the cosines and
    the relative error, not 'top-1 agreement -'."""
    import logging

    from kiln.stages.precision.stage import _log_variant

    said: list[str] = []
    log = logging.getLogger("test-precision-log")
    log.addHandler(handler := logging.Handler())
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    log.setLevel(logging.INFO)
    vs = {"top1_agreement": None, "cosine": 0.9999993, "sample_cosine": 0.999998, "rel_err": 0.0012}
    _log_variant(log, "fp16", {"vs_fp32": vs, "kept_fp32": []})
    _log_variant(log, "int8", {"vs_fp32": {"top1_agreement": 0.99, "cosine": 0.9991}, "kept_fp32": ["a"]})
    log.removeHandler(handler)
    assert said == [
        "fp16 vs FP32 graph: cosine 0.999999, worst-sample cosine 0.999998, relative error 0.0012, 0 nodes kept FP32",
        "int8 vs FP32 graph: top-1 agreement 0.9900, cosine 0.999100, 1 nodes kept FP32",
    ]
