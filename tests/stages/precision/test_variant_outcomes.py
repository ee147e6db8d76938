"""What the precision stage says of a variant's outcome: one not made for its gates, beside others that go on, is one
warning that says what precision.required would make of it; a graph that failed its gates and is kept for inspection
says so, and where."""

from __future__ import annotations

import json
import logging
from functools import partial
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.core.records import Variants
from kiln.pipeline.config import config_from_dict
from kiln.pipeline.runner import load_dataset
from kiln.stages.precision.stage import run
from tests.conftest import stage_context, tiny_config_dict
from tests.pipeline.test_faults import invoke

STRICT = {"int8": {"min_cosine": 0.9999999}}  # no INT8 graph of the MLP gets there


def mlp(path: Path) -> Path:
    """``x`` float ``[batch, 16]`` -> MatMul -> Relu -> MatMul -> ``logits [batch, 4]``, as a user brings one."""
    g = np.random.default_rng(0)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w1"], ["h"]),
            helper.make_node("Relu", ["h"], ["r"]),
            helper.make_node("MatMul", ["r", "w2"], ["logits"]),
        ],
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 4])],
        [
            numpy_helper.from_array(g.standard_normal((16, 32)).astype(np.float32), "w1"),
            numpy_helper.from_array(g.standard_normal((32, 4)).astype(np.float32), "w2"),
        ],
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def _run(tmp_path: Path, **overrides) -> tuple[dict, dict]:
    """The precision stage of a run from the MLP's model.onnx, no data.name: FP32 and INT8 (its Q/DQ graph alone)."""
    optimize = tmp_path / "optimize"
    model = mlp(optimize / "model.onnx")
    settings = {"precision.variants": ["fp32", "int8"], "calibration.ort_cpu_graph": False, **overrides}
    cfg = config_from_dict(tiny_config_dict(**{"model": {"onnx": str(model)}, **settings}))
    out = tmp_path / "precision"
    ctx = stage_context(
        "precision", cfg, tmp_path, out, {"optimize": optimize}, load_dataset=partial(load_dataset, cfg)
    )
    out.mkdir()
    summary = run(ctx).model_dump(mode="json")
    return Variants.read(out / "variants.json", hint="").variants, summary


@pytest.mark.parametrize("required", [[], ["int8"]])
def test_a_variant_not_made_for_its_gates_is_a_warning_beside_the_others(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, required: list[str]
) -> None:
    """FP32 goes on without INT8: a warning, which says what precision.required makes of it, not an error."""
    with caplog.at_level(logging.INFO):
        variants, summary = _run(tmp_path, **{"validate.gates.per_precision": STRICT, "precision.required": required})
    assert set(variants) == {"fp32"} and "int8 not made" in summary["failed"]["int8"]
    said = [r for r in caplog.records if "int8 not made" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.WARNING], caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    then = (
        "the other variants go on, but precision.required lists int8: the run fails at validation without it"
        if required
        else "the other variants go on, and so does the run (int8 in precision.required would make it fail the run)"
    )
    assert then in said[0].getMessage()


def test_a_q_dq_graph_that_failed_its_gates_is_said_kept_for_inspection(tmp_path: Path) -> None:
    """`kiln precision --calibration`: calibrated on the first 8 rows (100 times smaller than the rest), the Q/DQ
    graph clips the others and fails its gates, while ONNX Runtime CPU's own graph (dynamically quantized) passes:
    the Q/DQ graph stays in int8/, listed unmade, and the log says it failed its gates and is kept there."""
    x = np.random.default_rng(0).standard_normal((128, 16)).astype(np.float32)
    x[:8] *= 0.01
    np.savez(tmp_path / "c.npz", x=x)
    sets = ["calibration.num_batches=1", "calibration.batch_size=8", "precision.fallback.enabled=false"]
    result = invoke(
        "precision",
        mlp(tmp_path / "model.onnx"),
        "-o",
        tmp_path / "v",
        "--variants",
        "fp16,int8",
        "--calibration",
        tmp_path / "c.npz",
        *(a for s in sets for a in ("--set", s)),
    )
    assert result.exit_code == 0, result.output
    unmade = json.loads((tmp_path / "v" / "variants.json").read_text())["variants"]["int8"]["unmade"]
    assert unmade.startswith("int8 (Q/DQ graph) failed its gates: it misses the gates its engines face"), unmade
    assert unmade.endswith("the accuracy fallback is off") and "no node was tried" not in unmade  # it was off
    assert (tmp_path / "v" / "int8" / "model.onnx").is_file()
    line = next(ln for ln in result.output.splitlines() if "int8 (Q/DQ graph)" in ln)
    assert "failed its gates" in line and "kept for inspection as int8/model.onnx beside variants.json" in line
    assert "int8 (Q/DQ graph) not made" not in result.output
