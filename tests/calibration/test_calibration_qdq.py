"""INT8 Q/DQ graphs: where Q/DQ pairs go, per-channel symmetric weights, symmetric activations, exclusions."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from kiln.calibration.config import CalibrationConfig
from kiln.calibration.quantize import quantize_int8
from kiln.calibration.ranges import calibrate
from kiln.stages.precision.compare import output_metrics, run_batched
from tests.calibration.calib_graphs import batches, saved


def _quantize(tmp: Path, cfg: CalibrationConfig, method: str = "minmax") -> onnx.ModelProto:
    path = saved(tmp)
    ranges = calibrate(path, batches(), "input", method, cache_dir=tmp / "cache", percentile=cfg.percentile)
    quantize_int8(path, tmp / "int8.onnx", ranges, cfg)
    return onnx.load(tmp / "int8.onnx")


def _dq_feeding(model: onnx.ModelProto, node: str) -> list[onnx.NodeProto]:
    producers = {o: n for n in model.graph.node for o in n.output}
    target = next(n for n in model.graph.node if n.name == node)
    return [producers[i] for i in target.input if i in producers and producers[i].op_type == "DequantizeLinear"]


def test_weights_per_channel_symmetric_and_activations_symmetric(tmp_path: Path) -> None:
    q = _quantize(tmp_path, CalibrationConfig())
    inits = {i.name: numpy_helper.to_array(i) for i in q.graph.initializer}
    conv_dq = _dq_feeding(q, "conv")
    assert len(conv_dq) == 2  # activation and weight
    act, weight = sorted(conv_dq, key=lambda n: n.input[0] in inits)
    # weight: INT8 initializer, one scale per output channel along axis 0, zero points 0
    assert inits[weight.input[0]].dtype == np.int8
    assert inits[weight.input[1]].shape == (8,)
    assert {a.name: a.i for a in weight.attribute}.get("axis", 1) == 0
    assert not inits[weight.input[2]].any()
    # activation: a per-tensor scale, INT8, zero point 0 (symmetric: what TensorRT requires)
    assert inits[act.input[1]].shape == ()
    assert inits[act.input[2]].dtype == np.int8 and inits[act.input[2]] == 0
    # MatMul weights [K, N] are per output column (axis 1); Gemm(transB) weights [N, K] per row (axis 0)
    mm_w = next(n for n in _dq_feeding(q, "matmul") if n.input[0] in inits)
    assert inits[mm_w.input[1]].shape == (16,) and {a.name: a.i for a in mm_w.attribute}["axis"] == 1
    head_w = next(n for n in _dq_feeding(q, "head") if n.input[0] == "gw_quantized")
    assert inits[head_w.input[1]].shape == (10,)
    # the bias stays float (TensorRT's parser rejects INT32 bias Q/DQ)
    head = next(n for n in q.graph.node if n.name == "head")
    assert head.input[2] == "gb"


def test_every_quantized_activation_has_a_qdq_pair(tmp_path: Path) -> None:
    q = _quantize(tmp_path, CalibrationConfig())
    producers = {o: n for n in q.graph.node for o in n.output}
    for dq in (n for n in q.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in producers):
        assert producers[dq.input[0]].op_type == "QuantizeLinear"


def test_exclusions_first_last_and_op_types(tmp_path: Path) -> None:
    q = _quantize(tmp_path, CalibrationConfig(exclude_first_last=True, exclude_op_types=["MatMul"]))
    nodes = {n.name: n for n in q.graph.node}
    # excluded nodes read their float weights directly (an activation Q/DQ made by a neighbour may remain)
    assert nodes["conv"].input[1] == "cw" and nodes["matmul"].input[1] == "mw" and nodes["head"].input[1] == "gw"
    assert _dq_feeding(q, "conv") == []  # first layer: its input stays float too
    assert not any(i.name.endswith("_quantized") for i in q.graph.initializer)


@pytest.mark.parametrize("method", ["minmax", "entropy", "percentile"])
def test_methods_produce_accurate_runnable_graphs(tmp_path: Path, method: str) -> None:
    q = _quantize(tmp_path, CalibrationConfig(method=method), method)
    x = np.concatenate(batches(2, seed=1))
    ref, got = run_batched(saved(tmp_path), x)[0], run_batched(q, x)[0]
    m = output_metrics(ref, got)
    assert m["cosine"] > 0.98 and m["top1_agreement"] >= 0.85, m


def shared_bias_model() -> onnx.ModelProto:
    """Two convolutions reading one bias `b`, and a value named `b0`: the name ORT's quantizer gives its copy."""
    from onnx import TensorProto, helper

    rng = np.random.default_rng(0)
    w = lambda *s: numpy_helper.from_array((rng.standard_normal(s) * 0.3).astype(np.float32))  # noqa: E731
    inits = [w(4, 1, 3, 3), w(4, 4, 3, 3), numpy_helper.from_array(np.zeros(4, np.float32))]
    for t, name in zip(inits, ("w1", "w2", "b")):
        t.name = name
    nodes = [
        helper.make_node("Conv", ["input", "w1", "b"], ["c"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["b0"], name="relu"),
        helper.make_node("Conv", ["b0", "w2", "b"], ["y"], name="conv2", pads=[1, 1, 1, 1]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["n", 1, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4, 8, 8])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    return model


def test_a_shared_bias_gets_a_copy_per_reader_before_ort_names_one(tmp_path: Path) -> None:
    """Before: ORT's quantizer named its copy of `b` `b0`, the Relu's output, and the INT8 graph did not load."""
    import onnxruntime as ort

    onnx.save(shared_bias_model(), tmp_path / "m.onnx")
    ranges = calibrate(tmp_path / "m.onnx", batches(), "input", "minmax", cache_dir=tmp_path / "cache")
    quantize_int8(tmp_path / "m.onnx", tmp_path / "int8.onnx", ranges, CalibrationConfig(op_types=["Conv"]))
    session = ort.InferenceSession(str(tmp_path / "int8.onnx"), providers=["CPUExecutionProvider"])
    x = batches()[0]
    ref = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"]).run(None, {"input": x})
    got = session.run(None, {"input": x})
    assert np.abs(got[0] - ref[0]).max() < 0.1 * np.abs(ref[0]).max()


def test_the_last_layers_are_those_before_each_output_through_activations_not_a_residual_sum() -> None:
    """A detector's heads (a heatmap through a sigmoid, a box head through a bias Add) each keep their own last
    layer; a residual sum reaching an output does not make every layer before it a last one."""
    from onnx import TensorProto, helper

    from kiln.calibration.quantize import excluded_nodes, first_last_compute

    w = numpy_helper.from_array(np.ones((4, 4), np.float32), "w")
    b = numpy_helper.from_array(np.ones(4, np.float32), "b")
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h1"], name="stem"),
        helper.make_node("MatMul", ["h1", "w"], ["h2"], name="block"),
        helper.make_node("Add", ["h1", "h2"], ["res"], name="residual"),  # two computed inputs: not followed
        helper.make_node("MatMul", ["res", "w"], ["hm_logits"], name="heatmap_head"),
        helper.make_node("Sigmoid", ["hm_logits"], ["heatmap"], name="sig"),
        helper.make_node("MatMul", ["res", "w"], ["wh_raw"], name="box_head"),
        helper.make_node("Add", ["wh_raw", "b"], ["wh"], name="bias"),
        helper.make_node("Identity", ["res"], ["features"], name="features"),
    ]
    io = lambda name: helper.make_tensor_value_info(name, TensorProto.FLOAT, [1, 4])  # noqa: E731
    graph = helper.make_graph(nodes, "heads", [io("x")], [io("heatmap"), io("wh"), io("features")], [w, b])
    model = helper.make_model(graph)
    assert first_last_compute(model) == ["box_head", "heatmap_head", "stem"]
    # by default (keep_output_layers: auto) only the layer whose output is squashed into scores stays float
    assert excluded_nodes(model, CalibrationConfig()) == ["heatmap_head"]
    assert excluded_nodes(model, CalibrationConfig(keep_output_layers="on")) == ["box_head", "heatmap_head"]
    assert excluded_nodes(model, CalibrationConfig(keep_output_layers="off")) == []


def test_auto_keeps_only_sigmoid_heads_and_first_last_keeps_the_graphs_last_layer_behind_a_concat() -> None:
    """A softmax's scores are read by their argmax, which top-1 agreement gates: kept only with `on`. Heads joined by
    a Concat (a YOLO's) have no last layer before the output through activations: exclude_first_last still keeps
    the graph's last."""
    from onnx import TensorProto, helper

    from kiln.calibration.quantize import excluded_nodes, first_last_compute

    w = numpy_helper.from_array(np.ones((4, 4), np.float32), "w")
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="stem"),
        helper.make_node("MatMul", ["h", "w"], ["a"], name="head_a"),
        helper.make_node("MatMul", ["h", "w"], ["b"], name="head_b"),
        helper.make_node("Concat", ["a", "b"], ["boxes"], axis=1),
        helper.make_node("MatMul", ["h", "w"], ["c"], name="classes"),
        helper.make_node("Softmax", ["c"], ["probs"], axis=1),
    ]
    io = lambda name, width: helper.make_tensor_value_info(name, TensorProto.FLOAT, [1, width])  # noqa: E731
    graph = helper.make_graph(nodes, "heads", [io("x", 4)], [io("boxes", 8), io("probs", 4)], [w])
    model = helper.make_model(graph)
    assert excluded_nodes(model, CalibrationConfig()) == []
    assert excluded_nodes(model, CalibrationConfig(keep_output_layers="on")) == ["classes"]
    assert first_last_compute(model) == ["classes", "stem"]  # the graph's last layer, as before


def test_a_box_head_scaled_by_a_dynamic_image_size_read_with_shape_is_still_the_last_layer() -> None:
    """``sigmoid(box_head(f)) * [W, H, W, H]`` with W and H read from the image's shape (dynamic height and width):
    the multiplier is computed from sizes only, so the walk goes through the Mul as through a constant scale."""
    from onnx import TensorProto, helper

    from kiln.calibration.quantize import excluded_nodes, last_compute

    w = numpy_helper.from_array(np.ones((3, 4), np.float32), "w")
    idx = [numpy_helper.from_array(np.array(k, np.int64), f"i{k}") for k in (2, 3)]
    axes = numpy_helper.from_array(np.array([0], np.int64), "axes")
    nodes = [
        helper.make_node("GlobalAveragePool", ["image"], ["pooled"]),
        helper.make_node("Flatten", ["pooled"], ["f"]),
        helper.make_node("Gemm", ["f", "w"], ["raw"], name="box_head"),
        helper.make_node("Sigmoid", ["raw"], ["unit"]),
        helper.make_node("Shape", ["image"], ["shape"]),
        helper.make_node("Gather", ["shape", "i2"], ["h"], axis=0),
        helper.make_node("Gather", ["shape", "i3"], ["w_px"], axis=0),
        helper.make_node("Unsqueeze", ["h", "axes"], ["h1"]),
        helper.make_node("Unsqueeze", ["w_px", "axes"], ["w1"]),
        helper.make_node("Concat", ["w1", "h1", "w1", "h1"], ["whwh"], axis=0),
        helper.make_node("Cast", ["whwh"], ["scale"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["unit", "scale"], ["bbox"], name="to_pixels"),
    ]
    image = helper.make_tensor_value_info("image", TensorProto.FLOAT, [1, 3, "height", "width"])
    bbox = helper.make_tensor_value_info("bbox", TensorProto.FLOAT, [1, 4])
    model = helper.make_model(helper.make_graph(nodes, "boxes", [image], [bbox], [w, *idx, axes]))
    assert last_compute(model, scores_only=True) == {"box_head"}
    assert excluded_nodes(model, CalibrationConfig()) == ["box_head"]
