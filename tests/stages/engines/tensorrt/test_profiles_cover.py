"""Explicit TensorRT profiles take every size the engine records for a named axis: the engine's ``axis_ranges``
come from signature.shapes, and validation and servers pass any size in them, which TensorRT refuses past its
profiles."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.core.errors import ConfigError
from kiln.core.records import TensorSpec
from kiln.stages.engines.tensorrt.config import ShapeRange
from kiln.stages.engines.tensorrt.profiles import check_profiles

SPECS = [TensorSpec(name="mel", shape=["batch", 16, "frames"], dtype="float32")]


def profile(low: int, high: int, name: str = "mel") -> dict[str, ShapeRange]:
    return {name: ShapeRange(min=[1, 16, low], opt=[1, 16, high], max=[8, 16, high])}


def test_profiles_short_of_signature_shapes_are_refused() -> None:
    with pytest.raises(ConfigError, match="take frames 8 to 32, .* are frames 8 to 64: .* at frames=33") as err:
        check_profiles([profile(8, 32)], SPECS, {"frames": [8, 64]})
    assert "--set 'signature.shapes={frames: [8, 32]}'" in (err.value.hint or "")
    with pytest.raises(ConfigError, match="frames=33, which no profile takes"):  # a gap between two profiles
        check_profiles([profile(8, 32), profile(40, 64)], SPECS, {"frames": [8, 64]})
    with pytest.raises(ConfigError, match="frames=4, which no profile takes"):  # below the smallest
        check_profiles([profile(8, 32)], SPECS, {"frames": [4, 16]})


def test_profiles_that_take_signature_shapes_pass() -> None:
    check_profiles([profile(8, 32), profile(33, 64)], SPECS, {"frames": [8, 64]})  # together, with no gap
    check_profiles([profile(1, 128)], SPECS, {"frames": [8, 64]})  # wider than the shapes
    check_profiles([profile(8, 32)], SPECS, {})  # no sizes to hold them to
    check_profiles([profile(8, 32)], SPECS, {"seq": [8, 64]})  # an axis no input has


def test_inputs_sharing_an_axis_take_the_sizes_both_profiles_take() -> None:
    specs = [*SPECS, TensorSpec(name="f0", shape=["batch", "frames"], dtype="float32")]
    both = {**profile(8, 64), "f0": ShapeRange(min=[1, 8], opt=[1, 32], max=[8, 32])}
    with pytest.raises(ConfigError, match="take frames 8 to 32,"):
        check_profiles([both], specs, {"frames": [8, 64]})


def test_a_profile_naming_no_input_is_told_the_model_s_inputs() -> None:
    with pytest.raises(ConfigError, match=r"does not match the model's inputs \['mel'\]") as err:
        check_profiles([profile(8, 32, name="input")], SPECS)
    assert "kiln inspect" not in (err.value.hint or "") and "(mel: the ONNX file's graph inputs)" in err.value.hint


def _mel_graph(path: Path) -> Path:
    """mel [batch, 16, frames] -> x 2 -> y: a graph TensorRT builds in a second."""
    two = numpy_helper.from_array(np.array(2.0, np.float32), "two")
    g = helper.make_graph(
        [helper.make_node("Mul", ["mel", "two"], ["y"])],
        "mel",
        [helper.make_tensor_value_info("mel", TensorProto.FLOAT, ["batch", 16, "frames"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 16, "frames"])],
        [two],
    )
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


@pytest.mark.tensorrt
def test_kiln_build_refuses_profiles_short_of_the_shapes_it_records(tmp_path: Path) -> None:
    """`kiln build --backend tensorrt` with a profile up to frames 32 and signature.shapes up to 64 recorded
    axis_ranges {frames: [8, 64]}: served at 33 to 64, TensorRT failed. One error and its fix, exit 2."""
    import json

    from click.testing import CliRunner

    from kiln.cli import main

    src, out = _mel_graph(tmp_path / "mel.onnx"), tmp_path / "e"
    args = ["build", str(src), "--backend", "tensorrt", "-o", str(out), "--set", "signature.shapes={frames: [8, 64]}"]
    narrow = "build.tensorrt.profiles=[{mel: {min: [1,16,8], opt: [1,16,32], max: [8,16,32]}}]"
    result = CliRunner().invoke(main, [*args, "--set", narrow])
    assert result.exit_code == 2 and not out.exists(), result.output
    lines = [line for line in result.output.splitlines() if line.startswith(("error:", "fix:"))]
    assert len(lines) == 2 and "frames=33" in lines[0] and "Traceback" not in result.output
    wide = narrow.replace("max: [8,16,32]", "max: [8,16,64]")
    result = CliRunner().invoke(main, [*args, "--set", wide])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "kiln-engine.json").read_text())["axis_ranges"] == {"frames": [8, 64]}
