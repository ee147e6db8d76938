"""Axis 0 declared in signature.dynamic_axes (a graph neural network's ``x [nodes, F]`` beside ``edge_index
[2, edges]``, with no batch axis) is refused with a fix that names the working recipe: each graph given as a batch of
one, through a wrapper, with the dynamic axes it would then declare."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kiln.core.signature import HintedValueError, Signature


def _hint(axes: dict[str, dict[int, str]]) -> str:
    with pytest.raises(ValidationError) as caught:
        Signature(dynamic_axes=axes)
    cause = caught.value.errors()[0]["ctx"]["error"]
    assert isinstance(cause, HintedValueError)
    return cause.hint


def test_axis_0_of_inputs_without_a_batch_names_the_batch_of_one_recipe() -> None:
    hint = _hint({"x": {0: "nodes"}, "edge_index": {1: "edges"}})
    assert "batch of one" in hint and "takes x[0], edge_index[0] and returns out.unsqueeze(0)" in hint
    assert "signature.batch_sizes: [1]" in hint
    assert "signature.dynamic_axes: {x: {1: nodes}, edge_index: {2: edges}}" in hint
    assert "model.onnx" in hint  # the two-tower way stays
