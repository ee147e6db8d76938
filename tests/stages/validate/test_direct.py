"""`kiln validate ENGINE --reference ...` against a reference that is another model: one error/fix pair."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from tests.pipeline.test_faults import assert_clean, invoke, tiny_onnx


def test_a_reference_of_another_shape_or_another_model_is_named(tmp_path: Path) -> None:
    """An ONNX reference of another rank was an ONNX Runtime traceback; a checkpoint of a model that cannot take the
    engine's inputs, torch's."""
    import torch
    from safetensors.torch import save_file

    from kiln.models.registry import build_model

    engine = tmp_path / "e"
    assert invoke("build", tiny_onnx(tmp_path / "m.onnx"), "-o", engine).exit_code == 0
    other = tmp_path / "other.onnx"
    graph = helper.make_graph(
        [helper.make_node("Flatten", ["input"], ["logits"])],
        "other",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 1, 4])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 4])],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), other)
    assert_clean(invoke("validate", engine, "--reference", other), 2, "reference other.onnx takes float32[batch, 1, 4]")
    weights = tmp_path / "cnn.safetensors"
    torch.manual_seed(0)
    save_file(build_model("cnn", {}).state_dict(), str(weights))
    assert_clean(invoke("validate", engine, "--reference", weights), 2, "reference cnn.safetensors (cnn) fails on")


def test_running_out_of_memory_on_the_reference_is_not_called_another_models_inputs(tmp_path: Path) -> None:
    """torch's CPU allocator says it with a RuntimeError, CUDA with OutOfMemoryError: neither means the inputs are
    another model's."""
    from types import SimpleNamespace

    import numpy as np

    from kiln.stages.validate.checkpoint import OTHER_MODEL, _reference_error

    cfg = SimpleNamespace(model=SimpleNamespace(name="cnn"))  # the settings' one field the message reads
    feed = {"input": np.zeros((4096, 1, 8, 8), np.float32)}
    oom = RuntimeError("[enforce fail at alloc_cpu.cpp:118] DefaultCPUAllocator: can't allocate memory: 9 GB")
    err = _reference_error(tmp_path / "w.safetensors", cfg, feed, oom)
    assert "ran out of memory on the engine's inputs {'input': 'float32[4096, 1, 8, 8]'}" in err.message
    assert "smaller batch" in err.hint
    shape = RuntimeError("mat1 and mat2 shapes cannot be multiplied (4096x64 and 16x4)")
    err = _reference_error(tmp_path / "w.safetensors", cfg, feed, shape)
    assert "fails on the engine's inputs" in err.message and "mat1 and mat2" in err.message
    assert err.hint == OTHER_MODEL


def test_a_token_id_past_the_table_is_the_engines_refusal_before_either_reference_runs(tmp_path: Path) -> None:
    """The engine records the rows its ids index (``index_ranges``); inputs past them are refused as the engine
    would refuse them, not answered by ONNX Runtime's Gather error or the checkpoint's IndexError."""
    import numpy as np
    import torch
    from safetensors.torch import save_file

    from tests.user_models import ids_and_mask

    model, engine, weights = tmp_path / "m.onnx", tmp_path / "e", tmp_path / "w.safetensors"
    shapes = ("--input-shape", "input_ids=6:int64", "--input-shape", "attention_mask=6:int64")
    assert invoke("export", "--model", "tests.user_models:ids_and_mask", *shapes, "-o", model).exit_code == 0
    assert invoke("build", model, "-o", engine).exit_code == 0
    torch.manual_seed(0)
    save_file(ids_and_mask().state_dict(), str(weights))
    bad = tmp_path / "bad.npz"
    np.savez(bad, input_ids=np.full((2, 6), 25, np.int64), attention_mask=np.ones((2, 6), np.int64))
    said = "input 'input_ids' holds 25: engine onnxruntime-cpu-fp32 takes values from 0 to 19"
    assert_clean(
        invoke("validate", engine, "--reference", model, "--inputs", bad), 2, said, "within what the input indexes"
    )
    by_weights = invoke(
        "validate", engine, "--reference", weights, "--model", "tests.user_models:ids_and_mask", "--inputs", bad
    )
    assert_clean(by_weights, 2, said, "within what the input indexes")


def test_an_engine_is_validated_at_sizes_past_its_record_and_the_log_says_so(tmp_path: Path) -> None:
    """Checking an engine at a new size is what `kiln validate ENGINE` is for: a packaged engine's validated batches
    (which servers and infer hold it to) do not stop it; the log says the record still refuses the size."""
    import numpy as np

    from kiln.stages.engines.backend import SIDECAR, read_metadata

    model, engine = tiny_onnx(tmp_path / "m.onnx"), tmp_path / "e"
    assert invoke("build", model, "-o", engine).exit_code == 0
    meta = read_metadata(engine)
    meta.model_copy(update={"validated_batch_sizes": [1, 4]}).write(engine / SIDECAR)
    spec = meta.inputs[0]
    shape = [8, *(d if isinstance(d, int) else 4 for d in spec.shape[1:])]
    np.savez(tmp_path / "x.npz", **{spec.name: np.random.default_rng(0).random(shape, dtype=np.float32)})
    out = invoke("validate", engine, "--reference", model, "--inputs", tmp_path / "x.npz")
    assert out.exit_code == 0, out.output
    said = " ".join(out.output.split())  # the log's lines wrap at the terminal's width
    assert "has 8 rows: engine onnxruntime-cpu-fp32 was validated for batches up to 4" in said
    assert "signature.batch_sizes" in said


def _seq_graph(path: Path, table: bool) -> Path:
    """x [batch, seq] -> Relu; with ``table``, plus a position table of 4 rows: it takes seq 4 only."""
    import numpy as np
    from onnx import numpy_helper

    nodes = [helper.make_node("Relu", ["input"], ["r"])]
    inits = []
    if table:
        nodes.append(helper.make_node("Add", ["r", "pos"], ["logits"]))
        inits.append(numpy_helper.from_array(np.zeros((1, 4), dtype=np.float32), "pos"))
    else:
        nodes.append(helper.make_node("Identity", ["r"], ["logits"]))
    graph = helper.make_graph(
        nodes,
        "seq",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", "seq"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq"])],
        inits,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
    return path


def test_a_reference_graph_that_fails_at_the_inputs_sizes_is_one_error(tmp_path: Path) -> None:
    """An ONNX reference whose position table is shorter than the inputs (a language model at 100 tokens, its
    rotary table of 64) was ONNX Runtime's traceback and exit 1."""
    import numpy as np

    engine = tmp_path / "e"
    assert invoke("build", _seq_graph(tmp_path / "any.onnx", False), "-o", engine).exit_code == 0
    np.savez(tmp_path / "x.npz", input=np.ones((2, 6), dtype=np.float32))
    out = invoke(
        "validate", engine, "--reference", _seq_graph(tmp_path / "ref.onnx", True), "--inputs", tmp_path / "x.npz"
    )
    assert_clean(out, 2, "reference ref.onnx fails on the engine's inputs", "in ONNX Runtime")


def test_an_output_the_reference_answers_with_nan_everywhere_is_no_pass(tmp_path: Path) -> None:
    """Sqrt of negative inputs: NaN in the reference and the engine alike compared as equal (cosine 1, error 0) and
    passed; nothing was measured. NaN on some samples only is said in the log."""
    import json

    import numpy as np

    graph = helper.make_graph(
        [helper.make_node("Sqrt", ["input"], ["logits"])],
        "sqrt",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 4])],
    )
    model, engine = tmp_path / "m.onnx", tmp_path / "e"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), model)
    assert invoke("build", model, "-o", engine).exit_code == 0
    np.savez(tmp_path / "neg.npz", input=-np.ones((4, 4), dtype=np.float32))
    out = invoke("validate", engine, "--reference", model, "--inputs", tmp_path / "neg.npz")
    assert out.exit_code == 3, out.output
    assert "reference output 'logits' is NaN, infinite or a mask's fill at every value of all 4 samples" in " ".join(
        out.output.split()
    )
    half = np.ones((4, 4), dtype=np.float32)
    half[1] = -1
    np.savez(tmp_path / "half.npz", input=half)
    out = invoke("validate", engine, "--reference", model, "--inputs", tmp_path / "half.npz")
    assert out.exit_code == 0, out.output
    assert json.loads(out.output[out.output.index("{") :])["passed"]
    assert "at every value of 1 of 4 samples (sample 1 first)" in " ".join(out.output.split())


@pytest.mark.parametrize("fill", [float("-inf"), -1e9])
def test_an_engine_equal_to_its_reference_passes_with_a_masked_action_in_every_sample(
    tmp_path: Path, fill: float
) -> None:
    """A policy whose last action is invalid everywhere (its logit filled with -inf): every sample held a non-finite
    value, and a bit-exact engine failed with "NaN or infinite on all 80 samples", its finite logits compared."""
    import numpy as np

    mask = helper.make_tensor("mask", TensorProto.FLOAT, [4], [0.0, 0.0, 0.0, fill])
    graph = helper.make_graph(
        [helper.make_node("Add", ["input", "mask"], ["logits"])],
        "masked",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 4])],
        [mask],
    )
    model, engine = tmp_path / "m.onnx", tmp_path / "e"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), model)
    assert invoke("build", model, "-o", engine).exit_code == 0
    np.savez(tmp_path / "x.npz", input=np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32))
    out = invoke("validate", engine, "--reference", model, "--inputs", tmp_path / "x.npz")
    assert out.exit_code == 0, out.output
    assert "nothing was compared" not in out.output


def _seq2seq_onnx(path: Path, changed: bool = False) -> Path:
    """Decoder logits [batch, dec, 4]: a table row per decoder token plus the masked sum of the source's rows.
    ``changed``: the table's row for token 9 differs (a model that answers otherwise wherever 9 is decoded)."""
    import numpy as np
    from onnx import numpy_helper

    table = np.arange(40, dtype=np.float32).reshape(10, 4) / 10
    if changed:
        table[9] += 5.0
    ints = [("input_ids", "enc"), ("attention_mask", "enc"), ("decoder_input_ids", "dec")]
    nodes = [
        helper.make_node("Gather", ["table", "decoder_input_ids"], ["dec_rows"]),
        helper.make_node("Gather", ["table", "input_ids"], ["enc_rows"]),
        helper.make_node("Cast", ["attention_mask"], ["mask_f"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["mask_f", "last"], ["mask_3d"]),
        helper.make_node("Mul", ["enc_rows", "mask_3d"], ["enc_kept"]),
        helper.make_node("ReduceSum", ["enc_kept", "one"], ["enc_sum"], keepdims=1),
        helper.make_node("Add", ["dec_rows", "enc_sum"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes,
        "seq2seq",
        [helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", a]) for n, a in ints],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "dec", 4])],
        [
            numpy_helper.from_array(table, "table"),
            numpy_helper.from_array(np.array([-1], np.int64), "last"),
            numpy_helper.from_array(np.array([1], np.int64), "one"),
        ],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
    return path


def test_decoder_positions_where_the_source_is_padding_are_compared(tmp_path: Path) -> None:
    """An encoder-decoder engine validated against a reference that differs only at decoder positions where the
    source is padding, at enc == dec: the engine's axis names say the logits follow ``dec``, which the encoder's
    attention mask does not lie on, so those positions are compared and the engine fails. Before: the encoder's
    mask, shaped like the logits' first two axes, hid them and the engine passed with cosine 1."""
    import numpy as np

    engine = tmp_path / "e"
    assert invoke("build", _seq2seq_onnx(tmp_path / "m.onnx"), "-o", engine).exit_code == 0
    inputs = tmp_path / "in.npz"
    mask = np.array([[1, 1, 0, 0], [1, 1, 1, 1]], np.int64)
    dec = np.array([[1, 2, 9, 9], [1, 2, 3, 4]], np.int64)
    np.savez(inputs, input_ids=mask * 3, attention_mask=mask, decoder_input_ids=dec)
    same = invoke("validate", engine, "--reference", tmp_path / "m.onnx", "--inputs", inputs)
    assert same.exit_code == 0, same.output
    other = _seq2seq_onnx(tmp_path / "other.onnx", changed=True)
    result = invoke("validate", engine, "--reference", other, "--inputs", inputs)
    assert result.exit_code != 0 and "cosine" in result.output, result.output


def test_an_engine_whose_inputs_share_no_batch_axis_gets_the_batch_of_one_fix(tmp_path: Path, monkeypatch) -> None:
    """An engine of a GNN in its own layout (built before Kiln refused such graphs): random inputs or an npz ended
    in 'different row counts' with the fix to validate against the model it was built from, which it was."""
    import numpy as np

    import kiln.core.inputs
    import kiln.core.onnx_io
    from tests.core.test_onnx_io import gnn_onnx

    model = gnn_onnx(tmp_path / "gcn.onnx")
    engine = tmp_path / "eng"
    with monkeypatch.context() as old:  # the Kiln that built it took such graphs
        old.setattr(kiln.core.inputs, "check_batch_axis", lambda *a, **k: None)
        old.setattr(kiln.core.onnx_io, "check_batch_axis", lambda *a, **k: None)
        built = invoke(
            "build", model, "-o", engine, "--backend", "onnxruntime", "--set", "signature.shapes={edges: [6]}"
        )
        assert built.exit_code == 0, built.output
    feeds = tmp_path / "g.npz"
    np.savez(feeds, x=np.ones((12, 4), np.float32), edge_index=np.zeros((2, 6), np.int64))
    said = "engine eng: input 'edge_index' [2, edges] has a fixed axis 0 (2) while axis 0 of input 'x' [nodes, 4]"
    for extra in ((), ("--inputs", feeds)):
        result = invoke("validate", engine, "--reference", model, "--set", "signature.shapes={edges: [6]}", *extra)
        assert_clean(result, 2, said, "edge_index [1, 2, edges]")
        assert "built from" not in result.output and "one row per sample" not in result.output


def fixed_batch_onnx(path: Path, relu: bool = True) -> Path:
    """input [1, 4] -> MatMul (positive weights) -> Relu -> logits [1, 3]: a batch fixed at 1, as the TorchScript
    exporter writes it. Without ``relu`` it differs from the graph with it only on rows of negative inputs."""
    import numpy as np
    from onnx import numpy_helper

    w = numpy_helper.from_array(np.arange(1, 13, dtype=np.float32).reshape(4, 3) / 12, "w")
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["input", "w"], ["m"]),
            helper.make_node("Relu" if relu else "Identity", ["m"], ["logits"]),
        ],
        "fixed",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 3])],
        [w],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
    return path


def _rows(tmp_path: Path, rows: int = 8) -> Path:
    """``rows`` rows of positive inputs but the last, which is negative."""
    import numpy as np

    x = np.random.default_rng(0).uniform(0.1, 1.0, (rows, 4)).astype(np.float32)
    x[-1] *= -1
    np.savez(tmp_path / "x.npz", input=x)
    return tmp_path / "x.npz"


def _validated(out) -> dict:
    import json

    return json.JSONDecoder().raw_decode(out.output[out.output.index("{\n") :])[0]  # error/fix lines may follow


def test_an_engine_of_a_fixed_batch_is_validated_on_every_row_one_batch_at_a_time(tmp_path: Path) -> None:
    """A graph that fixes its batch at 1 takes an .npz of 8 rows, each run alone; its latency is keyed by the batch
    the engine runs (1), not the row count."""
    model, engine = fixed_batch_onnx(tmp_path / "m.onnx"), tmp_path / "e"
    assert invoke("build", model, "-o", engine).exit_code == 0
    out = invoke("validate", engine, "--reference", model, "--inputs", _rows(tmp_path))
    assert out.exit_code == 0, out.output
    assert list(_validated(out)["latency_ms"]) == ["1"]


def test_every_row_of_a_fixed_batch_is_compared(tmp_path: Path) -> None:
    """The engine differs from its reference on the last of 8 rows only: that row is compared, and is the worst."""
    engine = tmp_path / "e"
    assert invoke("build", fixed_batch_onnx(tmp_path / "id.onnx", relu=False), "-o", engine).exit_code == 0
    out = invoke("validate", engine, "--reference", fixed_batch_onnx(tmp_path / "m.onnx"), "--inputs", _rows(tmp_path))
    assert out.exit_code != 0, out.output
    assert _validated(out)["outputs"]["logits"]["worst_sample"] == 7


def _two_heads(path: Path) -> Path:
    """input [batch, 4] -> click [batch, 1] (a binary classifier's logit) and value [batch, 1] (a regression's)."""
    import numpy as np
    from onnx import numpy_helper

    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array(rng.standard_normal((4, 1)).astype(np.float32), k) for k in ("wc", "wv")]
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["input", "wc"], ["click"]),
            helper.make_node("MatMul", ["input", "wv"], ["value"]),
        ],
        "two_heads",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info(k, TensorProto.FLOAT, ["batch", 1]) for k in ("click", "value")],
        weights,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
    return path


def test_direct_validation_warns_what_it_compared_by_without_top1_and_names_a_click_logits_decision(
    tmp_path: Path,
) -> None:
    """Two [N, 1] heads, none named 'logits': the log says no top-1 agreement was computed, why, and what the outputs
    were compared by; naming the click logit holds its decision (the sign) to top-1 agreement, and the value beside
    it is no logit."""
    import json

    import numpy as np

    model, engine, inputs = _two_heads(tmp_path / "m.onnx"), tmp_path / "e", tmp_path / "x.npz"
    assert invoke("build", model, "-o", engine).exit_code == 0
    np.savez(inputs, input=np.random.default_rng(1).standard_normal((64, 4)).astype(np.float32))
    default = invoke("validate", engine, "--reference", model, "--inputs", inputs)
    assert default.exit_code == 0, default.output
    said = " ".join(default.output[: default.output.index("{")].split())
    assert "no top-1 agreement: 2 outputs (click, value), none named 'logits'; compared by cosine" in said, said
    assert "signature.logits_output=NAME" in said, said
    named = invoke(
        "validate", engine, "--reference", model, "--inputs", inputs, "--set", "signature.logits_output=click"
    )
    assert named.exit_code == 0, named.output
    assert "no top-1 agreement" not in named.output[: named.output.index("{")]
    got = json.loads(named.output[named.output.index("{") :])
    assert got["top1_agreement"] == 1.0 and got["outputs"]["value"]["top1_agreement"] is None


def test_a_size_off_the_graphs_steps_is_said_as_that_not_as_one_to_add(caplog: pytest.LogCaptureFixture) -> None:
    """A U-Net's height in steps of 4 given at 30: the warning told to add 30 to signature.shapes, where no run can
    serve it (the graph's Concat refuses it)."""
    import logging

    import numpy as np

    from kiln.core.records import TensorSpec
    from kiln.stages.validate.direct import _say_new_sizes
    from tests.stages.package.test_stage import engine_meta

    spec = TensorSpec(name="x", shape=["batch", 3, "h", "w"], dtype="float32")
    meta = engine_meta(
        backend="onnxruntime",
        device="cpu",
        inputs=[spec],
        outputs=[spec],
        axis_ranges={"h": [16, 32], "w": [16, 32]},
        axis_steps={"h": [4, 0], "w": [4, 0]},
    )
    with caplog.at_level(logging.WARNING, logger="kiln"):
        _say_new_sizes(meta, {"x": np.zeros((2, 3, 30, 32), np.float32)})
        _say_new_sizes(meta, {"x": np.zeros((2, 3, 36, 32), np.float32)})  # on its steps, past the range: add it
    said = [r.getMessage() for r in caplog.records]
    assert (
        said[0].startswith("input 'x' axis 2 (h) is 30: the graph takes h only in steps of 4")
        and "add them" not in said[0]
    )
    assert len(said) == 2 and "add them to signature.batch_sizes / signature.shapes" in said[1]


def test_random_inputs_take_the_largest_batch_the_engine_was_validated_for(tmp_path: Path) -> None:
    """Without --inputs or signature.batch_sizes, the random batch is the engine's largest validated one (4), not
    the default 32 that its record then warns of."""
    import json

    from kiln.stages.engines.backend import SIDECAR, read_metadata

    model, engine = tiny_onnx(tmp_path / "m.onnx"), tmp_path / "e"
    assert invoke("build", model, "-o", engine).exit_code == 0
    read_metadata(engine).model_copy(update={"validated_batch_sizes": [1, 4]}).write(engine / SIDECAR)
    out = invoke("validate", engine, "--reference", model)
    assert out.exit_code == 0, out.output
    assert "was validated for batches up to 4" not in " ".join(out.output.split())
    assert json.loads(out.stdout)["batch_sizes"] == [4], out.stdout


def test_a_scalar_output_run_in_batches_is_compared_over_its_norm() -> None:
    """An output without a batch axis, one value a batch once run in batches: its relative error is over its norm
    (a batch-level value has no spread across samples to measure it against), with no cosine."""
    import numpy as np

    from kiln.core.records import EngineMetadata, TensorSpec
    from kiln.stages.validate.direct import _compared

    meta = EngineMetadata.model_construct(
        inputs=[TensorSpec(name="x", shape=["batch", 2], dtype="float32")],
        outputs=[
            TensorSpec(name="y", shape=["batch", 2], dtype="float32"),
            TensorSpec(name="aux", shape=[], dtype="float32"),
        ],
    )
    rng = np.random.default_rng(0)
    feed = {"x": rng.random((6, 2), dtype=np.float32)}
    ref = {"y": feed["x"], "aux": np.array([1.0, 1.01, 0.99], np.float32)}
    got = {"y": feed["x"], "aux": ref["aux"] * 1.001}
    kept, _, _ = _compared(meta, [feed], [ref], [got], None)
    assert kept["aux"].cosine is None and kept["aux"].rel_err == pytest.approx(0.001, rel=1e-2)
