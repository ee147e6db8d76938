"""The graph check for random draws at inference (:func:`kiln.core.onnx_io.random_nodes`): a VAE's sampling and an
MC-dropout head are found as both of torch's exporters write them, with the outputs their draws reach; a dropout that
follows the mode, a Dropout without training_mode, and a draw that no output reads are not."""

from __future__ import annotations

import warnings
from pathlib import Path

import onnx
import pytest
import torch
from onnx import TensorProto, helper

from kiln.core.errors import ModelError
from kiln.core.onnx_io import random_nodes, refuse_random_graph
from tests.models.random_models import export_torchscript, sampling


def _exported(how: str, dynamo: bool, tmp: Path) -> onnx.ModelProto:
    """The model in eval mode as ``torch.onnx.export`` writes it, the dynamo exporter or the TorchScript one."""
    model = sampling(how, 1.0 if how == "randn" else 0.01).eval()
    if not dynamo:
        return onnx.load(export_torchscript(model, tmp / "m.onnx"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.onnx.export(model, (torch.rand(2, 6),), dynamo=True, output_names=["image"]).model_proto


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
@pytest.mark.parametrize(("how", "op"), [("randn", "RandomNormalLike"), ("dropout", "Dropout")])
def test_sampling_and_mc_dropout_are_found_as_either_exporter_writes_them(
    tmp_path: Path, how: str, op: str, dynamo: bool
) -> None:
    graph = _exported(how, dynamo, tmp_path)
    assert [(n.op_type, outputs) for n, outputs in random_nodes(graph)] == [(op, ["image"])]
    with pytest.raises(ModelError, match=rf"m\.onnx draws random numbers at inference \({op}.* feeds output 'image'"):
        refuse_random_graph(graph, "m.onnx")


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_a_dropout_that_follows_the_mode_or_a_vae_that_returns_mu_draws_nothing(tmp_path: Path, dynamo: bool) -> None:
    assert random_nodes(_exported("mode", dynamo, tmp_path)) == []
    assert random_nodes(_exported("mean", dynamo, tmp_path)) == []


def _graph(nodes: list[onnx.NodeProto], inits: list[onnx.TensorProto] = ()) -> onnx.ModelProto:  # type: ignore[assignment]
    value = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])]
    out = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])]
    return helper.make_model(helper.make_graph(nodes, "g", value, out, list(inits)))


@pytest.mark.parametrize(
    ("mode", "ratio", "draws"), [(None, 0.5, False), (False, 0.5, False), (True, 0.0, False), (True, 0.5, True)]
)
def test_a_dropout_draws_only_in_training_mode_at_a_ratio_above_0(mode: bool | None, ratio: float, draws: bool) -> None:
    inits = [helper.make_tensor("ratio", TensorProto.FLOAT, [], [ratio])]
    inputs = ["x", "ratio"]
    if mode is not None:
        inits.append(helper.make_tensor("mode", TensorProto.BOOL, [], [mode]))
        inputs.append("mode")
    graph = _graph([helper.make_node("Dropout", inputs, ["y"], name="drop")], inits)
    assert [n.name for n, _ in random_nodes(graph)] == (["drop"] if draws else [])


def test_a_draw_no_output_reads_is_not_refused_and_one_in_a_branch_names_the_if() -> None:
    dead = _graph(
        [
            helper.make_node("RandomNormalLike", ["x"], ["noise"], name="unread"),
            helper.make_node("Relu", ["x"], ["y"]),
        ]
    )
    assert [(n.name, outputs) for n, outputs in random_nodes(dead)] == [("unread", [])]
    refuse_random_graph(dead, "m.onnx")  # its draws change no output

    branch = helper.make_graph(
        [helper.make_node("RandomUniformLike", ["x"], ["drawn"], name="inner")],
        "then",
        [],
        [helper.make_tensor_value_info("drawn", TensorProto.FLOAT, ["batch", 4])],
    )
    cond = helper.make_tensor("cond", TensorProto.BOOL, [], [True])
    graph = _graph([helper.make_node("If", ["cond"], ["y"], then_branch=branch, else_branch=branch)], [cond])
    assert [(n.name, outputs) for n, outputs in random_nodes(graph)] == [("inner", ["y"]), ("inner", ["y"])]
    with pytest.raises(ModelError, match="RandomUniformLike 'inner' feeds output 'y'"):
        refuse_random_graph(graph, "m.onnx")
