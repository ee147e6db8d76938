"""`kiln precision FILE` without --calibration, and a run from model.onnx without data.name: random inputs turn the
accuracy-driven fallback off, so a variant that misses the gates is fixed by real data, which the fix says; and a
variant that fails alone is said once, by the error the command ends with."""

from __future__ import annotations

from pathlib import Path

from tests.pipeline.test_faults import assert_clean, invoke
from tests.stages.precision.token_graph import token_graph

SHAPES = "signature.shapes={seq: [8, 16]}"
ALONE = "the others go on"


def test_a_variant_failing_on_random_inputs_is_fixed_by_real_data(tmp_path: Path) -> None:
    model = token_graph(tmp_path / "m.onnx", offset=10.0)
    result = invoke("precision", model, "-o", tmp_path / "v", "--variants", "int8", "--set", SHAPES)
    assert_clean(result, 2, "int8 not made: it misses the gates its engines face")
    fix = next(line for line in result.output.splitlines() if line.startswith("fix:"))
    assert "--calibration" in fix and "max_rounds" not in fix, fix
    assert ALONE not in result.output


def test_a_failure_beside_a_variant_that_goes_on_is_logged_when_it_happens(tmp_path: Path) -> None:
    """Not made for its gates, beside FP16: a warning when it happens (the command's error then names it)."""
    model = token_graph(tmp_path / "m.onnx", offset=10.0)
    result = invoke("precision", model, "-o", tmp_path / "v", "--variants", "fp16,int8", "--set", SHAPES)
    assert result.exit_code == 2, result.output
    said = next(line for line in result.output.splitlines() if "the other variants go on" in line)
    assert said.startswith("WARNING int8 not made: it misses the gates its engines face"), said
    assert (tmp_path / "v" / "fp16" / "model.onnx").is_file()


def test_a_run_on_random_inputs_says_to_give_data(tmp_path: Path) -> None:
    model = token_graph(tmp_path / "m.onnx", offset=10.0)
    config = tmp_path / "run.yaml"
    config.write_text(f"model: {{onnx: {model}}}\n")
    sets = ["build.backends=[onnxruntime]", "precision.variants=[int8]", SHAPES]
    result = invoke("run", config, "-w", tmp_path / "w", *(a for s in sets for a in ("--set", s)))
    assert_clean(result, 2, "error: no precision variant could be built: int8: int8 not made")
    fix = next(line for line in result.output.splitlines() if line.startswith("fix:"))
    assert fix.startswith("fix: give data.name, a data function of real inputs") and "max_rounds" not in fix, fix
    assert ALONE not in result.output
