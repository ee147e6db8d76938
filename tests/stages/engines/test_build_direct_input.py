"""``kiln build FILE``: a file ONNX Runtime cannot load is named as the user gave it, never by the staging folder
Kiln builds in, and a graph the ONNX checker and ONNX Runtime both refuse is said as such, with the fix ``kiln run``
gives for it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from kiln.cli import main
from kiln.core.errors import BuildError, ModelError
from kiln.stages.engines.config import BuildConfig
from kiln.stages.engines.stage import build_direct


def _save(path: Path, node: onnx.NodeProto, domains: dict[str, int] | None = None, external: bool = False) -> Path:
    """A MatMul-sized model (``x [batch, 4] -> y [batch, 4]``) of one ``node`` reading ``x`` and a weight ``w``."""
    weight = numpy_helper.from_array(np.eye(4, dtype=np.float32) * 2, "w")
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        [weight],
    )
    opsets = [helper.make_opsetid("", 17)] + [helper.make_opsetid(d, v) for d, v in (domains or {}).items()]
    model = helper.make_model(graph, opset_imports=opsets)
    onnx.save(model, path, save_as_external_data=external, location=f"{path.name}.data", size_threshold=0)
    return path


def test_a_graph_reading_a_tensor_nothing_makes_fails_the_checker_naming_the_file(tmp_path: Path) -> None:
    src = _save(tmp_path / "broken.onnx", helper.make_node("MatMul", ["x", "nonexistent_tensor"], ["y"]))
    with pytest.raises(ModelError, match=r"broken\.onnx fails the ONNX checker: .*nonexistent_tensor") as refused:
        build_direct(src, tmp_path / "e", "onnxruntime", "cpu", None, BuildConfig())
    assert refused.value.hint.startswith("re-export") and not (tmp_path / "e").exists()


def test_the_cli_says_the_checker_error_as_one_pair_naming_the_users_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    _save(tmp_path / "broken.onnx", helper.make_node("MatMul", ["x", "nonexistent_tensor"], ["y"]))
    result = CliRunner().invoke(main, ["build", "broken.onnx", "-o", "e"])
    lines = [line for line in result.output.splitlines() if line.startswith(("error:", "fix:"))]
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert lines[0].startswith("error: broken.onnx fails the ONNX checker") and "staging" not in result.output
    assert lines[1].startswith("fix: re-export"), result.output


def test_a_file_with_external_data_is_checked_and_built_from_another_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checker looks for external data from the working folder, not the model's: run from elsewhere."""
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    src = _save(tmp_path / "ext.onnx", helper.make_node("MatMul", ["x", "w"], ["y"]), external=True)
    assert (tmp_path / "ext.onnx.data").is_file()
    meta = build_direct(src, tmp_path / "e", "onnxruntime", "cpu", None, BuildConfig())
    assert meta.precision == "fp32"


def test_a_graph_onnx_runtime_cannot_load_is_named_by_the_users_file(tmp_path: Path) -> None:
    """An op of a domain the checker leaves alone, which ONNX Runtime has no kernel for: its error names the file
    the user gave, not the graph Kiln wrote into its staging folder."""
    node = helper.make_node("Foo", ["x", "w"], ["y"], domain="com.example")
    src = _save(tmp_path / "custom.onnx", node, {"com.example": 1})
    with pytest.raises(BuildError, match="ONNX Runtime cannot load the model") as refused:
        build_direct(src, tmp_path / "e", "onnxruntime", "cpu", None, BuildConfig())
    assert str(src) in refused.value.message and "staging" not in refused.value.message, refused.value.message


def test_an_output_declared_without_a_shape_passes_the_check(tmp_path: Path) -> None:
    """ONNX Runtime runs a graph whose output has a type and no shape (`kiln run` infers one before its check): the
    checker's requirement of a shape field is not held against the user's file."""
    src = _save(tmp_path / "m.onnx", helper.make_node("MatMul", ["x", "w"], ["y"]))
    model = onnx.load(src)
    model.graph.output[0].type.tensor_type.ClearField("shape")
    onnx.save(model, src)
    assert build_direct(src, tmp_path / "e", "onnxruntime", "cpu", None, BuildConfig()).precision == "fp32"


def test_a_graph_only_the_checker_refuses_is_built_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Nodes out of topological order: the checker refuses them, ONNX Runtime sorts them itself and runs the graph."""
    weight = numpy_helper.from_array(np.eye(4, dtype=np.float32) * 2, "w")
    graph = helper.make_graph(
        [helper.make_node("Relu", ["h"], ["y"]), helper.make_node("MatMul", ["x", "w"], ["h"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        [weight],
    )
    src = tmp_path / "unsorted.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), src)
    with caplog.at_level("WARNING", logger="kiln"):
        meta = build_direct(src, tmp_path / "e", "onnxruntime", "cpu", None, BuildConfig())
    assert meta.backend == "onnxruntime" and (tmp_path / "e" / "kiln-engine.json").exists()
    assert any("fails the ONNX checker" in r.getMessage() and "build goes on" in r.getMessage() for r in caplog.records)


def test_another_backend_is_left_to_its_own_parser(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """TensorRT's parser takes plugin ops ONNX Runtime lacks (EfficientNMS_TRT as graphsurgeon adds it): the
    checker's verdict on a graph for it is a warning, not ONNX Runtime's refusal."""
    from kiln.core.onnx_io import load_onnx
    from kiln.stages.engines.stage import check_graph

    src = _save(tmp_path / "broken.onnx", helper.make_node("MatMul", ["x", "nonexistent_tensor"], ["y"]))
    with caplog.at_level("WARNING", logger="kiln"):
        check_graph(load_onnx(src, load_external_data=False), src, "tensorrt")
    assert any("the tensorrt build goes on" in r.getMessage() for r in caplog.records)
    with pytest.raises(ModelError, match="fails the ONNX checker"):
        check_graph(load_onnx(src, load_external_data=False), src, "onnxruntime")
