"""The runner's input check: every engine refuses a feed its metadata does not describe, naming the input."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kiln.core.errors import InputError
from kiln.core.records import EngineMetadata, TensorSpec
from kiln.stages.engines.backend import Runner, check_feed, past_index
from kiln.stages.engines.registry import load_engine
from tests.stages.engines.lstm_engine import lstm_engine

META = EngineMetadata(
    name="e",
    backend="onnxruntime",
    device="cpu",
    precision="fp32",
    inputs=[
        {"name": "input_ids", "shape": ["batch", "seq"], "dtype": "int64"},
        {"name": "pixels", "shape": ["batch", 3, 8, 8], "dtype": "float32"},
    ],
    outputs=[{"name": "logits", "shape": ["batch", 4], "dtype": "float32"}],
    source={"file": "m.onnx", "sha256": "0"},
    files={"model": "engine.onnx"},
    flavour="onnxruntime",
    versions={},
)
GOOD = {"input_ids": np.zeros((2, 5), np.int64), "pixels": np.zeros((2, 3, 8, 8), np.float32)}


def test_a_feed_as_declared_passes() -> None:
    check_feed(META, GOOD)
    check_feed(META, {"input_ids": np.zeros((7, 11), np.int64), "pixels": np.zeros((7, 3, 8, 8), np.float32)})


@pytest.mark.parametrize(
    "change, needle",
    [
        (
            {"input_ids": np.zeros((2, 5), np.int32)},
            "input 'input_ids' is int32[2, 5], the engine takes int64[batch, seq]",
        ),
        ({"pixels": np.zeros((2, 3, 8), np.float32)}, "input 'pixels' is float32[2, 3, 8]"),
        ({"pixels": np.zeros((2, 1, 8, 8), np.float32)}, "input 'pixels' axis 1 is 1: engine e takes 3 there"),
        ({"pixels": [[0.0]]}, "input 'pixels' is a list, not a numpy array"),
        ({"extra": np.zeros(1)}, "needs inputs ['input_ids', 'pixels'], got ['extra', 'input_ids', 'pixels']"),
    ],
)
def test_a_feed_the_engine_does_not_take_is_one_error_naming_the_input(change: dict, needle: str) -> None:
    with pytest.raises(InputError) as err:
        check_feed(META, {**GOOD, **change})
    assert needle in err.value.message and err.value.hint


def test_a_missing_input_is_named() -> None:
    with pytest.raises(InputError, match=r"needs inputs \['input_ids', 'pixels'\], got \['pixels'\]"):
        check_feed(META, {"pixels": GOOD["pixels"]})


@pytest.mark.parametrize(
    "feed, needle",
    [
        (
            {"input_ids": np.zeros((0, 5), np.int64), "pixels": np.zeros((0, 3, 8, 8), np.float32)},
            "input 'input_ids' has 0 rows: engine e takes no empty inputs",
        ),
        ({**GOOD, "input_ids": np.zeros((2, 0), np.int64)}, "input 'input_ids' axis 1 (seq) is 0"),
    ],
)
def test_an_empty_input_is_one_error_naming_it(feed: dict, needle: str) -> None:
    with pytest.raises(InputError) as err:
        check_feed(META, feed)
    assert err.value.message.startswith(needle) and err.value.hint


def test_a_fixed_axis_at_another_size_says_how_to_export_it_dynamic() -> None:
    with pytest.raises(InputError) as err:
        check_feed(META, {**GOOD, "pixels": np.zeros((2, 3, 16, 8), np.float32)})
    assert err.value.message == "input 'pixels' axis 2 is 16: engine e takes 8 there (a fixed size of its graph)"
    assert err.value.hint == (
        "pass 'pixels' at 8 on axis 2, or export the model with that axis dynamic (signature.dynamic_axes: "
        "{pixels: {2: NAME}}, sizes in signature.shapes) and build"
    )


def test_an_empty_axis_says_how_to_declare_0() -> None:
    ranged = META.model_copy(update={"axis_ranges": {"seq": [4, 16]}})
    with pytest.raises(InputError) as err:
        check_feed(ranged, {**GOOD, "input_ids": np.zeros((2, 0), np.int64)})
    assert err.value.message == "input 'input_ids' axis 1 (seq) is 0: engine e was built for seq from 4 to 16"
    assert "signature.shapes: {seq: [0, ...]}" in err.value.hint
    check_feed(
        META.model_copy(update={"axis_ranges": {"seq": [0, 16]}}), {**GOOD, "input_ids": np.zeros((2, 0), np.int64)}
    )


def test_a_named_axis_outside_its_validated_range_is_one_error_naming_it() -> None:
    ranged = META.model_copy(update={"axis_ranges": {"seq": [4, 16]}})
    check_feed(ranged, {**GOOD, "input_ids": np.zeros((2, 16), np.int64)})  # the range's own ends pass
    long = {**GOOD, "input_ids": np.zeros((2, 17), np.int64)}
    with pytest.raises(InputError) as err:
        check_feed(ranged, long)
    assert err.value.message == "input 'input_ids' axis 1 (seq) is 17: engine e was built for seq from 4 to 16"
    assert "axis_ranges" in err.value.hint and "allow_outside_ranges=True" in err.value.hint
    check_feed(ranged, long, allow_outside_ranges=True)
    check_feed(META, long)  # an engine that records no range takes any size


def test_a_size_off_the_graphs_steps_within_the_range_is_said_as_the_steps_with_their_own_fix() -> None:
    """A U-Net validated for h 8..16 whose graph takes h in steps of 2: 15 is refused as off the steps, with the
    sizes next to it, and the fix is one of those; 20 as past the range, without the steps."""
    unet = META.model_copy(update={"axis_ranges": {"seq": [8, 16]}, "axis_steps": {"seq": [2, 0]}})
    with pytest.raises(InputError) as err:
        check_feed(unet, {**GOOD, "input_ids": np.zeros((2, 15), np.int64)})
    assert err.value.message.startswith("input 'input_ids' axis 1 (seq) is 15: engine e's graph takes seq only in ")
    assert (
        err.value.message.endswith("; the nearest sizes it takes are 14 and 16") and "8 to 16" not in err.value.message
    )
    assert err.value.hint.startswith("pass a size the engine's graph takes"), err.value.hint
    with pytest.raises(InputError) as err:
        check_feed(unet, {**GOOD, "input_ids": np.zeros((2, 20), np.int64)})
    assert err.value.message == "input 'input_ids' axis 1 (seq) is 20: engine e was built for seq from 8 to 16"
    assert "axis_ranges" in err.value.hint and "steps" not in err.value.message


def test_inputs_differing_on_a_shared_axis_keep_their_own_hint_where_the_axis_has_a_range() -> None:
    ids, mask = (TensorSpec(name=name, shape=["batch", "seq"], dtype="int64") for name in ("ids", "mask"))
    tied = META.model_copy(update={"inputs": [ids, mask], "axis_ranges": {"seq": [4, 16]}})
    for allow in (False, True):
        with pytest.raises(InputError, match="inputs 'ids' and 'mask' differ on axis seq") as err:
            check_feed(
                tied,
                {"ids": np.zeros((2, 8), np.int64), "mask": np.zeros((2, 6), np.int64)},
                allow_outside_ranges=allow,
            )
        assert err.value.hint.startswith("pass every input at one size")


def test_an_lstm_engine_refuses_an_empty_batch_instead_of_aborting_the_process(tmp_path: Path) -> None:
    # ONNX Runtime's LSTM kernel aborts the process (C++ terminate) on 0 rows: without the check this test dies
    engine, _ = lstm_engine(tmp_path)
    with load_engine(engine) as runner:
        assert runner.infer({"input": np.ones((3, 4, 2), np.float32)})["forecast"].shape == (3,)
        with pytest.raises(InputError, match=r"^input 'input' has 0 rows") as err:
            runner.infer({"input": np.ones((0, 4, 2), np.float32)})
        with pytest.raises(InputError, match=r"^input 'input' axis 1 \(time\) is 0"):
            runner.infer({"input": np.ones((3, 0, 2), np.float32)})
    assert "one row or more" in err.value.hint


def test_an_axis_torch_export_fixed_says_to_use_another_engine_not_to_make_it_dynamic(tmp_path: Path) -> None:
    """An nn.GRU's length, which torch.export takes at one size (the torch backend records it in
    ``one_size_axes``): the axis is dynamic in signature.dynamic_axes already, so the fix names an engine of the
    run that takes other sizes, not that setting."""
    import torch

    from kiln.stages.engines.torch.build import _export
    from tests.stages.engines.torch.test_export_sizes import GRUModel

    dims = {0: torch.export.Dim("batch", min=1, max=8), 1: torch.export.Dim("seq", min=2, max=16)}
    _, one_size, _ = _export(GRUModel().eval(), (torch.randint(0, 20, (2, 12)),), ((dims,),), ["tokens"])
    tokens = TensorSpec(name="tokens", shape=["batch", one_size["tokens"][1]], dtype="int64")
    built = META.model_copy(
        update={"name": "torch-cpu-fp32", "inputs": [tokens], "builder_settings": {"one_size_axes": one_size}}
    )
    built.write(tmp_path / "kiln-engine.json")  # as the engine keeps it: the axes become JSON's text keys
    meta = EngineMetadata.read(tmp_path / "kiln-engine.json", hint="")
    with pytest.raises(InputError) as err:
        check_feed(meta, {"tokens": np.zeros((1, 7), np.int64)})
    assert err.value.message.startswith("input 'tokens' axis 1 is 7: engine torch-cpu-fp32 takes 12 there")
    assert "signature.dynamic_axes" not in err.value.hint, err.value.hint
    assert err.value.hint.startswith("pass 'tokens' at 12 on axis 1: torch.export fixed that size"), err.value.hint
    assert "ONNX Runtime" in err.value.hint and "TensorRT" in err.value.hint


def _lookup_graph(path: Path, dtype: int, scale: int | None = None) -> Path:
    """``table[t.long()]`` over a table of 10 rows, ``t`` of ``dtype`` [batch]; ``scale``: the index computed as
    ``t * scale`` first, which the engine's index check does not follow (no range recorded)."""
    import onnx
    from onnx import helper, numpy_helper

    nodes = [helper.make_node("Cast", ["t"], ["t_int"], to=onnx.TensorProto.INT64)]
    index = "t_int"
    if scale is not None:
        scaled = numpy_helper.from_array(np.array(scale, np.int64), "scale")
        nodes.append(helper.make_node("Constant", [], ["scale"], value=scaled))
        nodes.append(helper.make_node("Mul", ["t_int", "scale"], ["t_scaled"]))
        index = "t_scaled"
    nodes.append(helper.make_node("Gather", ["table", index], ["emb"], name="lookup"))
    table = numpy_helper.from_array(np.arange(40, dtype=np.float32).reshape(10, 4), "table")
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("t", dtype, ["batch"])],
        [helper.make_tensor_value_info("emb", onnx.TensorProto.FLOAT, ["batch", 4])],
        [table],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_a_float_input_cast_to_an_index_is_refused_past_its_table_by_kiln_not_onnx_runtime(tmp_path: Path) -> None:
    """A diffusion model's float timestep looked up in a table: the engine records its range, and a timestep past
    the table (or below 0, which ONNX's Gather would read from the end) is Kiln's error naming the input."""
    import onnx

    from kiln.stages.engines.config import BuildConfig
    from kiln.stages.engines.stage import build_direct

    src = _lookup_graph(tmp_path / "m.onnx", onnx.TensorProto.FLOAT)
    meta = build_direct(src, tmp_path / "engine", "onnxruntime", "cpu", None, BuildConfig())
    assert meta.index_ranges == {"t": [0, 9]}
    with load_engine(tmp_path / "engine") as runner:
        assert runner.infer({"t": np.array([9.0], np.float32)})["emb"][0, 0] == 36.0
        for bad in (5000.0, -1.0):
            with pytest.raises(InputError, match=rf"^input 't' holds {int(bad)}: engine .* from 0 to 9"):
                runner.infer({"t": np.array([bad], np.float32)})


def test_an_index_past_a_table_the_check_does_not_range_is_kilns_error_naming_the_node(tmp_path: Path) -> None:
    """An index computed on its way (``t * 2``) has no recorded range: ONNX Runtime's INVALID_ARGUMENT for it becomes
    Kiln's InputError naming the node, the index and the table's rows, with a fix, not the raw text."""
    import onnx

    from kiln.stages.engines.config import BuildConfig
    from kiln.stages.engines.stage import build_direct

    src = _lookup_graph(tmp_path / "m.onnx", onnx.TensorProto.INT64, scale=2)
    meta = build_direct(src, tmp_path / "engine", "onnxruntime", "cpu", None, BuildConfig())
    assert meta.index_ranges == {}
    with load_engine(tmp_path / "engine") as runner:
        assert runner.infer({"t": np.array([4], np.int64)})["emb"][0, 0] == 32.0
        with pytest.raises(InputError) as err:
            runner.infer({"t": np.array([1, 2500], np.int64)})
    assert err.value.message == (
        f"engine {meta.name}: node 'lookup' (Gather) got index 5000, outside the 10 rows of the table it reads "
        "(indices -10 to 9, negative ones counted from its end); the index may come from the values of input 't'"
    )
    assert "ONNXRuntimeError" not in err.value.message and "within the rows of the table" in err.value.hint


def _scatter_nd_error() -> Exception:
    """The installed ONNX Runtime's own error for a ScatterND index past the axis it writes."""
    import onnx
    import onnxruntime as ort
    from onnx import helper

    node = helper.make_node("ScatterND", ["data", "idx", "upd"], ["out"], name="scatter")
    graph = helper.make_graph(
        [node],
        "g",
        [
            helper.make_tensor_value_info("data", onnx.TensorProto.FLOAT, [4]),
            helper.make_tensor_value_info("idx", onnx.TensorProto.INT64, [1, 1]),
            helper.make_tensor_value_info("upd", onnx.TensorProto.FLOAT, [1]),
        ],
        [helper.make_tensor_value_info("out", onnx.TensorProto.FLOAT, [4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feed = {"data": np.zeros(4, np.float32), "idx": np.array([[398]], np.int64), "upd": np.ones(1, np.float32)}
    with pytest.raises(Exception) as err:
        sess.run(None, feed)
    return err.value


class _Failing(Runner):
    """A runner whose backend fails with ``error`` on every call."""

    error: Exception

    def _activate(self) -> None:
        pass

    def _infer(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise self.error


def test_a_scatter_nd_index_past_its_axis_is_kilns_error_naming_the_integer_inputs() -> None:
    """ONNX Runtime's ScatterND says "invalid indice found, indice = N" (a Wav2Vec2 fed a mask holding 2): Kiln's
    InputError naming the node, the index and the integer input it may come from, not the raw ONNX Runtime text."""
    error = _scatter_nd_error()
    assert "invalid indice found, indice = 398" in str(error)
    assert past_index(error) == "node 'scatter' (ScatterND) got an index 398 past the axis it reads"
    runner = _Failing(Path("."), META)
    runner.error = error
    with runner, pytest.raises(InputError) as err:
        runner.infer({**GOOD, "input_ids": np.full((2, 5), 2, np.int64)})
    assert err.value.message == (
        "engine e: node 'scatter' (ScatterND) got an index 398 past the axis it reads; the index may come from the "
        "values of input 'input_ids'"
    )
    assert "ONNXRuntimeError" not in err.value.message and "masks of 0s and 1s" in err.value.hint
