"""``kiln export CONFIG -o FILE`` holds the exported graph to PyTorch at the sizes across each dynamic axis's range,
as the pipeline's export does: a forward that branches on a size (``if L % 4 != 0: pad``) exports one side of the
branch, and the steps where the graph is right are warned of and written into the file's own metadata
(``kiln.axis_steps``), where ``kiln build FILE`` reads them; a model without the branch records nothing."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import yaml
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper
from safetensors.torch import save_file

from kiln import load_engine
from kiln.cli import main
from kiln.core.onnx_io import metadata_value, save_onnx, set_metadata
from kiln.pipeline.config import load_config
from kiln.pipeline.runner import settings_for
from kiln.pipeline.stage_list import stage_named
from kiln.stages.engines.config import BuildConfig
from kiln.stages.engines.stage import build_direct
from kiln.stages.export.declaration import GRAPH_STEPS_KEY
from kiln.stages.export.stage import export_direct
from tests.stages.export.test_graph_steps import BRANCH_AT, PadsWhenNotAMultiple

MODELS = "tests.stages.export.test_graph_steps"
WARNED = "signature axis seq: the exported graph gives PyTorch's outputs only at seq in steps of 4"


def _config(tmp: Path, model: str) -> Path:
    """A config of ``model`` on series of 16 steps (test_graph_steps' data), its length a dynamic axis."""
    path = tmp / "cfg.yaml"
    cfg = {
        "model": {"name": f"{MODELS}:{model}"},
        "data": {"name": f"{MODELS}:at_16"},
        "signature": {"dynamic_axes": {"input": {1: "seq"}}},
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


def _steps_in(path: Path) -> str | None:
    """The value the ONNX file's own metadata holds under ``kiln.axis_steps``."""
    return metadata_value(onnx.load(str(path), load_external_data=False), GRAPH_STEPS_KEY)


def test_kiln_export_writes_the_steps_of_a_branch_on_the_size_into_the_file_and_warns(tmp_path: Path) -> None:
    """Checked at 8 and 16 (half the example's and its own), both multiples of 4 where the graph (no padding) is
    right; at 9-11 and 13-15 it drops the last steps: the file records [4, 0] and the command says why."""
    weights = tmp_path / "w.safetensors"
    save_file(PadsWhenNotAMultiple().state_dict(), str(weights))
    out = tmp_path / "m.onnx"
    args = ["export", str(_config(tmp_path, "branchy")), "--checkpoint", str(weights), "-o", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert json.loads(_steps_in(out) or "null") == {"seq": [4, 0]}
    assert WARNED in result.output and BRANCH_AT in result.output
    assert "fix: make the branch on the size unconditional" in result.output


def test_the_steps_are_in_the_returned_summary_and_the_file_still_runs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = load_config(_config(tmp_path, "branchy"), {})
    with caplog.at_level(logging.WARNING, logger="kiln.export"):
        summary = export_direct(settings_for(stage_named("export"), cfg), None, (), tmp_path / "m.onnx")
    assert summary["axis_steps"] == {"seq": [4, 0]} and WARNED in caplog.text
    x = np.random.default_rng(0).standard_normal((1, 12, 2)).astype(np.float32)
    (got,) = ort.InferenceSession(str(tmp_path / "m.onnx")).run(None, {"input": x})
    assert got.shape == (1, 3)


def test_a_model_that_pads_unconditionally_records_nothing_and_its_engine_takes_every_size(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = load_config(_config(tmp_path, "padded"), {})
    with caplog.at_level(logging.WARNING, logger="kiln.export"):
        summary = export_direct(settings_for(stage_named("export"), cfg), None, (), tmp_path / "m.onnx")
    assert summary["axis_steps"] == {} and _steps_in(tmp_path / "m.onnx") is None
    assert "exported graph gives PyTorch's outputs only" not in caplog.text
    meta = build_direct(
        tmp_path / "m.onnx", tmp_path / "e", "onnxruntime", "cpu", None, BuildConfig(), {"seq": [8, 16]}
    )
    assert meta.axis_steps == {}
    with load_engine(tmp_path / "e") as engine:
        assert engine.infer({"input": np.zeros((1, 13, 2), np.float32)})


def test_the_metadata_is_written_beside_weights_kept_in_an_external_file(tmp_path: Path) -> None:
    """Only the graph's protobuf is rewritten: the weights stay in ``m.onnx.data``, which the graph still names and
    ONNX Runtime still reads."""
    weight = np.random.default_rng(0).standard_normal((64, 8)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "matmul",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])],
        [numpy_helper.from_array(weight, "w")],
    )
    path = tmp_path / "m.onnx"
    save_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9), path, external=True)
    data = (tmp_path / "m.onnx.data").read_bytes()
    set_metadata(path, GRAPH_STEPS_KEY, '{"seq": [4, 0]}')
    set_metadata(path, GRAPH_STEPS_KEY, '{"seq": [2, 0]}')  # replaced, not added
    shell = onnx.load(str(path), load_external_data=False)
    assert [p.key for p in shell.metadata_props] == [GRAPH_STEPS_KEY] and _steps_in(path) == '{"seq": [2, 0]}'
    assert (tmp_path / "m.onnx.data").read_bytes() == data
    x = np.ones((1, 64), np.float32)
    (got,) = ort.InferenceSession(str(path)).run(None, {"x": x})
    assert np.allclose(got, x @ weight, atol=1e-5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "m.onnx.data"]


def test_a_missing_checkpoint_names_the_flag_it_was_given_by(tmp_path: Path) -> None:
    """``kiln export --checkpoint MISSING``: the fix names ``--checkpoint``, not a config key the user never set."""
    args = ["export", str(_config(tmp_path, "branchy")), "--checkpoint", str(tmp_path / "nope.pt")]
    result = CliRunner().invoke(main, [*args, "-o", str(tmp_path / "m.onnx")])
    assert result.exit_code == 2 and "fix: give --checkpoint the path" in result.output, result.output
