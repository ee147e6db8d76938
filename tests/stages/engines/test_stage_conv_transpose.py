"""An INT8 engine ONNX Runtime's CPU provider would run in float because it has no integer kernel for the model's
ConvTranspose layers: the build skips it with a warning whose fix names that op, not the precision settings."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import QuantFormat, quantize_static
from onnxruntime.quantization.calibrate import CalibrationDataReader

from kiln.core.records import PrecisionVariant, Variants
from kiln.pipeline.config import config_from_dict
from kiln.stages.engines import stage
from kiln.stages.engines.config import BuildConfig
from kiln.stages.engines.stage import MislabelledEngine, build_direct
from tests.conftest import stage_context

KERNEL_FIX = (
    "ONNX Runtime's CPU provider has no integer kernel for ConvTranspose: its int8 engine would run it in float; "
    "use nn.Upsample + Conv2d for integer convolutions on the CPU, build int8 on a GPU backend (TensorRT), or leave "
    "int8 out of precision.variants"
)


def upsampler() -> onnx.ModelProto:
    """x [batch, 4, 4, 4] -> ConvTranspose2d(4, 4, 2, stride 2) -> ReLU -> ConvTranspose2d(4, 3, 2, stride 2)."""
    rng = np.random.default_rng(0)
    weights = [rng.standard_normal(s).astype(np.float32) * 0.3 for s in ((4, 4, 2, 2), (4, 3, 2, 2))]
    nodes = [
        helper.make_node("ConvTranspose", ["x", "w1"], ["h"], name="up1", strides=[2, 2]),
        helper.make_node("Relu", ["h"], ["a"], name="act"),
        helper.make_node("ConvTranspose", ["a", "w2"], ["y"], name="up2", strides=[2, 2]),
    ]
    graph = helper.make_graph(
        nodes,
        "upsampler",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3, 16, 16])],
        [numpy_helper.from_array(w, f"w{i + 1}") for i, w in enumerate(weights)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


class _Rows(CalibrationDataReader):
    def __init__(self) -> None:
        rng = np.random.default_rng(1)
        self.rows = iter({"x": rng.standard_normal((1, 4, 4, 4)).astype(np.float32)} for _ in range(4))

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self.rows, None)


def _variants(root: Path) -> Path:
    """A precision stage's folder: the FP32 upsampler and its INT8 Q/DQ graph (ONNX Runtime's static quantizer)."""
    for p in ("fp32", "int8"):
        (root / p).mkdir(parents=True)
    onnx.save(upsampler(), str(root / "fp32" / "model.onnx"))
    quantize_static(
        str(root / "fp32" / "model.onnx"), str(root / "int8" / "model.onnx"), _Rows(), quant_format=QuantFormat.QDQ
    )
    variants = {p: PrecisionVariant(path=f"{p}/model.onnx") for p in ("fp32", "int8")}
    Variants(variants=variants).write(root / "variants.json")
    return root


def _ctx(tmp_path: Path) -> Any:
    cfg = config_from_dict({"build": {"backends": ["onnxruntime"]}, "precision": {"variants": ["fp32", "int8"]}})
    (tmp_path / "out").mkdir()
    precision = _variants(tmp_path / "precision")
    return stage_context("build", cfg, tmp_path, tmp_path / "out", {"precision": precision}, log=logging.getLogger("t"))


def test_the_run_warns_that_the_cpu_has_no_integer_conv_transpose(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The skip is said at warning level (the user asked for int8), with the op's fix; not "keep fewer nodes in
    float, quantize their op types": none was kept and ConvTranspose is among calibration.op_types."""
    with caplog.at_level(logging.INFO, logger="t"):
        summary = stage.run(_ctx(tmp_path))
    assert [e.name for e in summary.engines] == ["onnxruntime-cpu-fp32"]
    (skip,) = [s for s in summary.skipped if s.startswith("onnxruntime-cpu-int8: ")]
    assert "ConvTranspose x2 run in float" in skip and skip.endswith(f"(fix: {KERNEL_FIX})"), skip
    assert "calibration.op_types" not in skip and "keep fewer" not in skip
    (said,) = [r for r in caplog.records if "skipping onnxruntime-cpu-int8" in r.getMessage()]
    assert said.levelno == logging.WARNING and KERNEL_FIX in said.getMessage()


def test_kiln_build_of_the_int8_variant_is_told_of_the_missing_kernel(tmp_path: Path) -> None:
    """``kiln build variants/int8`` (exit 2): the fix names ConvTranspose's missing kernel."""
    root = _variants(tmp_path / "v")
    with pytest.raises(MislabelledEngine, match="computes 0% in int8") as err:
        build_direct(root / "int8", tmp_path / "engine", "onnxruntime", "cpu", None, BuildConfig())
    assert err.value.hint == KERNEL_FIX


def test_a_runtime_without_kernels_of_the_precision_stays_an_info() -> None:
    """ORT CPU's FP16 engine is a fact of a runtime with no FP16 kernels: said at info, its fix "none needed"; an
    INT8 engine short of int8 with a ConvTranspose left in float but most of its FLOPs elsewhere is the graph's."""
    from kiln.stages.engines.stage import refusal_fix

    fp16 = {"share": {"fp32": 1.0}, "share_floor": {"fp32": 1.0}, "method": "engine graph, by FLOPs"}
    fix, warn = refusal_fix(MislabelledEngine("m", audit=fp16), PrecisionVariant(path="p"), "p", "fp16", "cpu")
    assert not warn and fix.startswith("none needed")
    few = {
        **fp16,
        "share": {"int8": 0.2, "fp32": 0.8},
        "float_behind_dq": {"ConvTranspose": 1},
        "float_behind_dq_share": 0.1,
    }
    few["share_floor"] = few["share"]
    fix, warn = refusal_fix(MislabelledEngine("m", audit=few), PrecisionVariant(path="p"), "p", "int8", "cpu")
    assert not warn and "calibration.op_types" in fix
    fix, warn = refusal_fix(
        MislabelledEngine("m", audit={**few, "float_behind_dq_share": 0.5}),
        PrecisionVariant(path="p"),
        "p",
        "int8",
        "cpu",
    )
    assert warn and fix == KERNEL_FIX
