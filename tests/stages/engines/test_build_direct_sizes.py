"""`kiln build FILE` on a graph with dynamic H and W records the sizes it checked: given a range
(signature.shapes), it runs the graph there with ONNX Runtime and records the range and the steps between (so an
engine refuses a size its graph cannot take with Kiln's InputError); given none, it records none and says so."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kiln import load_engine
from kiln.core.errors import ConfigError, InputError
from kiln.stages.engines.config import BuildConfig
from kiln.stages.engines.stage import build_direct
from tests.stages.engines.unet_graph import images, unet_graph


def _build(tmp: Path, sizes: dict[str, list[int]] | None) -> object:
    src = unet_graph(tmp / "unet.onnx")
    return build_direct(src, tmp / "engine", "onnxruntime", "cpu", None, BuildConfig(), sizes)


def test_a_given_range_is_probed_and_its_steps_recorded(tmp_path: Path) -> None:
    meta = _build(tmp_path, {"H": [8, 32], "W": [8, 32]})
    assert meta.axis_ranges == {"H": [8, 32], "W": [8, 32]}
    assert meta.axis_steps == {"H": [2, 0], "W": [2, 0]}


def test_a_size_between_the_steps_is_kilns_input_error_not_the_backends(tmp_path: Path) -> None:
    _build(tmp_path, {"H": [8, 32], "W": [8, 32]})
    with load_engine(tmp_path / "engine") as runner:
        assert runner.infer({"input": images(1, 10)})["logits"].shape == (1, 4, 10, 10)
        with pytest.raises(InputError, match=r"axis 2 \(H\) is 9: .* from 8 to 32 in steps of 2"):
            runner.infer({"input": images(1, 9)})


def test_a_range_end_the_graph_cannot_take_is_an_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not run at H=33") as caught:
        _build(tmp_path, {"H": [8, 33], "W": [8, 32]})
    assert "H: [8, 32]" in caught.value.hint


def test_no_sizes_record_no_range_and_warn_naming_the_axes(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kiln.build"):
        meta = _build(tmp_path, None)
    assert meta.axis_ranges == {} and meta.axis_steps == {}
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(m.startswith("axes H, W: no sizes were given") and "signature.shapes={H:" in m for m in said), said


def test_sizes_for_axes_the_graph_lacks_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"signature.shapes names axes \['seq'\]"):
        _build(tmp_path, {"seq": [8, 32]})


def test_sizes_for_some_axes_only_record_none(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kiln.build"):
        meta = _build(tmp_path, {"H": [8, 32]})
    assert meta.axis_ranges == {}
    assert any("axes H, W: no sizes were given for W" in r.getMessage() for r in caplog.records)
