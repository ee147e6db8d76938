"""The fix an audit's refusal gives is one that builds: an fp32 label on a graph already quantized is told to build
it as int8 (every device has fp32 kernels), and an FP16 engine on the CPU, whose provider computes it in FP32, is
told of the CPU, whoever labelled it."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper
from onnxruntime.quantization import QuantFormat, quantize_static

from kiln.core.errors import BuildError
from kiln.core.records import PrecisionVariant, Variants
from kiln.pipeline.config import config_from_dict
from kiln.stages.engines import stage
from kiln.stages.engines.config import BuildConfig
from kiln.stages.engines.stage import MislabelledEngine, build_direct, refusal_fix
from tests.conftest import stage_context
from tests.stages.engines.test_audit import Reader
from tests.stages.precision.test_audit import graph


@pytest.fixture
def qdq(tmp_path: Path) -> Path:
    """An INT8 Q/DQ graph, as a quantization-aware model exports (its fake-quant as QuantizeLinear/DequantizeLinear)."""
    fp32, out = tmp_path / "fp32.onnx", tmp_path / "int8.onnx"
    onnx.save(graph(), str(fp32))
    quantize_static(str(fp32), str(out), Reader(), quant_format=QuantFormat.QDQ)
    return out


def precision_folder(tmp_path: Path, graphs: dict[str, Path]) -> Path:
    """A precision stage's output folder: each variant's graph copied from ``graphs`` beside variants.json."""
    root = tmp_path / "precision"
    for name, src in graphs.items():
        (root / name).mkdir(parents=True)
        shutil.copy(src, root / name / "model.onnx")
    Variants(variants={name: PrecisionVariant(path=f"{name}/model.onnx") for name in graphs}).write(
        root / "variants.json"
    )
    return root


def build_stage(tmp_path: Path, graphs: dict[str, Path], build: dict) -> stage.StageContext:
    cfg = config_from_dict({"build": build, "validate": {"batch_sizes": [1, 8]}})
    (tmp_path / "out").mkdir()
    inputs = {"precision": precision_folder(tmp_path, graphs)}
    return stage_context("build", cfg, tmp_path, tmp_path / "out", inputs, log=logging.getLogger("test"))


def test_an_fp32_label_on_a_quantized_graph_is_told_to_build_it_as_int8(tmp_path: Path, qdq: Path) -> None:
    """`kiln build --precision fp32` of a Q/DQ graph: the fix names its Q/DQ nodes and the int8 label (it said
    "--precision matching the graph, or a graph in that precision")."""
    with pytest.raises(MislabelledEngine) as err:
        build_direct(qdq, tmp_path / "engine", "onnxruntime", "cpu", "fp32", BuildConfig())
    hint = err.value.hint or ""
    assert hint.startswith("its graph is already int8 (") and "QuantizeLinear" in hint
    assert "--precision int8" in hint and "kernels" not in hint


def test_a_run_s_fp32_engine_of_a_quantized_graph_is_not_told_of_missing_fp32_kernels(
    tmp_path: Path, qdq: Path
) -> None:
    """A run whose fp32 variant is a quantization-aware model's Q/DQ graph: the skip says the graph is int8 already
    (it said the backend runs fp32 in another precision on the CPU, and that fp32 on onnxruntime, which the run
    had set, builds anywhere)."""
    ctx = build_stage(tmp_path, {"fp32": qdq}, {"backends": ["onnxruntime"], "onnxruntime": {"devices": ["cpu"]}})
    with pytest.raises(BuildError) as err:
        stage.run(ctx)
    assert "labelled fp32, its graph computes" in err.value.message
    assert "(fix: the model's graph is already int8 (" in err.value.message
    assert "precision.variants: [int8]" in err.value.message and "kernels" not in err.value.message
    assert "builds on any machine" not in (err.value.hint or "")
    fix, warned = refusal_fix(stage.LowGraph("m", "int8", "", {}), PrecisionVariant(path="p"), "p", "fp32", "cpu")
    assert warned and fix.startswith("the model's graph is already int8 (from the model's fake-quant)")


def test_an_unlabelled_fp16_graph_on_the_cpu_is_labelled_by_what_the_cpu_computes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`kiln build fp16.onnx` with no --precision: the audit labels the graph fp16 and the CPU provider computes it in
    FP32, so the engine is labelled fp32, said in a warning (it was refused for a label no one gave); the same label
    given with --precision fp16 is still refused, with the CPU's fix."""
    src = tmp_path / "fp16.onnx"
    onnx.save(graph(TensorProto.FLOAT16), str(src))
    with caplog.at_level(logging.WARNING, logger="kiln.build"):
        meta = build_direct(src, tmp_path / "engine", "onnxruntime", "cpu", None, BuildConfig())
    assert meta.precision == "fp32" and meta.name == "onnxruntime-cpu-fp32"
    assert "computes it in fp32 on CPU (no fp16 kernels there): labelled fp32" in caplog.text
    with pytest.raises(MislabelledEngine, match="computes 0% in fp16") as err:
        build_direct(src, tmp_path / "engine16", "onnxruntime", "cpu", "fp16", BuildConfig())
    hint = err.value.hint or ""
    assert "--precision fp32 here" in hint and "--device cuda" in hint and "or none" not in hint


def test_an_fp16_label_on_an_fp32_graph_on_the_cpu_is_told_of_the_cpu(tmp_path: Path, qdq: Path) -> None:
    """`kiln build fp32.onnx --precision fp16` on the CPU: an FP16 graph from kiln precision fails the same way, so
    the fix is the CPU's at once (it said "give the backend a graph in that precision"); an INT8 graph labelled
    fp16 there is told to match the graph, with no FP16 graph to make."""
    src = tmp_path / "fp32.onnx"
    onnx.save(graph(), str(src))
    with pytest.raises(MislabelledEngine, match="computes 0% in fp16") as err:
        build_direct(src, tmp_path / "engine", "onnxruntime", "cpu", "fp16", BuildConfig())
    hint = err.value.hint or ""
    assert "--precision fp32 here" in hint and "--device cuda" in hint and "kiln precision" not in hint
    with pytest.raises(MislabelledEngine, match="computes 0% in fp16") as err:
        build_direct(qdq, tmp_path / "engine", "onnxruntime", "cpu", "fp16", BuildConfig())
    assert (err.value.hint or "").startswith("build it with --precision matching the graph")
    assert "kiln precision" not in (err.value.hint or "")


def custom_op(path: Path) -> Path:
    """x [batch, 4] -> an op of a domain of its own, which no TensorRT imports (its parser looks for a plugin)."""
    node = helper.make_node("Route", ["x"], ["y"], name="route", domain="custom")
    g = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("custom", 1)]
    onnx.save(helper.make_model(g, opset_imports=opsets), path)
    return path


@pytest.mark.tensorrt
def test_the_same_failure_for_each_precision_is_warned_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """TensorRT's parser fails at the same node for every variant: the reason is said once, the other engines
    name the first (it was said in full once per precision)."""
    src = custom_op(tmp_path / "route.onnx")
    ctx = build_stage(tmp_path, {"fp32": src, "fp16": src}, {"backends": ["tensorrt"]})
    with caplog.at_level(logging.WARNING, logger="test"), pytest.raises(BuildError):
        stage.run(ctx)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("skipping tensorrt")]
    assert len(said) == 2 and "node 'route'" in said[0]
    assert said[1] == "skipping tensorrt-fp16: the same failure as tensorrt-fp32"
