"""``kiln optimize model.onnx -o out.onnx``: what it answers on stdout, and what stays off it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import helper as h

from kiln.cli import main
from kiln.stages.optimize import registry
from tests.stages.optimize.optimize_helpers import FLOAT, make_model


@pytest.fixture
def cli() -> CliRunner:
    return CliRunner()


def _relu_to_identity(graph, params) -> int:  # a deliberately wrong rewrite
    relus = [node for node in graph.nodes if node.op == "Relu"]
    for node in relus:
        node.op = "Identity"
    return len(relus)


@pytest.fixture
def identity_relu(tmp_path: Path) -> Path:
    """x -> Identity -> Relu -> y: eliminate_identity removes a node; a Relu a wrong pass can break."""
    nodes = [h.make_node("Identity", ["x"], ["a"]), h.make_node("Relu", ["a"], ["y"])]
    path = tmp_path / "m.onnx"
    onnx.save(make_model(nodes, [("x", ["N", 8], FLOAT)], ["y"], {}), str(path))
    return path


def _optimize(cli: CliRunner, model: Path, *args: str) -> list[str]:
    result = cli.invoke(main, ["optimize", str(model), "-o", str(model.with_name("out.onnx")), *args])
    assert result.exit_code == 0, result.output
    return result.stdout.splitlines()


def test_the_answer_says_the_passes_were_verified(cli: CliRunner, identity_relu: Path) -> None:
    wrote, checked = _optimize(cli, identity_relu, "--passes", "eliminate_identity")
    assert wrote.endswith(": 2 -> 1 nodes")
    assert checked == "verified: outputs match the input model's on random inputs (1 check)"


def test_the_answer_says_when_nothing_was_verified(cli: CliRunner, identity_relu: Path) -> None:
    """``optimize.verify: false`` ships the rewrite unchecked: the answer says so, unlike a checked one's."""
    lines = _optimize(cli, identity_relu, "--passes", "eliminate_identity", "--set", "optimize.verify=false")
    assert lines[1].startswith("not verified (optimize.verify is off)")


def test_the_answer_names_the_passes_rolled_back(cli: CliRunner, identity_relu: Path, monkeypatch) -> None:
    monkeypatch.setitem(
        registry.PASSES, "wrong", registry.PassSpec("wrong", _relu_to_identity, registry.NoParams, "bad")
    )
    wrote, checked = _optimize(cli, identity_relu, "--passes", "eliminate_identity,wrong")
    assert wrote.endswith(": 2 -> 1 nodes")
    assert checked.startswith("verified: outputs match") and checked.endswith("; rolled back: wrong")


def test_onnx_graphsurgeons_warnings_go_to_stderr_not_stdout(cli: CliRunner, tmp_path: Path) -> None:
    """Two nodes of one name (ONNX Runtime refuses them, so unverified): onnx-graphsurgeon warns when it writes the
    graph back, and its logger printed to stdout, into the command's answer."""
    nodes = [h.make_node("Identity", ["x"], ["a"], name="i")]
    nodes += [h.make_node("Relu", ["a"], ["b"], name="relu"), h.make_node("Relu", ["b"], ["y"], name="relu")]
    model = tmp_path / "m.onnx"
    onnx.save(make_model(nodes, [("x", ["N", 8], FLOAT)], ["y"], {}), str(model))
    result = cli.invoke(
        main, ["optimize", str(model), "-o", str(tmp_path / "out.onnx"), "--set", "optimize.verify=false"]
    )
    assert result.exit_code == 0, result.output
    assert "share the same name" not in result.stdout and "[W]" not in result.stdout, result.stdout
    assert result.stdout.startswith("wrote ")
    assert "WARNING" in result.stderr and "share the same name" in result.stderr  # a warning still, on stderr


@pytest.fixture
def audio(tmp_path: Path) -> Path:
    """x [N, 1, samples] -> Identity -> Conv (kernel 20) -> y: no input of 2 or 16 samples runs it."""
    nodes = [h.make_node("Identity", ["x"], ["a"]), h.make_node("Conv", ["a", "w"], ["y"])]
    path = tmp_path / "audio.onnx"
    w = np.random.default_rng(0).standard_normal((4, 1, 20)).astype(np.float32)
    onnx.save(make_model(nodes, [("x", ["N", 1, "samples"], FLOAT)], ["y"], {"w": w}), str(path))
    return path


def test_signature_shapes_size_the_safety_nets_inputs(cli: CliRunner, audio: Path) -> None:
    """Before: the net gave every dynamic axis optimize.verify_batch (2 samples, which the convolution refuses)
    whatever --set signature.shapes said, which `kiln build FILE` honours."""
    shapes = "signature.shapes={samples: [400, 800]}"
    wrote, checked = _optimize(cli, audio, "--passes", "eliminate_identity", "--set", shapes)
    assert wrote.endswith(": 2 -> 1 nodes")
    assert checked == "verified: outputs match the input model's on random inputs (1 check)"


def test_the_fix_names_signature_shapes_and_no_int_high(cli: CliRunner, audio: Path) -> None:
    """Before: the fix began with optimize.int_high (the model has no integer input) and never named
    signature.shapes."""
    refused = cli.invoke(main, ["optimize", str(audio), "-o", str(audio.with_name("out.onnx"))])
    assert refused.exit_code == 2, refused.output
    assert "fix: give the sizes the model takes on axis 'samples': --set 'signature.shapes=" in refused.output
    assert "int_high" not in refused.output
