"""`kiln build` of a folder beside a ``kiln precision`` listing that does not list it (a variant the command did
not make, its graph kept for inspection, from a listing that left such variants out): refused, not built as the
graph it holds, labelled by what that graph computes in."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.core.errors import ConfigError
from kiln.core.records import PrecisionVariant, Variants
from kiln.stages.engines.config import BuildConfig
from kiln.stages.engines.stage import build_direct


def _matmul(path: Path) -> None:
    """x [batch, 4] -> MatMul 4x2 -> y."""
    w = numpy_helper.from_array(np.ones((4, 2), np.float32), "w")
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2])],
        [w],
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path))


def test_a_folder_the_listing_does_not_list_is_refused(tmp_path: Path) -> None:
    for precision in ("fp32", "int8"):
        _matmul(tmp_path / "v" / precision / "model.onnx")
    Variants(variants={"fp32": PrecisionVariant(path="fp32/model.onnx")}).write(tmp_path / "v" / "variants.json")
    for src in (tmp_path / "v" / "int8", tmp_path / "v" / "int8" / "model.onnx"):
        with pytest.raises(ConfigError, match="lists no variant in int8/: kiln precision did not make it") as err:
            build_direct(src, tmp_path / "engine", "onnxruntime", "cpu", None, BuildConfig())
        assert "build a variant variants.json lists (fp32)" in err.value.hint
    meta = build_direct(tmp_path / "v" / "fp32", tmp_path / "engine", "onnxruntime", "cpu", None, BuildConfig())
    assert meta.precision == "fp32"
