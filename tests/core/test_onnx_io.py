"""kiln.core.onnx_io: save_onnx replaces a model's own external data, never anyone else's; index_ranges; inputs and
outputs that are not tensors."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.core.errors import InputFileError, ModelError
from kiln.core.onnx_io import check_tensor_io, index_ranges, load_onnx, outside_index, save_onnx


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


def test_external_weights_asked_for_a_model_of_small_tensors_leave_no_empty_data_file(tmp_path: Path) -> None:
    """Every tensor under the external threshold stays inline: no ``.data`` file of 0 bytes beside the model."""
    small = helper.make_model(
        helper.make_graph(
            [helper.make_node("Add", ["x", "b"], ["y"])],
            "g",
            [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 4])],
            [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4])],
            [numpy_helper.from_array(np.ones(4, np.float32), "b")],
        )
    )
    path = tmp_path / "m.onnx"
    save_onnx(small, path, external=True)
    assert not (tmp_path / "m.onnx.data").exists()
    assert float(numpy_helper.to_array(load_onnx(path).graph.initializer[0]).max()) == 1.0


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
    small (uint8) -> Cast to int64 -> Gather; pos -> Add of 1 -> Gather (-1 to 8: row pos + 1); hashed -> Cast to
    int8 -> Gather (values wrapped on the way: no range); x (float) and flat (a 1-D table) have none."""
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
    assert index_ranges(_indexing_graph()) == {"ids": [0, 9], "kind": [0, 1], "pos": [-1, 8], "small": [0, 9]}


def test_an_index_past_a_table_is_named_with_its_input_and_range() -> None:
    """The sentence servers refuse a request with, before ONNX Runtime's Gather traceback; indices counted from the
    end down to -rows run in ONNX Runtime and pass, as the engines' own ranges take them."""
    graph, ids = _indexing_graph(), np.array([3, 9], np.int64)
    assert outside_index(graph, {"ids": ids, "kind": np.array([0, 1])}, "m.onnx") is None
    assert outside_index(graph, {"ids": np.array([-10, 9])}, "m.onnx") is None
    assert outside_index(graph, {"ids": ids + 5}, "m.onnx") == (
        "input 'ids' holds 14: m.onnx indexes an axis of 10 positions with it (values 0 to 9, or down to -10 counted "
        "from its end)"
    )
    assert "input 'kind' holds -3:" in outside_index(graph, {"ids": ids, "kind": np.array([-3, 1])}, "m.onnx")


def test_indices_checked_for_an_engine_built_without_the_data_start_at_0() -> None:
    """`kiln build` of a variant records 0 to rows - 1 and refuses a negative id: calibration data checked for it
    took ids counted from the end, and the error offered them."""
    graph = _indexing_graph()
    assert outside_index(graph, {"ids": np.array([0, 9])}, "m.onnx", counted_from_end=False) is None
    assert outside_index(graph, {"ids": np.array([-1, 9])}, "m.onnx", counted_from_end=False) == (
        "input 'ids' holds -1: m.onnx takes values from 0 to 9 (the positions of the axis it indexes: a table's rows, "
        "a graph's nodes)"
    )
    past = outside_index(graph, {"ids": np.array([3, 10])}, "m.onnx", counted_from_end=False) or ""
    assert "holds 10" in past and "from its end" not in past


def zipmap_classifier(path: Path) -> Path:
    """x [N, 6] -> a 3-class linear classifier -> label [N] and probs, a ZipMap: a sequence of {class: probability}
    maps, as skl2onnx exports a scikit-learn classifier by default."""
    ml = "ai.onnx.ml"
    coefficients = np.linspace(-1, 1, 18, dtype=np.float32).tolist()
    nodes = [
        helper.make_node(
            "LinearClassifier",
            ["x"],
            ["label", "prob"],
            domain=ml,
            classlabels_ints=[0, 1, 2],
            coefficients=coefficients,
            intercepts=[0.1, 0.2, 0.3],
            multi_class=1,
            post_transform="SOFTMAX",
        ),
        helper.make_node("ZipMap", ["prob"], ["probs"], domain=ml, classlabels_int64s=[0, 1, 2]),
    ]
    maps = helper.make_map_type_proto(onnx.TensorProto.INT64, helper.make_tensor_type_proto(onnx.TensorProto.FLOAT, []))
    graph = helper.make_graph(
        nodes,
        "classifier",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 6])],
        [
            helper.make_tensor_value_info("label", onnx.TensorProto.INT64, ["N"]),
            helper.make_value_info("probs", helper.make_sequence_type_proto(maps)),
        ],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(ml, 3)]
    onnx.save(helper.make_model(graph, opset_imports=opsets, ir_version=8), path)
    return path


ZIPMAP_SAID = "output 'probs' is a sequence of type seq(map(int64,tensor(float))), not a tensor"


def _one_node(op: str, inp: onnx.ValueInfoProto, out: onnx.ValueInfoProto) -> onnx.ModelProto:
    return helper.make_model(helper.make_graph([helper.make_node(op, [inp.name], [out.name])], "g", [inp], [out]))


def test_inputs_and_outputs_that_are_not_tensors_are_named_with_their_type(tmp_path: Path) -> None:
    """A sequence, map or optional input or output is one ModelError naming it and its type; the optimizer alone
    takes outputs that are sequences of tensors."""
    with pytest.raises(ModelError, match=re.escape(f"m.onnx: {ZIPMAP_SAID}")) as err:
        check_tensor_io(load_onnx(zipmap_classifier(tmp_path / "m.onnx")), "m.onnx", sequence_outputs=True)
    assert "options={'zipmap': False}" in (err.value.hint or "")
    tensor = helper.make_tensor_value_info("t", onnx.TensorProto.FLOAT, [2])
    seq = helper.make_tensor_sequence_value_info("s", onnx.TensorProto.FLOAT, None)
    with pytest.raises(ModelError, match=re.escape("input 's' is a sequence of type seq(tensor(float))")) as err:
        check_tensor_io(_one_node("ConcatFromSequence", seq, tensor), "g", sequence_outputs=True)
    assert "tensor inputs only" in (err.value.hint or "")
    to_seq = _one_node("SequenceConstruct", tensor, seq)
    check_tensor_io(to_seq, "g", sequence_outputs=True)
    with pytest.raises(ModelError, match="output 's' is a sequence") as err:
        check_tensor_io(to_seq, "g")
    assert "tensor outputs only, or drop output 's'" in (err.value.hint or "")
    optional = helper.make_value_info("o", helper.make_optional_type_proto(tensor.type))
    with pytest.raises(ModelError, match=re.escape("output 'o' is an optional of type optional(tensor(float))")):
        check_tensor_io(_one_node("Optional", tensor, optional), "g", sequence_outputs=True)
    check_tensor_io(_indexing_graph(), "g")


def test_every_command_that_takes_an_onnx_file_refuses_a_zipmap_output_by_name(tmp_path: Path) -> None:
    """`kiln run` from such a file ended in an AttributeError in the accuracy check (the output is a list of
    dicts), `kiln build` made an engine nothing could validate, and `kiln optimize` wrote a graph whose map type
    its rewrites lose: each is now one error naming the output, its type and the fix."""
    from tests.pipeline.test_faults import assert_clean, invoke, tiny_onnx

    model = zipmap_classifier(tmp_path / "clf.onnx")
    config = tmp_path / "c.yaml"
    config.write_text("model: {onnx: clf.onnx}\nprecision: {variants: [fp32]}\nbuild: {backends: [onnxruntime]}\n")
    assert_clean(invoke("run", config, "-w", tmp_path / "w"), 2, f"model.onnx clf.onnx: {ZIPMAP_SAID}", "zipmap")
    for command in (("build", model, "-o", tmp_path / "e"), ("precision", model, "-o", tmp_path / "v")):
        assert_clean(invoke(*command), 2, f"clf.onnx: {ZIPMAP_SAID}", "zipmap")
    assert_clean(invoke("optimize", model, "-o", tmp_path / "o.onnx"), 2, f"clf.onnx: {ZIPMAP_SAID}", "zipmap")
    assert not (tmp_path / "e").exists() and not (tmp_path / "o.onnx").exists()
    engine = tmp_path / "tiny"
    assert invoke("build", tiny_onnx(tmp_path / "tiny.onnx"), "-o", engine).exit_code == 0
    assert_clean(invoke("validate", engine, "--reference", model), 2, f"reference clf.onnx: {ZIPMAP_SAID}")


def gnn_onnx(path: Path, nodes: int | str = "nodes", edges: int | str = "edges") -> Path:
    """A GCN layer in a graph neural network's own layout, no batch axis: x [nodes, 4], edge_index [2, edges] ->
    x[src] summed into dst (Gather, ScatterElements with add) -> y [nodes, 4]."""
    const = [
        helper.make_node("Constant", [], [n], value=numpy_helper.from_array(np.array(v, np.int64), n))
        for n, v in (("zero", 0), ("one", 1), ("last", [-1]), ("wide", [1, 4]))
    ]
    nodes_ = [
        *const,
        helper.make_node("Gather", ["edge_index", "zero"], ["src"], axis=0),
        helper.make_node("Gather", ["edge_index", "one"], ["dst"], axis=0),
        helper.make_node("Gather", ["x", "src"], ["msg"], axis=0),
        helper.make_node("Unsqueeze", ["dst", "last"], ["dst1"]),
        helper.make_node("Expand", ["dst1", "wide"], ["dst2"]),
        helper.make_node("ScatterElements", ["x", "dst2", "msg"], ["y"], axis=0, reduction="add"),
    ]
    graph = helper.make_graph(
        nodes_,
        "gcn",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [nodes, 4]),
            helper.make_tensor_value_info("edge_index", TensorProto.INT64, [2, edges]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [nodes, 4])],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
    return path


NO_BATCH_SAID = (
    "input 'edge_index' [2, edges] has a fixed axis 0 (2) while axis 0 of input 'x' [nodes, 4] is dynamic: Kiln "
    "takes axis 0 of every input as the batch"
)


def test_every_command_that_takes_an_onnx_file_refuses_inputs_without_a_common_batch_axis(tmp_path: Path) -> None:
    """A GNN in its own layout: `kiln run` (with optimize.int_high) and `kiln precision` ended in ONNX Runtime's
    traceback (edge_index's static 2 sliced and repeated as a batch), `kiln build` made an engine nothing could
    validate. Each is now one error naming the input and its shape, the fix the batch-of-one recipe; `kiln optimize`,
    which batches nothing, still takes the file."""
    from tests.pipeline.test_faults import assert_clean, invoke

    model = gnn_onnx(tmp_path / "gcn.onnx")
    shapes = "signature.shapes={edges: [6]}"
    config = tmp_path / "c.yaml"
    config.write_text(
        "model: {onnx: gcn.onnx}\nprecision: {variants: [fp32, int8]}\nsignature: {batch_sizes: [1, 8]}\n"
        "optimize: {int_high: 1}\nbuild: {backends: [onnxruntime]}\n"
    )
    recipe = "edge_index [1, 2, edges]"
    assert_clean(invoke("run", config, "-w", tmp_path / "w", "--set", shapes), 2, NO_BATCH_SAID, recipe)
    for command in (
        ("precision", model, "-o", tmp_path / "v", "--variants", "int8", "--set", shapes),
        ("build", model, "-o", tmp_path / "e", "--backend", "onnxruntime", "--set", shapes),
    ):
        assert_clean(invoke(*command), 2, f"gcn.onnx: {NO_BATCH_SAID}", recipe)
    # the optimizer slices nothing by batch: it rewrites such a graph, as it does a time-major RNN's
    optimized = invoke("optimize", model, "-o", tmp_path / "o.onnx", "--set", shapes, "--set", "optimize.int_high=1")
    assert optimized.exit_code == 0, optimized.output
    static = gnn_onnx(tmp_path / "static.onnx", 12, 6)
    said = "the inputs fix axis 0 at different sizes ('x' [12, 4], 'edge_index' [2, 6])"
    assert_clean(invoke("precision", static, "-o", tmp_path / "v2", "--variants", "int8"), 2, said, recipe[:13])
