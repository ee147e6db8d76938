"""The precision stage's pipeline entry: variants.json, kept nodes, the calibration cache.

Runs ``kiln.stages.precision.stage.run`` on an exported zoo graph directly (not through the runner), so these
tests do not depend on the other stages' state.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch

from kiln.calibration.ranges import STATS
from kiln.core.errors import ConfigError, ModelError
from kiln.core.records import Variants
from kiln.models.registry import build_model
from kiln.pipeline.config import config_from_dict
from kiln.pipeline.runner import load_dataset
from kiln.stages.export.torch_export import export_onnx
from kiln.stages.precision.stage import run
from tests.conftest import stage_context, tiny_config_dict

TRANSFORMER = {"model.name": "transformer", "model.params": {"dim": 16, "heads": 2, "layers": 1}}


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("optimize")
    torch.manual_seed(0)
    export_onnx(build_model("transformer", TRANSFORMER["model.params"]), torch.rand(2, 1, 8, 8), folder / "model.onnx")
    return folder


def _run(workdir: Path, optimize_dir: Path, out: str = "precision", **overrides) -> tuple[dict, dict]:
    cfg = config_from_dict(
        tiny_config_dict(**{**TRANSFORMER, "precision.variants": ["fp32", "fp16", "int8"], **overrides})
    )
    ctx = stage_context(
        "precision", cfg, workdir, workdir / out, {"optimize": optimize_dir}, load_dataset=partial(load_dataset, cfg)
    )
    ctx.out.mkdir(parents=True)
    summary = run(ctx).model_dump(mode="json")  # what the runner stores
    return Variants.read(ctx.out / "variants.json", hint="").variants, summary


def test_variants_and_report_fields(tmp_path: Path, exported: Path) -> None:
    variants, summary = _run(tmp_path, exported)
    assert set(variants) == set(summary["variants"]) == {"fp32", "fp16", "int8"}
    for v in variants.values():
        assert (tmp_path / "precision" / v.path).is_file()
    fp16 = variants["fp16"]
    kept_ops = " ".join(fp16.reasons.values())
    assert "LayerNormalization" in kept_ops and "Softmax" in kept_ops
    assert set(fp16.kept_fp32) == set(fp16.reasons)
    assert fp16.vs_fp32["top1_agreement"] >= 0.99 and fp16.fallback_passed
    int8 = variants["int8"]
    assert int8.report["calibration"]["qdq_nodes"]["QuantizeLinear"] > 0
    assert (tmp_path / "precision" / "int8" / int8.report["trt_calibration_table"]).is_file()


def test_variants_only_pytorch_engines_build_are_not_converted(tmp_path: Path, exported: Path) -> None:
    before = STATS["calibrations"]
    variants, summary = _run(tmp_path, exported, **{"precision.variants": ["fp16"], "build.backends": ["torch"]})
    assert variants["fp16"].path == "fp32/model.onnx" and not variants["fp16"].kept_fp32
    assert (tmp_path / "precision" / "fp32" / "model.onnx").is_file()
    assert not (tmp_path / "precision" / "fp16").exists() and STATS["calibrations"] == before
    assert "from the PyTorch model" in summary["variants"]["fp16"]["graph"]
    with_ort, _ = _run(
        tmp_path, exported, "p2", **{"precision.variants": ["fp16"], "build.backends": ["torch", "onnxruntime"]}
    )
    assert with_ort["fp16"].path == "fp16/model.onnx" and with_ort["fp16"].kept_fp32


def test_second_run_reuses_calibration(tmp_path: Path, exported: Path) -> None:
    _run(tmp_path, exported, "p1", **{"precision.variants": ["int8"]})
    assert list((tmp_path / "cache" / "calibration").glob("*.json"))
    before = STATS["calibrations"]
    variants, _ = _run(tmp_path, exported, "p2", **{"precision.variants": ["int8"], "precision.fallback.samples": 64})
    assert variants["int8"].report["calibration"]["cache_hit"] is True
    assert STATS["calibrations"] == before


def test_int64_input_model(tmp_path: Path) -> None:
    folder = tmp_path / "optimize"
    folder.mkdir()
    params = {"hidden": [16], "embed_dim": 4}
    export_onnx(build_model("mlp_embed", params), torch.randint(0, 17, (2, 64)), folder / "model.onnx")
    variants, _ = _run(tmp_path, folder, **{"model.name": "mlp_embed", "model.params": params})
    assert variants["fp16"].report["fallback"]["passed"] and variants["int8"].report["calibration"]["batches"] > 0


def test_a_failing_variant_does_not_take_the_others(
    tmp_path: Path, exported: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kiln.stages.precision.stage as stage

    def broken(*args, **kwargs):
        raise ModelError("FP16 model fails the ONNX checker: planted", hint="planted hint")

    monkeypatch.setattr(stage, "build_fp16", broken)
    variants, summary = _run(tmp_path, exported)
    assert set(variants) == {"fp32", "int8"}  # what the build stage reads: only variants that exist
    assert (
        "planted" in summary["failed"]["fp16"] and "fix:" not in summary["failed"]["fp16"]
    )  # the fix is the error's own
    assert not (tmp_path / "precision" / "fp16").exists()
    with pytest.raises(ModelError, match="no precision variant"):  # nothing left: the stage fails, clearly
        _run(tmp_path, exported, "p-only16", **{"precision.variants": ["fp16"]})


def test_kept_nodes_name_their_pytorch_module_and_errors_are_plotted(tmp_path: Path, exported: Path) -> None:
    variants, summary = _run(tmp_path, exported)
    fp16 = variants["fp16"]
    modules = fp16.report["kept_fp32_modules"]
    ln = [n for n, why in fp16.reasons.items() if "LayerNormalization" in why]
    assert ln and all("LayerNorm" in modules[n] for n in ln)  # e.g. "layers.0.norm1 (LayerNorm)"
    assert summary["variants"]["fp16"]["kept_fp32_modules"] == modules
    plot = tmp_path / "precision" / summary["node_error_plot"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 5000
    assert set(summary["first_divergence"]) == {"fp16", "int8"}
    # ONNX Runtime CPU's graph quantizes this small transformer's head alone: too little INT8 for an INT8 engine
    assert "of its FLOPs run in int8" in variants["int8"].report["ort_cpu_unmade"]
    assert "onnxruntime-cpu" not in variants["int8"].backend_paths
    hit = summary["first_divergence"]["int8"]  # INT8 diverges somewhere; the node exists and has a module
    assert hit is None or (hit["node"] in {n["name"] for n in _nodes(tmp_path)} and hit["error"] > 0.01)


def _nodes(workdir: Path) -> list[dict]:
    import onnx

    model = onnx.load(str(workdir / "precision" / "fp32" / "model.onnx"))
    return [{"name": n.name} for n in model.graph.node]


def test_modules_come_from_the_export_when_passes_dropped_the_metadata(tmp_path: Path, exported: Path) -> None:
    import onnx

    stripped = tmp_path / "optimize"  # what onnx-graphsurgeon passes leave: same node names, no metadata
    stripped.mkdir()
    model = onnx.load(str(exported / "model.onnx"))
    for node in model.graph.node:
        del node.metadata_props[:]
    onnx.save(model, str(stripped / "model.onnx"))
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "model.onnx").write_bytes((exported / "model.onnx").read_bytes())
    variants, _ = _run(tmp_path, stripped, **{"precision.variants": ["fp32", "fp16"]})
    assert any("LayerNorm" in m for m in variants["fp16"].report["kept_fp32_modules"].values())


def test_a_fallback_through_a_graph_with_scalar_tensors(tmp_path: Path, exported: Path) -> None:
    """A gate INT8 cannot meet makes the fallback compare every intermediate tensor, the attention's scalar scale
    among them (a 0-d tensor per batch; CI's CPU, whose INT8 kernels saturate, reached this path)."""
    variants, summary = _run(
        tmp_path, exported, **{"precision.variants": ["fp32", "int8"], "precision.fallback.min_cosine": 0.99999}
    )
    assert "int8" not in variants  # rounds ran, kept nodes, and said it missed: not made
    why = summary["failed"]["int8"]
    assert "not made" in why and "fallback target 0.99999" in why and "tried keeping" in why


@pytest.mark.parametrize("setting", ["on", "off"])
def test_seven_bit_weights_are_reported(tmp_path: Path, exported: Path, setting: str) -> None:
    from kiln.stages.precision.report import report_section
    from kiln.stages.precision.stage import PrecisionSummary

    variants, summary = _run(
        tmp_path, exported, **{"precision.variants": ["fp32", "int8"], "calibration.reduce_range": setting}
    )
    assert variants["int8"].report["calibration"]["reduce_range"] is (setting == "on")
    assert variants["int8"].report["ort_cpu"]["reduce_range"] is (setting == "on")
    section = "\n".join(report_section(PrecisionSummary.model_validate(summary)))
    assert ("quantized to 7 bits" in section) is (setting == "on")


def test_a_variant_not_made_says_so_in_its_table_row() -> None:
    """The fallback kept nodes and still missed the gates: the row of its numbers must not read as a variant."""
    from kiln.stages.precision.declaration import PrecisionSummary
    from kiln.stages.precision.report import report_section

    unmade = {"kept_fp32": 3, "top1_agreement": 1.0, "unmade": "int8 not made: no fallback round passed"}
    summary = PrecisionSummary(variants={"fp32": {"kept_fp32": 0, "top1_agreement": 1.0}, "int8": unmade})
    rows = [line for line in report_section(summary) if line.startswith("| ")]
    assert "| int8 (**not made**) | 3 |" in "\n".join(rows) and "| fp32 | 0 |" in "\n".join(rows)


def test_a_calibration_reader_of_zeros_stops_the_stage(
    tmp_path: Path, exported: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader whose batches are 0 in every sample is the user's mistake: one error naming the reader and its
    input, which the run stops with, not a run that goes on without its INT8 (and FP16) variants."""
    (tmp_path / "zeros_calib.py").write_text(
        "import numpy as np\ndef reader():\n    yield {'input': np.zeros((4, 1, 8, 8), np.float32)}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="reader 'zeros_calib:reader' yields input 'input' as 0 in every sample"):
        _run(tmp_path, exported, **{"calibration.reader": "zeros_calib:reader"})
