"""kiln.models.model_io.random_axis_size: an axis a file leaves dynamic without a name needs sizes as a named one
does, and inputs without a common batch axis are refused for that first."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.core.errors import ConfigError, KilnError
from kiln.core.records import TensorSpec
from kiln.core.signature import Signature
from kiln.models.model_io import random_axis_size

PATH = Path("dyn.onnx")


def test_an_unnamed_dynamic_axis_needs_sizes() -> None:
    """``z [N, ?, 8]``: io_specs gives the unnamed axis as 0; random inputs have nothing to size it by."""
    z = TensorSpec(name="z", shape=["N", 0, 8], dtype="float32")
    with pytest.raises(ConfigError) as err:
        random_axis_size(PATH, [z], Signature())
    assert "z axis 1 (unnamed)" in err.value.message and "{z: {1: seq}}" in err.value.hint


def test_an_unnamed_axis_named_in_the_signature_is_sized_by_its_name() -> None:
    z = TensorSpec(name="z", shape=["N", 0, 8], dtype="float32")
    with pytest.raises(ConfigError) as err:
        random_axis_size(PATH, [z], Signature(dynamic_axes={"z": {1: "zlen"}}))
    assert "'zlen'" in err.value.message and "unnamed" not in err.value.message
    assert random_axis_size(PATH, [z], Signature(dynamic_axes={"z": {1: "zlen"}}, shapes={"zlen": [3, 6]})) == 6


def test_a_graph_without_a_batch_axis_is_refused_for_that_first() -> None:
    """A paper-layout GNN: ``x [nodes, 16]`` beside ``edge_index [2, edges]``; sizes for ``edges`` would not help."""
    x = TensorSpec(name="x", shape=["nodes", 16], dtype="float32")
    edges = TensorSpec(name="edge_index", shape=[2, "edges"], dtype="int64")
    with pytest.raises(KilnError) as err:
        random_axis_size(PATH, [x, edges], Signature())
    assert "axis 0" in err.value.message and "no data to size them" not in err.value.message
