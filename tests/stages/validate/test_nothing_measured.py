"""An engine whose outputs and the reference's are NaN alike at a validated size compares as equal there (cosine 1,
error 0): nothing was measured, and the pipeline's validation fails it as ``kiln validate ENGINE`` does, naming the
size, with a fix about the model's inputs rather than the engine's precision or the gates."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from torch import nn

from kiln import DatasetSplits
from kiln.core.errors import GateFailure
from kiln.pipeline.api import run_pipeline
from kiln.pipeline.config import config_from_dict
from kiln.pipeline.report import result_line
from kiln.stages.validate.measured import NO_FINITE_FIX
from kiln.stages.validate.report import gate_failure_hint

DIM = 4


class Overflow(nn.Module):
    """exp of a running sum over the sequence, normalised per row: finite while the sum stays below FP32's exp limit
    (about 88.7), inf / inf = NaN in every value past it. Inputs lie in [0, 1) and the sum adds 1 per position, so
    16 positions stay finite and 96 overflow in every row."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.exp(torch.cumsum(x + 1, 1)).sum(1)
        return self.proj(h / h.sum(1, keepdim=True))


def build() -> nn.Module:
    return Overflow()


def load_long() -> DatasetSplits:
    x = torch.rand(32, 96, DIM, generator=torch.Generator().manual_seed(0))
    return DatasetSplits(x[:16], None, x[16:], None)


def _run(tmp_path: Path, data: str, seq: list[int]) -> tuple[dict, dict, str]:
    """The pipeline through validation (no training, FP32, ONNX Runtime), which fails its gates: validation.json's
    one engine, report.json and report.md."""
    cfg = config_from_dict(
        {
            "model": {"name": f"{__name__}:build"},
            "data": {"name": f"{__name__}:{data}"},
            "train": {"enabled": False},
            "signature": {"batch_sizes": [1, 4], "dynamic_axes": {"input": {1: "seq"}}, "shapes": {"seq": seq}},
            "precision": {"variants": ["fp32"]},
            "build": {"backends": ["onnxruntime"]},
            "validate": {"warmup": 1, "iterations": 3},
        }
    )
    result, _ = run_pipeline(cfg, tmp_path, stop="validate")
    assert isinstance(result.error, GateFailure), result.error
    assert "nothing was compared there" in result.error.message
    assert result.error.hint == NO_FINITE_FIX  # the run's fix line: no gate or precision helps here
    (engine,) = json.loads((tmp_path / "validate" / "validation.json").read_text())["engines"]
    return engine, json.loads((tmp_path / "report.json").read_text()), (tmp_path / "report.md").read_text()


def test_an_output_nan_in_every_sample_at_the_datas_own_size_fails_validation(tmp_path: Path) -> None:
    engine, report, md = _run(tmp_path, "load_long", [96])
    assert not engine["passed"]
    (failure,) = engine["failures"]
    assert failure.startswith("reference output 'logits' is NaN, infinite or a mask's fill at every value of all 16 ")
    assert "samples at seq=96, and so is engine " in failure and "nothing was compared there" in failure
    assert engine["hints"] == [NO_FINITE_FIX]  # not the backend's hints about how it was built
    assert not report["ok"] and result_line(report).startswith("FAILED")
    assert "### Gate failures" in md and "at seq=96" in md and NO_FINITE_FIX in md


def test_a_size_where_the_model_overflows_fails_the_engine_and_names_the_size(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Finite at seq 16 (the data's 96 positions cut) and NaN at 96: the size 96 fails, 16 alone is measured."""
    with caplog.at_level(logging.WARNING, logger="kiln"):
        engine, report, _ = _run(tmp_path, "load_long", [16, 96])
    assert [f for f in engine["failures"] if "nothing was compared there" in f] == engine["failures"]
    assert len(engine["failures"]) == 1 and "all 16 samples at seq=96" in engine["failures"][0]
    assert not engine["passed"] and not report["ok"] and engine["shapes"] == [{"seq": 16}, {"seq": 96}]
    assert "nothing was compared on those samples" not in caplog.text  # every sample: a failure, not a warning


def test_the_direct_fix_for_nothing_measured_is_about_the_inputs() -> None:
    """`kiln validate ENGINE`'s fix line: neither the engine's precision nor a gate gives an FP32 engine of a model
    that is NaN itself a number to compare. On random inputs (standard normal: a log or square root of negatives),
    real ones come first."""
    failure = "reference output 'y' is NaN, infinite or a mask's fill at every value ...: nothing was compared there"
    assert gate_failure_hint(Path("x.npz"), [failure]) == NO_FINITE_FIX
    random = gate_failure_hint(None, [failure])
    assert random.startswith("these were random inputs: validate on real ones with --inputs data.npz")
    assert random.endswith(NO_FINITE_FIX) and "relax validate.gates" not in random
    mixed = gate_failure_hint(Path("x.npz"), [failure, "cosine 0.5 < min_cosine 0.9999"])
    assert mixed.startswith(NO_FINITE_FIX) and "relax validate.gates" in mixed
    assert gate_failure_hint(Path("x.npz"), ["cosine 0.5 < min_cosine 0.9999"]).startswith("inspect the engine's")


def test_the_direct_fix_for_an_fp32_engine_is_its_graph_not_its_precision() -> None:
    failed, ckpt = ["cosine 0.996 < min_cosine 0.9999"], Path("model.safetensors")
    assert gate_failure_hint(Path("x.npz"), failed, "fp32", ckpt).startswith("an fp32 engine whose cosine")
    assert gate_failure_hint(Path("x.npz"), failed, "int8", ckpt).startswith("inspect the engine's precision")
    # a tolerance tightened past rounding, or a reference that is already an ONNX file: the usual fix
    tight = ["max abs err 8.6e-07 > max_abs_err 0.0"]
    assert gate_failure_hint(Path("x.npz"), tight, "fp32", ckpt).startswith("inspect the engine's precision")
    onnx_ref = Path("export/model.onnx")
    assert gate_failure_hint(Path("x.npz"), failed, "fp32", onnx_ref).startswith("inspect the engine's precision")
