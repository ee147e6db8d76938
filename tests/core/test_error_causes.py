"""Issue 31 rule 5: the error names the cause the user acts on: a full disk as a full disk whichever library was
writing, an opset ONNX Runtime cannot run by its number, two settings that cannot work together by both names, and
exactly one fix (never a second one folded into the error line)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from kiln.cli import main
from kiln.core.errors import ModelError, disk_full
from tests.pipeline.test_faults import assert_clean, tiny_onnx


def invoke(*args: object):
    return CliRunner().invoke(main, [str(a) for a in args])


def _wrapped(inner: BaseException) -> BaseException:
    try:
        try:
            raise inner
        except BaseException:
            raise ModelError("torch.onnx.export failed", hint="the model may use an op ONNX cannot express") from None
    except ModelError as exc:
        return exc


@pytest.mark.parametrize(
    "exc",
    [
        OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/x/model.onnx"),
        OSError(errno.EDQUOT, os.strerror(errno.EDQUOT)),
        RuntimeError("[enforce fail at inline_container.cc] . PytorchStreamWriter: No space left on device"),
        RuntimeError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })"),
        _wrapped(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))),  # quoted by Kiln's own error, `from None`
    ],
)
def test_a_full_disk_is_said_as_a_full_disk(exc: BaseException) -> None:
    error = disk_full(exc, "out/export")
    assert error is not None and error.message.startswith("disk full while writing out/export"), error
    assert error.hint and "free disk space" in error.hint


@pytest.mark.parametrize("exc", [OSError(errno.EACCES, "denied"), RuntimeError("shape mismatch"), ValueError("x")])
def test_other_errors_are_not_a_full_disk(exc: BaseException) -> None:
    assert disk_full(exc, "out") is None


@pytest.mark.parametrize("command", ["optimize", "precision"])
def test_a_library_error_for_a_full_disk_in_a_direct_command(monkeypatch, tmp_path: Path, command: str) -> None:
    import kiln.core.onnx_io as onnx_io

    def full(*args: object, **kw: object) -> None:
        raise RuntimeError("file write failed: No space left on device")

    model = tiny_onnx(tmp_path / "m.onnx")
    monkeypatch.setattr(onnx_io.onnx, "save_model", full)
    out = tmp_path / ("o.onnx" if command == "optimize" else "out")
    assert_clean(invoke(command, model, "-o", out), 2, "disk full while writing")


def _opset_model(path: Path, opset: int) -> Path:
    w = numpy_helper.from_array(np.ones((4, 3), np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["input", "w"], ["logits"])],
        "m",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 3])],
        [w],
    )
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), str(path))
    return path


@pytest.mark.parametrize("command", ["optimize", "build", "precision", "run"])
def test_an_unsupported_opset_is_named(tmp_path: Path, command: str) -> None:
    model = _opset_model(tmp_path / "m.onnx", 99)
    if command == "run":
        config = tmp_path / "run.yaml"
        config.write_text(f"model: {{onnx: {model}}}\nsignature: {{batch_sizes: [1]}}\n")
        result = invoke("run", config, "-w", tmp_path / "wd", "-q")
    else:
        result = invoke(command, model, "-o", tmp_path / ("o.onnx" if command == "optimize" else "out"))
    assert_clean(result, 2, "opset 99", "opset up to")


def test_a_torch_backend_on_an_onnx_start_names_both_settings(tmp_path: Path) -> None:
    model = tiny_onnx(tmp_path / "m.onnx")
    config = tmp_path / "run.yaml"
    config.write_text(f"model: {{onnx: {model}}}\nbuild: {{backends: [onnxruntime, torch]}}\n")
    assert_clean(invoke("config", config), 2, "build.backends ['torch']", "model.onnx", "model.name")


def test_a_torch_backend_with_a_model_name_is_fine(tmp_path: Path) -> None:
    model = tiny_onnx(tmp_path / "m.onnx")
    config = tmp_path / "run.yaml"
    config.write_text(f"model: {{onnx: {model}, name: cnn}}\nbuild: {{backends: [torch]}}\n")
    assert invoke("config", config).exit_code == 0


def test_a_full_disk_while_writing_a_file_says_writing_once() -> None:
    import errno

    from kiln.core.errors import storage_error

    message = storage_error(OSError(errno.ENOSPC, "No space left on device"), "writing report.json").message
    assert message.startswith("disk full while writing report.json") and "writing writing" not in message
