"""The fix for an INT8 engine whose runtime left its quantized ops in float behind a DequantizeLinear
(``float_behind_dq``): it names those ops and what computes in integers instead, only where they are why the label
falls short (their share of the FLOPs, ``float_behind_dq_share``, would have made it hold)."""

from __future__ import annotations

from pathlib import Path

import onnx

from kiln.stages.precision.audit import engine_audit, kernel_fix
from tests.stages.precision.test_audit_engine_graph import ort_optimized, vocoder


def _audit(tmp_path: Path, conv: bool) -> dict:
    src = tmp_path / "voc.onnx"
    onnx.save(vocoder(conv=conv), str(src))
    return engine_audit(src, ort_optimized(src, tmp_path / "engine.onnx"), {"frames": 16})


def test_a_conv_transpose_left_in_float_is_the_fix(tmp_path: Path) -> None:
    audit = _audit(tmp_path, conv=False)
    assert audit["float_behind_dq"] == {"ConvTranspose": 1} and audit["float_behind_dq_share"] == 1.0
    assert kernel_fix(audit, "int8") == (
        "ONNX Runtime's CPU provider has no integer kernel for ConvTranspose: its int8 engine would run it in float; "
        "use nn.Upsample + Conv2d for integer convolutions on the CPU, build int8 on a GPU backend (TensorRT), or "
        "leave int8 out of precision.variants"
    )


def test_no_fix_where_the_label_holds_or_the_ops_are_not_why(tmp_path: Path) -> None:
    audit = _audit(tmp_path, conv=True)  # 60 % of its FLOPs in a QLinearConv: int8 holds
    assert audit["float_behind_dq_share"] == 0.4 and kernel_fix(audit, "int8") is None
    short = {**audit, "share": {"int8": 0.2, "fp32": 0.8}, "share_floor": {"int8": 0.2, "fp32": 0.8}}
    assert kernel_fix({**short, "float_behind_dq_share": 0.1}, "int8") is None  # 30 %: short without them too
    assert kernel_fix({**short, "float_behind_dq_share": 0.4}, "int8") is not None


def test_ops_it_has_kernels_for_but_did_not_fuse_are_said_apart() -> None:
    audit = {
        "share": {"fp32": 1.0},
        "method": "engine graph, by FLOPs",
        "float_behind_dq": {"ConvTranspose": 2, "Conv": 1},
        "float_behind_dq_share": 1.0,
    }
    fix = kernel_fix(audit, "int8") or ""
    assert fix.startswith(
        "ONNX Runtime's CPU provider has no integer kernel for ConvTranspose; it fused no integer kernel for the "
        "quantized Conv of this graph: its int8 engine would run them in float; use nn.Upsample + Conv2d"
    ), fix
