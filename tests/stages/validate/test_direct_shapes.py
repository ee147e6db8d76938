"""`kiln validate ENGINE --reference` at the sizes the user sets: every shape point of signature.shapes and each of
signature.batch_sizes, on random inputs or on --inputs resized to each point; recorded in its answer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tests.pipeline.test_faults import invoke


def _seq_graph(path: Path, past: int | None = None) -> Path:
    """x [batch, seq] -> x; with ``past``, x doubled at the positions from ``past`` on: the same graph at sequences
    up to ``past`` long, another past them."""
    nodes = [helper.make_node("Identity", ["x"], ["y"])]
    inits = []
    if past is not None:
        nodes = [
            helper.make_node("Shape", ["x"], ["shape"], start=1, end=2),
            helper.make_node("Squeeze", ["shape"], ["seq"]),
            helper.make_node("Range", ["zero", "seq", "one"], ["positions"]),
            helper.make_node("GreaterOrEqual", ["positions", "past"], ["late"]),
            helper.make_node("Cast", ["late"], ["extra"], to=TensorProto.FLOAT),
            helper.make_node("Mul", ["x", "extra"], ["more"]),
            helper.make_node("Add", ["x", "more"], ["y"]),
        ]
        inits = [
            numpy_helper.from_array(np.array(v, np.int64), name)
            for name, v in (("zero", 0), ("one", 1), ("past", past))
        ]
    graph = helper.make_graph(
        nodes,
        "seq",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq"])],
        inits,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
    return path


def _answer(out) -> dict:
    return json.JSONDecoder().raw_decode(out.output[out.output.index("{\n") :])[0]


def _engine(tmp_path: Path) -> Path:
    engine = tmp_path / "e"
    built = invoke("build", _seq_graph(tmp_path / "m.onnx"), "-o", engine, "--set", "signature.shapes={seq: [2, 12]}")
    assert built.exit_code == 0, built.output
    return engine


def test_random_inputs_are_drawn_at_every_shape_point_and_batch_size_set(tmp_path: Path) -> None:
    """It checked seq 12 (the largest the engine records) at batch 4 only."""
    engine, sets = (
        _engine(tmp_path),
        ("--set", "signature.shapes={seq: [3, 12]}", "--set", "signature.batch_sizes=[1,4]"),
    )
    out = invoke("validate", engine, "--reference", tmp_path / "m.onnx", *sets)
    assert out.exit_code == 0, out.output
    answer = _answer(out)
    assert answer["shapes"] == [{"seq": 3}, {"seq": 12}] and answer["batch_sizes"] == [1, 4]
    assert list(answer["latency_ms"]) == ["1", "4"]


def test_inputs_are_resized_to_every_shape_point_set(tmp_path: Path) -> None:
    """An engine that differs from its reference past position 8 passed on --inputs of seq 6 with
    signature.shapes={seq: [4, 12]}: only the file's own length was compared."""
    engine, reference = _engine(tmp_path), _seq_graph(tmp_path / "ref.onnx", past=8)
    np.savez(tmp_path / "x.npz", x=np.random.default_rng(0).uniform(1, 2, (5, 6)).astype(np.float32))
    args = ("validate", engine, "--reference", reference, "--inputs", tmp_path / "x.npz")
    alone = invoke(*args)
    assert alone.exit_code == 0 and _answer(alone)["shapes"] == [{"seq": 6}], alone.output
    sized = invoke(*args, "--set", "signature.shapes={seq: [4, 12]}")
    assert sized.exit_code != 0 and _answer(sized)["shapes"] == [{"seq": 4}, {"seq": 12}], sized.output
    assert not _answer(sized)["passed"]


def test_a_shape_the_engine_has_no_axis_for_is_one_error(tmp_path: Path) -> None:
    out = invoke(
        "validate", _engine(tmp_path), "--reference", tmp_path / "m.onnx", "--set", "signature.shapes={t: [4]}"
    )
    assert out.exit_code == 2 and "error: signature.shapes names axes ['t']" in out.output, out.output
    assert "Traceback" not in out.output


def test_the_reference_is_loaded_once_for_every_shape_point_and_batch_size(tmp_path: Path, monkeypatch) -> None:
    """Four checks (two shape points, two batch sizes) opened the reference's ONNX Runtime session four times."""
    import kiln.stages.validate.direct as direct

    opened: list[object] = []
    real = direct.ort_session
    monkeypatch.setattr(direct, "ort_session", lambda *a, **k: opened.append(a[0]) or real(*a, **k))
    engine, sets = (
        _engine(tmp_path),
        ("--set", "signature.shapes={seq: [3, 12]}", "--set", "signature.batch_sizes=[1,4]"),
    )
    out = invoke("validate", engine, "--reference", tmp_path / "m.onnx", *sets)
    assert out.exit_code == 0, out.output
    assert len(_answer(out)["shapes"]) == 2 and len(opened) == 1, opened


def test_random_inputs_of_a_float_index_are_drawn_within_its_table(tmp_path: Path) -> None:
    """A float timestep the graph casts to an index into 10 rows: standard normal values (-1.3) are outside the
    range the engine records, and kiln validate ENGINE without --inputs refused its own random inputs."""
    graph = helper.make_graph(
        [
            helper.make_node("Cast", ["t"], ["ti"], to=TensorProto.INT64),
            helper.make_node("Gather", ["table", "ti"], ["y"]),
        ],
        "timestep",
        [helper.make_tensor_value_info("t", TensorProto.FLOAT, ["batch"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        [numpy_helper.from_array(np.arange(40, dtype=np.float32).reshape(10, 4), "table")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), tmp_path / "t.onnx")
    assert invoke("build", tmp_path / "t.onnx", "-o", tmp_path / "e").exit_code == 0
    out = invoke("validate", tmp_path / "e", "--reference", tmp_path / "t.onnx")
    assert out.exit_code == 0, out.output
    assert _answer(out)["passed"]
