"""`kiln precision FILE --variants fp16` writes fp32 too: the baseline the variants are checked against, which
`kiln build` of a variant reads beside it. Not asked for, its line says so and why."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from click.testing import CliRunner

from kiln.cli import main
from tests.stages.precision.precision_graphs import chain_graph, inputs


def _lines(tmp: Path, variants: str) -> dict[str, str]:
    """Each variant's line of `kiln precision` on a tiny graph, by the variant's name."""
    model, feed, out = tmp / "m.onnx", tmp / "d.npz", tmp / "v"
    onnx.save(chain_graph(), model)
    np.savez(feed, input=inputs(64))
    args = ["precision", str(model), "-o", str(out), "--variants", variants, "--calibration", str(feed)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert (out / "fp32" / "model.onnx").is_file()
    return {line.partition(":")[0]: line for line in result.output.splitlines() if line.startswith("fp")}


def test_the_fp32_variant_not_asked_for_says_why_it_is_written(tmp_path: Path) -> None:
    """It was listed as one of the variants asked for: `fp32: v/fp32/model.onnx (0 nodes kept FP32)`."""
    said = _lines(tmp_path, "fp16")
    assert "(not asked for: your model with its nodes named, the baseline the variants were" in said["fp32"]
    assert "`kiln build` of a variant probes its sizes with it" in said["fp32"]
    assert said["fp16"].endswith("(0 nodes kept FP32)")
