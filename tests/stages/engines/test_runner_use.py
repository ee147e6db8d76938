"""Calling an engine from Python the wrong way: one InputError with the fix, never a bare Python error."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from kiln.core.errors import InputError, InputFileError
from kiln.stages.engines.backend import SIDECAR, read_metadata
from kiln.stages.engines.config import BuildConfig
from kiln.stages.engines.registry import load_engine
from kiln.stages.engines.stage import build_engine
from tests.pipeline.test_faults import invoke, tiny_onnx


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("runner")
    out = tmp / "e"
    assert invoke("build", tiny_onnx(tmp / "m.onnx"), "-o", out).exit_code == 0
    return out


@pytest.fixture(scope="module")
def ranged_engine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An ONNX Runtime CPU engine of ``y = relu(x)``, x ``[batch, seq]``, built for seq 4 to 8 (axis_ranges)."""
    tmp = tmp_path_factory.mktemp("ranged")
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "relu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq"])],
    )
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(tmp / "relu.onnx"))
    cfg = BuildConfig(backends=["onnxruntime"])
    meta = build_engine(
        tmp / "relu.onnx", tmp / "e", "onnxruntime", "cpu", "fp32", cfg, tmp / "c", axis_sizes={"seq": [4, 8]}
    )
    assert meta.axis_ranges == {"seq": [4, 8]}
    return tmp / "e"


def _feed(runner) -> dict[str, np.ndarray]:
    spec = runner.meta.inputs[0]
    shape = [2 if not isinstance(d, int) or d < 1 else d for d in spec.shape]
    return {spec.name: np.zeros(shape, spec.dtype)}


def test_an_engine_called_outside_its_with_block_says_how_to_call_it(engine: Path) -> None:
    runner = load_engine(engine)
    with pytest.raises(InputError, match="called before it was activated") as err:
        runner.infer(_feed(runner))
    assert "with load_engine(path) as engine" in err.value.hint


def test_an_array_instead_of_a_dict_names_the_inputs(engine: Path) -> None:
    with load_engine(engine) as runner:
        with pytest.raises(InputError, match="takes a dict of input name -> array, not a ndarray"):
            runner.infer(next(iter(_feed(runner).values())))


def test_a_backend_error_outside_the_validated_sizes_is_said_as_those_sizes(
    engine: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past a BERT's position table ONNX Runtime raised its own error; inside the sizes its error stays its own."""
    with load_engine(engine) as runner:
        feed = _feed(runner)

        def fails(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            raise RuntimeError("[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : invalid expand shape")

        monkeypatch.setattr(runner, "_infer", fails)
        monkeypatch.setattr(type(runner.meta), "refusal", lambda self, feed: "axis 1 (seq) is 80: validated 8 to 16")
        with pytest.raises(InputError, match="seq\\) is 80: validated 8 to 16; the engine failed on it: .*expand"):
            runner.infer(feed)
        monkeypatch.setattr(type(runner.meta), "refusal", lambda self, feed: None)
        with pytest.raises(RuntimeError, match="invalid expand shape"):
            runner.infer(feed)


def test_a_size_outside_the_validated_range_is_refused_before_the_engine_runs(ranged_engine: Path) -> None:
    """ONNX Runtime runs a Relu at any length: unchecked, seq 16 would be answered though nobody validated it."""
    x = np.linspace(-1, 1, 32, dtype=np.float32).reshape(2, 16)
    with load_engine(ranged_engine) as runner:
        for seq in (4, 8):  # both ends of the range
            np.testing.assert_array_equal(runner.infer({"x": x[:, :seq]})["y"], np.maximum(x[:, :seq], 0))
        for seq in (16, 2):
            with pytest.raises(InputError) as err:
                runner.infer({"x": x[:, :seq]})
            assert err.value.message == (
                f"input 'x' axis 1 (seq) is {seq}: engine onnxruntime-cpu-fp32 was built for seq from 4 to 8"
            )
            assert "\n  fix: " in str(err.value) and "allow_outside_ranges=True" in err.value.hint
        # the documented way to try a size before validating it
        np.testing.assert_array_equal(runner.infer({"x": x}, allow_outside_ranges=True)["y"], np.maximum(x, 0))


def test_a_packaged_engine_takes_no_more_rows_than_were_validated(ranged_engine: Path, tmp_path: Path) -> None:
    """The package records the batches validation compared the engine at; the servers refuse more, so does infer."""
    packaged = tmp_path / "packaged"
    shutil.copytree(ranged_engine, packaged)
    meta = read_metadata(packaged)
    meta.model_copy(update={"validated_batch_sizes": [1, 4]}).write(packaged / SIDECAR)
    x = np.ones((5, 4), np.float32)
    with load_engine(packaged) as runner:
        assert runner.infer({"x": x[:4]})["y"].shape == (4, 4)
        with pytest.raises(InputError) as err:
            runner.infer({"x": x})
        assert (
            err.value.message == "input 'x' has 5 rows: engine onnxruntime-cpu-fp32 was validated for batches up to 4"
        )
        assert "at most that many rows" in err.value.hint
        assert runner.infer({"x": x}, allow_outside_ranges=True)["y"].shape == (5, 4)


def test_an_engine_folder_that_does_not_exist_is_said_so(tmp_path: Path) -> None:
    """It was "not a Kiln engine (no kiln-engine.json)", which reads as a folder of something else."""
    with pytest.raises(InputFileError, match="moved-away does not exist"):
        load_engine(tmp_path / "moved-away")
