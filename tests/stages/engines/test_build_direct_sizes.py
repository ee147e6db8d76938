"""`kiln build FILE` on a graph with dynamic H and W records the sizes it checked: given a range
(signature.shapes), it runs the graph there with ONNX Runtime and records the range and the steps between (so an
engine refuses a size its graph cannot take with Kiln's InputError); given none, it records none and says so."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln import load_engine
from kiln.core.errors import ConfigError, InputError
from kiln.stages.engines.config import BuildConfig
from kiln.stages.engines.sizes import SizeProbe
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
        with pytest.raises(
            InputError, match=r"axis 2 \(H\) is 9: .* graph takes H only in steps of 2 .* nearest sizes .* 8 and 10"
        ):
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


def test_a_backend_that_refuses_axes_without_sizes_is_not_said_to_take_any(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """TensorRT needs sizes for its profiles: its error is the one thing said, not beside a warning that the
    engine takes any size (ONNX Runtime's build, which takes any, still warns: the test above)."""
    src = unet_graph(tmp_path / "unet.onnx")
    with caplog.at_level(logging.WARNING, logger="kiln.build"), pytest.raises(ConfigError, match="no sizes known"):
        build_direct(src, tmp_path / "engine", "tensorrt", "cuda", None, BuildConfig(), None)
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert not [m for m in said if "takes any" in m], said


def test_sizes_for_axes_the_graph_lacks_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"signature.shapes names axes \['seq'\]"):
        _build(tmp_path, {"seq": [8, 32]})


def test_sizes_for_some_axes_only_record_none(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kiln.build"):
        meta = _build(tmp_path, {"H": [8, 32]})
    assert meta.axis_ranges == {}
    assert any("axes H, W: no sizes were given for W" in r.getMessage() for r in caplog.records)


def _graph(path: Path, inputs: dict[str, list[str | int]], nodes: list[onnx.NodeProto], output: str) -> Path:
    """Write a graph of ``nodes`` over float ``inputs`` (name -> shape) with one float output ``output``."""
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs.items()],
        [helper.make_tensor_value_info(output, TensorProto.FLOAT, None)],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def _coupled(tmp: Path) -> Path:
    """Add(a[batch, n, 4], b[batch, m, 4]): it runs where n == m only."""
    return _graph(tmp / "add.onnx", {"a": ["batch", "n", 4], "b": ["batch", "m", 4]}, [_node("Add", "a", "b")], "y")


def _node(op: str, *inputs: str, out: str = "y") -> onnx.NodeProto:
    return helper.make_node(op, list(inputs), [out])


def _decoder(tmp: Path) -> Path:
    """A decoder step with past, named as Optimum names it: the mask spans the past and the new token."""
    inputs = {
        "new": ["batch", "sequence_length", 8],
        "past": ["batch", "past_sequence_length", 8],
        "mask": ["batch", "past_sequence_length + 1", 1],
    }
    nodes = [helper.make_node("Concat", ["past", "new"], ["cat"], axis=1), _node("Mul", "cat", "mask")]
    return _graph(tmp / "decoder.onnx", inputs, nodes, "y")


def _build_graph(src: Path, sizes: dict[str, list[int]]) -> object:
    return build_direct(src, src.parent / "engine", "onnxruntime", "cpu", None, BuildConfig(), sizes)


def test_axes_that_must_agree_are_probed_together(tmp_path: Path) -> None:
    meta = _build_graph(_coupled(tmp_path), {"n": [8, 64], "m": [8, 64]})
    assert meta.axis_ranges == {"n": [8, 64], "m": [8, 64]} and meta.axis_steps == {}


def test_a_decoder_with_past_is_probed_with_its_mask(tmp_path: Path) -> None:
    sizes = {"sequence_length": [1, 1], "past_sequence_length": [8, 64], "past_sequence_length + 1": [9, 65]}
    meta = _build_graph(_decoder(tmp_path), sizes)
    assert meta.axis_ranges == sizes


def test_axes_coupled_beyond_pairing_record_no_range_and_warn(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Add(a[n], Tile(b[m], 2)) runs where n == 2 m: each end runs with the other axis at its own end only."""
    reps = numpy_helper.from_array(np.array([1, 2, 1], np.int64), "reps")
    nodes = [helper.make_node("Constant", [], ["reps"], value=reps), _node("Tile", "b", "reps", out="t")]
    src = _graph(
        tmp_path / "tile.onnx", {"a": ["batch", "n", 4], "b": ["batch", "m", 4]}, [*nodes, _node("Add", "a", "t")], "y"
    )
    with caplog.at_level(logging.WARNING, logger="kiln.build"):
        meta = _build_graph(src, {"n": [8, 64], "m": [4, 32]})
    assert meta.axis_ranges == {} and meta.axis_steps == {}
    assert any(r.getMessage().startswith("axes m, n: ") for r in caplog.records if r.levelno == logging.WARNING)


def test_an_end_that_fails_with_the_axes_moved_together_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not run at H=33"):
        _build(tmp_path, {"H": [8, 33], "W": [8, 33]})


def test_steps_are_found_in_few_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A graph that takes multiples of 16 only: its steps from a handful of runs, not every size of two periods."""
    runs = _count_runs(monkeypatch)
    src = unet_graph(tmp_path / "unet.onnx", levels=4)
    meta = build_direct(
        src, tmp_path / "engine", "onnxruntime", "cpu", None, BuildConfig(), {"H": [32, 512], "W": [32, 512]}
    )
    assert meta.axis_steps == {"H": [16, 0], "W": [16, 0]}
    assert len(runs) <= 50, len(runs)


def test_steps_beyond_the_run_budget_record_the_range_and_warn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A graph that takes multiples of 37 only (a reshape into rows of 37): no power of two, found only by running
    every size of two periods, which the build does not spend."""
    runs = _count_runs(monkeypatch)
    shape = numpy_helper.from_array(np.array([0, -1, 37], np.int64), "shape")
    nodes = [helper.make_node("Constant", [], ["shape"], value=shape), _node("Reshape", "a", "shape")]
    src = _graph(tmp_path / "rows.onnx", {"a": ["batch", "n"]}, nodes, "y")
    with caplog.at_level(logging.WARNING, logger="kiln.build"):
        meta = _build_graph(src, {"n": [37, 370]})
    assert meta.axis_ranges == {"n": [37, 370]} and meta.axis_steps == {}
    assert len(runs) <= 60, len(runs)
    assert any("not fully probed" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def _count_runs(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, int]]:
    """The sizes the build runs its graph at, recorded as it runs them."""
    runs: list[dict[str, int]] = []
    real = SizeProbe._run

    def counted(self: SizeProbe, point: dict[str, int]) -> str | None:
        runs.append(point)
        return real(self, point)

    monkeypatch.setattr(SizeProbe, "_run", counted)
    return runs
