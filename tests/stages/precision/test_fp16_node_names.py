"""``precision.fp16.fp32_nodes`` names are checked against the graph, as ``calibration.exclude_nodes`` are."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper

from kiln.cli import main
from kiln.core.errors import ConfigError
from kiln.stages.precision.config import FP16Config
from kiln.stages.precision.fp16_select import check_fp32_nodes
from tests.stages.precision.precision_graphs import chain_graph, inputs


def _graph() -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])
    nodes = [
        helper.make_node("Relu", ["x"], ["h"], name="node_relu"),
        helper.make_node("Neg", ["h"], ["y"], name="node_neg"),
    ]
    return helper.make_model(helper.make_graph(nodes, "g", [x], [y]))


def test_a_name_the_graph_lacks_is_an_error_with_the_closest_names() -> None:
    with pytest.raises(ConfigError) as err:
        check_fp32_nodes(_graph(), FP16Config(fp32_nodes=["node_relu", "node_rleu"]))
    assert "fp32_nodes names node 'node_rleu'" in err.value.message and "node_relu" in err.value.hint
    assert "'node_relu'," not in err.value.message  # a name the graph has is not blamed


def test_names_the_graph_has_pass() -> None:
    check_fp32_nodes(_graph(), FP16Config(fp32_nodes=["node_neg"]))


def test_kiln_precision_refuses_a_wrong_fp32_node_name(tmp_path: Path) -> None:
    """The check runs where the variants are made: `kiln precision --variants fp16` exits 2 naming the typo."""
    model, feed = tmp_path / "m.onnx", tmp_path / "d.npz"
    onnx.save(chain_graph(), model)
    np.savez(feed, input=inputs(64))
    args = ["precision", str(model), "-o", str(tmp_path / "v"), "--variants", "fp16", "--calibration", str(feed)]
    result = CliRunner().invoke(main, [*args, "--set", "precision.fp16.fp32_nodes=[node_bogus]"])
    assert result.exit_code == 2, result.output
    assert "fp32_nodes names node 'node_bogus', which the graph does not have" in result.output
