"""`kiln serve` serves the engines this machine can run: one it cannot (a CUDA engine here) is left out with a
warning, and a folder of none such is one error naming why, before any server starts."""

from __future__ import annotations

import logging
from pathlib import Path

import onnx
import onnxruntime as ort
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper

from kiln.cli import main
from kiln.core.errors import BackendUnavailable
from kiln.serve.server import ServedEngine, find_engines, runnable_here

pytestmark = pytest.mark.skipif(
    "CUDAExecutionProvider" in ort.get_available_providers(), reason="a CUDA engine runs on this machine"
)


def _cpu_engine(tmp_path: Path) -> ServedEngine:
    """An ONNX Runtime CPU engine of a one-node graph, built by `kiln build`."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "m.onnx")
    built = CliRunner().invoke(main, ["build", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "eng")])
    assert built.exit_code == 0, built.output
    return find_engines(tmp_path / "eng")[0]


def test_an_engine_this_machine_cannot_run_is_left_out_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    cpu = _cpu_engine(tmp_path)
    monkeypatch.setattr(logging.getLogger("kiln"), "propagate", True)  # the command above kept its log to itself
    cuda = ServedEngine("cuda_twin", cpu.engine_dir, cpu.meta.model_copy(update={"device": "cuda"}))
    with caplog.at_level(logging.WARNING, logger="kiln.serve.server"):
        assert runnable_here([cpu, cuda]) == [cpu]
    assert "not serving cuda_twin" in caplog.text


def test_a_folder_of_engines_none_of_which_runs_here_is_one_error(tmp_path: Path) -> None:
    cpu = _cpu_engine(tmp_path)
    cuda = ServedEngine("cuda_twin", cpu.engine_dir, cpu.meta.model_copy(update={"device": "cuda"}))
    with pytest.raises(BackendUnavailable) as err:
        runnable_here([cuda])
    assert "cuda_twin" in str(err.value) and err.value.hint
