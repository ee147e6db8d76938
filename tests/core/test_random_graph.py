"""The graph check for random draws at inference (:func:`kiln.core.onnx_io.random_nodes`): a VAE's sampling and an
MC-dropout head are found as both of torch's exporters write them, with the outputs their draws reach; a dropout that
follows the mode, a Dropout without training_mode, and a draw that no output reads (dead in a branch, feeding only an
If's output that nothing reads, or read only for its shape) are not."""

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


def test_a_draw_no_output_reads_is_not_refused_and_one_in_a_shared_branch_is_named_once() -> None:
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
    assert [(n.name, outputs) for n, outputs in random_nodes(graph)] == [("inner", ["y"])]  # one branch, held twice
    with pytest.raises(ModelError, match="RandomUniformLike 'inner' feeds output 'y'"):
        refuse_random_graph(graph, "m.onnx")


_COND = helper.make_tensor_value_info("cond", TensorProto.BOOL, [])


def _branch(nodes: list[onnx.NodeProto], outputs: list[str]) -> onnx.GraphProto:
    return helper.make_graph(
        nodes, "branch", [], [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs]
    )


def _with_if(then: onnx.GraphProto, other: onnx.GraphProto, outputs: list[str]) -> onnx.ModelProto:
    """``y = If(cond, then, other)`` with ``outputs`` (``y`` first: the only graph output)."""
    graph = _graph([helper.make_node("If", ["cond"], outputs, then_branch=then, else_branch=other)])
    graph.graph.input.append(_COND)
    return graph


def test_a_draw_dead_in_a_branch_or_feeding_only_an_if_output_nothing_reads_is_not_refused() -> None:
    noise = helper.make_node("RandomNormalLike", ["x"], ["noise"], name="noise")
    dead = _with_if(
        _branch([noise, helper.make_node("Identity", ["x"], ["t"])], ["t"]),
        _branch([helper.make_node("Identity", ["x"], ["e"])], ["e"]),
        ["y"],
    )
    unread = _with_if(
        _branch([noise, helper.make_node("Identity", ["x"], ["t"])], ["t", "noise"]),
        _branch(
            [helper.make_node("Identity", ["x"], ["e1"]), helper.make_node("Identity", ["x"], ["e2"])], ["e1", "e2"]
        ),
        ["y", "debug"],
    )
    for graph in (dead, unread):
        assert [(n.name, outputs) for n, outputs in random_nodes(graph)] == [("noise", [])]
        refuse_random_graph(graph, "m.onnx")


@pytest.mark.parametrize("op", ["Shape", "Size"])
def test_a_draw_read_only_for_its_shape_is_not_refused(op: str) -> None:
    """``y = x * ones(shape(noise))`` or ``y = x * size(noise)``: the drawn values change nothing."""
    if op == "Shape":
        read = [helper.make_node("ConstantOfShape", ["n"], ["scale"], value=helper.make_tensor("v", 1, [1], [1.0]))]
    else:
        read = [helper.make_node("Cast", ["n"], ["scale"], to=TensorProto.FLOAT)]
    drawn = [
        helper.make_node("RandomNormalLike", ["x"], ["noise"], name="noise"),
        helper.make_node(op, ["noise"], ["n"]),
    ]
    graph = _graph([*drawn, *read, helper.make_node("Mul", ["x", "scale"], ["y"])])
    assert [(n.name, outputs) for n, outputs in random_nodes(graph)] == [("noise", [])]
    refuse_random_graph(graph, "m.onnx")


def test_a_dropout_whose_training_mode_is_an_input_says_so() -> None:
    graph = _graph(
        [helper.make_node("Dropout", ["x", "ratio", "tm"], ["y"], name="drop")],
        [helper.make_tensor("ratio", TensorProto.FLOAT, [], [0.5])],
    )
    graph.graph.input.append(helper.make_tensor_value_info("tm", TensorProto.BOOL, []))
    with pytest.raises(ModelError, match="Dropout 'drop' with training_mode given by input 'tm' feeds output 'y'"):
        refuse_random_graph(graph, "m.onnx")
