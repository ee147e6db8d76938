"""signature.shapes keyed by axes signature.dynamic_axes does not declare is said by the export stage's quick check,
before any stage of the run does work, where Kiln exports the PyTorch model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kiln.core.errors import ConfigError
from kiln.core.shapes import axis_sizes
from kiln.core.signature import Signature, check_declared_shapes
from kiln.pipeline.config import config_from_dict
from kiln.pipeline.runner import settings_for
from kiln.pipeline.stage_list import stage_named
from tests.conftest import tiny_config_dict

SHAPES = {"frames": [8, 64]}


def _export_settings(**overrides: Any) -> Any:
    """The export stage's settings of a tiny config with ``overrides`` (dotted keys)."""
    return settings_for(stage_named("export"), config_from_dict(tiny_config_dict(**overrides)))


def test_shapes_of_an_axis_no_dynamic_axes_declare_fail_the_check_with_the_export_s_own_error() -> None:
    with pytest.raises(ConfigError) as caught:
        check_declared_shapes(_export_settings(**{"signature.shapes": SHAPES}))
    assert caught.value.message == "signature.shapes names axes ['frames']; signature.dynamic_axes declares none"
    assert "declare frames in signature.dynamic_axes" in (caught.value.hint or "")
    with pytest.raises(ConfigError) as stage:  # the words the export and precision stages give for it
        axis_sizes([], {}, SHAPES)
    assert (caught.value.message, caught.value.hint) == (stage.value.message, stage.value.hint)


def test_shapes_of_another_axis_than_declared_name_the_declared_one() -> None:
    axes = {"x": {2: "seq"}}
    with pytest.raises(ConfigError) as caught:
        check_declared_shapes(_export_settings(**{"signature.shapes": SHAPES, "signature.dynamic_axes": axes}))
    assert caught.value.message == "signature.shapes names axes ['frames']; signature.dynamic_axes declares ['seq']"
    assert "{seq: [8, 32]}" in (caught.value.hint or "")


@pytest.mark.parametrize(
    "overrides",
    [
        {"signature.shapes": SHAPES, "signature.dynamic_axes": {"x": {2: "frames"}}},
        {"signature.dynamic_axes": {"x": {2: "frames"}}},
        {},
        # a run from an ONNX file: its axis names are the file's, checked by the stages that read it
        {"signature.shapes": SHAPES, "model.onnx": "given.onnx"},
    ],
)
def test_declared_or_absent_shapes_and_a_model_onnx_run_pass_the_check(
    overrides: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "given.onnx").write_bytes(b"")  # a config naming a file is checked for it
    check_declared_shapes(_export_settings(**overrides))


def test_declared_axes_leave_the_batch_out() -> None:
    sig = Signature(dynamic_axes={"ids": {1: "seq"}, "mask": {1: "seq"}, "img": {2: "h", 3: "w"}})
    assert sig.declared_axes() == ["h", "seq", "w"]
