"""Calling an engine from Python the wrong way: one InputError with the fix, never a bare Python error."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kiln.core.errors import InputError, InputFileError
from kiln.stages.engines.registry import load_engine
from tests.pipeline.test_faults import invoke, tiny_onnx


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("runner")
    out = tmp / "e"
    assert invoke("build", tiny_onnx(tmp / "m.onnx"), "-o", out).exit_code == 0
    return out


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


def test_an_engine_folder_that_does_not_exist_is_said_so(tmp_path: Path) -> None:
    """It was "not a Kiln engine (no kiln-engine.json)", which reads as a folder of something else."""
    with pytest.raises(InputFileError, match="moved-away does not exist"):
        load_engine(tmp_path / "moved-away")
