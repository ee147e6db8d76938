"""`kiln loadtest` of an engine folder that no run's data come with: random requests said as such (no other
data set beside the engine's inputs), and the engine's axes named as its record names them."""

from __future__ import annotations

import socket
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper

from kiln.cli import main
from kiln.core.errors import ConfigError
from kiln.core.records import TensorSpec
from kiln.serve.loadtest import fit


def _seq_onnx(path: Path) -> Path:
    """x [batch, seq, 16] -> Relu -> y [batch, seq, 16]."""
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "enc",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", 16])],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
    return path


def _closed_port() -> int:
    """A loopback port nothing listens on (one the system just handed out and took back)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_data_that_does_not_fit_is_said_with_the_engines_own_axis_names() -> None:
    spec = TensorSpec(name="x", shape=["batch", "seq", 16], dtype="float32")
    with pytest.raises(ConfigError) as err:
        fit(spec, np.zeros((64, 1, 8, 8), np.float32))
    assert "the engine takes float32[batch, seq, 16]" in err.value.message, err.value.message


def test_a_bare_engine_folder_gets_random_requests_because_no_data_was_given(tmp_path: Path) -> None:
    """No -c and no workdir: nothing to compare the engine's inputs with (the built-in demo's digits are no data
    of the user's); the warning says the requests are random and how to give data."""
    engine = tmp_path / "eng"
    built = CliRunner().invoke(
        main,
        ["build", str(_seq_onnx(tmp_path / "m.onnx")), "-o", str(engine), "--set", "signature.shapes={seq: [4, 12]}"],
    )
    assert built.exit_code == 0, built.output
    url = f"http://127.0.0.1:{_closed_port()}"
    out = CliRunner().invoke(main, ["loadtest", url, "-e", str(engine), "--duration", "1", "-o", str(tmp_path / "lt")])
    said = " ".join(out.output.split())  # the log's lines wrap at the terminal's width
    assert "gets RANDOM inputs (x float32[1, 12, 16]): no data given" in said, said  # seq at its largest
    assert "give -c CONFIG" in said and "-e WORKDIR" in said, said
    assert "the data's input" not in said and "digits" not in said, said
