"""kiln.core.onnx_io: save_onnx replaces a model's own external data, never anyone else's; index_ranges."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from kiln.core.errors import InputFileError
from kiln.core.onnx_io import index_ranges, load_onnx, save_onnx


def _model(value: float) -> onnx.ModelProto:
    w = numpy_helper.from_array(np.full((64, 64), value, np.float32), "w")
    node = helper.make_node("MatMul", ["x", "w"], ["y"])
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 64])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 64])],
        [w],
    )
    return helper.make_model(graph)


def test_a_models_own_data_file_is_replaced_with_it(tmp_path: Path) -> None:
    path = tmp_path / "m.onnx"
    save_onnx(_model(1.0), path, external=True)
    save_onnx(_model(2.0), path, external=True)  # onnx would append to the old file; it is replaced instead
    assert float(numpy_helper.to_array(load_onnx(path).graph.initializer[0]).max()) == 2.0
    save_onnx(_model(3.0), path)  # now inline: the old data file is dead weight and goes
    assert not (tmp_path / "m.onnx.data").exists()


def test_a_data_file_someone_else_owns_is_never_touched(tmp_path: Path) -> None:
    path, data = tmp_path / "m.onnx", tmp_path / "m.onnx.data"
    data.write_bytes(b"the user's own file")
    save_onnx(_model(1.0), path)  # inline: no need for that name, so it stays as it was
    assert data.read_bytes() == b"the user's own file"
    with pytest.raises(InputFileError, match="does not overwrite files it did not write"):
        save_onnx(_model(1.0), path, external=True)
    assert data.read_bytes() == b"the user's own file"


def test_external_data_is_written_beside_the_model_whatever_the_current_folder_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``m.onnx.data`` where the user stands (the export ``kiln optimize`` reads) is not the one ``-o out/m.onnx``
    writes; the weights file is readable as the graph file is (0666 less the umask), for a server of another user."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m.onnx.data").write_bytes(b"the input's weights")
    path = tmp_path / "out" / "m.onnx"
    save_onnx(_model(2.0), path, external=True)
    assert float(numpy_helper.to_array(load_onnx(path).graph.initializer[0]).max()) == 2.0
    assert (tmp_path / "m.onnx.data").read_bytes() == b"the input's weights"
    data = path.with_name("m.onnx.data")
    assert data.stat().st_mode & 0o777 == path.stat().st_mode & 0o777


def test_a_session_of_a_graph_with_an_unused_big_weight() -> None:
    """A weight nothing reads (a quantizer's leftover, an extra output's pruned producer): ONNX Runtime drops it when
    it loads the graph, so it must not be handed over as an external initializer."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    from kiln.core.onnx_io import ort_session

    w = numpy_helper.from_array(np.ones((64, 64), np.float32), "w")
    unused = numpy_helper.from_array(np.ones((256, 256), np.float32), "unused")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])],
        [w, unused],
    )
    sess = ort_session(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    assert sess.run(None, {"x": np.ones((1, 64), np.float32)})[0][0, 0] == 64.0


def _indexing_graph() -> onnx.ModelProto:
    """ids -> Gather over a 10-row table; kind -> Unsqueeze -> Gather over a 2-row table (an FP16 table, cast);
    small (uint8) -> Cast to int64 -> Gather; pos -> Add -> Gather and hashed -> Cast to int8 -> Gather (values
    changed on the way: no range); x (float) and flat (a 1-D table) have none."""
    table = numpy_helper.from_array(np.zeros((10, 4), np.float32), "table")
    kinds = numpy_helper.from_array(np.zeros((2, 4), np.float16), "kinds")
    flat = numpy_helper.from_array(np.zeros(7, np.float32), "flat1d")
    one = numpy_helper.from_array(np.ones(1, np.int64), "one")
    axes = numpy_helper.from_array(np.array([0], np.int64), "axes")
    nodes = [
        helper.make_node("Gather", ["table", "ids"], ["e"]),
        helper.make_node("Unsqueeze", ["kind", "axes"], ["kind1"]),
        helper.make_node("Cast", ["kinds"], ["kinds32"], to=onnx.TensorProto.FLOAT),
        helper.make_node("Gather", ["kinds32", "kind1"], ["k"]),
        helper.make_node("Add", ["pos", "one"], ["pos1"]),
        helper.make_node("Gather", ["table", "pos1"], ["p"]),
        helper.make_node("Gather", ["flat1d", "flat"], ["f"]),
        helper.make_node("Cast", ["small"], ["small64"], to=onnx.TensorProto.INT64),
        helper.make_node("Gather", ["table", "small64"], ["s"]),
        helper.make_node("Cast", ["hashed"], ["hashed8"], to=onnx.TensorProto.INT8),
        helper.make_node("Gather", ["table", "hashed8"], ["h"]),
    ]
    ints = [helper.make_tensor_value_info(n, onnx.TensorProto.INT64, ["batch"]) for n in ("ids", "kind", "pos", "flat")]
    ints += [helper.make_tensor_value_info("small", onnx.TensorProto.UINT8, ["batch"])]
    ints += [helper.make_tensor_value_info("hashed", onnx.TensorProto.INT64, ["batch"])]
    graph = helper.make_graph(
        nodes,
        "g",
        [*ints, helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch"])],
        [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in ("e", "k", "p", "f", "s", "h")],
        [table, kinds, flat, one, axes],
    )
    return helper.make_model(graph)


def test_index_ranges_are_the_rows_of_the_embedding_tables_an_input_indexes() -> None:
    assert index_ranges(_indexing_graph()) == {"ids": [0, 9], "kind": [0, 1], "small": [0, 9]}
