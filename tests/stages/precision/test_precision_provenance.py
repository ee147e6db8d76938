"""Reading the PyTorch module of an ONNX node from the metadata torch.onnx.export(dynamo=True) writes."""

from __future__ import annotations

import onnx
from onnx import helper

from kiln.stages.precision.provenance import node_module


def node(**meta: str) -> onnx.NodeProto:
    n = helper.make_node("Conv", ["x", "w"], ["y"], name="node_conv2d_1")
    for key, value in meta.items():
        entry = n.metadata_props.add()
        entry.key, entry.value = key.replace("__", "."), value
    return n


def test_module_from_name_scopes_and_class_hierarchy() -> None:
    n = node(
        pkg__torch__onnx__name_scopes="['', 'features', 'features.1', 'features.1.0', 'conv2d_1']",
        pkg__torch__onnx__class_hierarchy="['m.SmallCNN', 'torch.nn.modules.container.Sequential', "
        "'torch.nn.modules.container.Sequential', "
        "'torch.nn.modules.conv.Conv2d', 'aten.conv2d.default']",
    )
    assert node_module(n) == "features.1.0 (Conv2d)"


def test_module_from_the_namespace_string() -> None:
    n = node(namespace=": m.SmallCNN/head: torch.nn.modules.linear.Linear/linear: aten.linear.default")
    assert node_module(n) == "head (Linear)"
    assert node_module(node(namespace=": m.SmallCNN/view: aten.view.default")) == "(root) (SmallCNN)"


def test_no_module_without_metadata_or_for_fx_added_nodes() -> None:
    assert node_module(node()) is None
    added = node(
        pkg__torch__onnx__name_scopes="['_empty_nn_module_stack_from_metadata_hook', 'sym_size_int_3']",
        pkg__torch__onnx__class_hierarchy="['_empty_nn_module_stack_from_metadata_hook', 'aten.sym_size.int']",
    )
    assert node_module(added) is None
