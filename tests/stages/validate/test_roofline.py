"""The roofline: achieved TFLOP/s at p50 beside the device's GEMM peak, measured once per device and cached."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.core.records import EngineValidation, Percentiles
from kiln.stages.validate import roofline as rl


def entry(precision: str, p50_ms: float) -> EngineValidation:
    lat = Percentiles(p50=p50_ms, p90=p50_ms, p99=p50_ms)
    return EngineValidation(
        name="e", backend="torch", precision=precision, device="cuda", status="validated", latency_ms={"32": lat}
    )


def test_achieved_tflops_and_share_of_the_peaks() -> None:
    peak = {"measured": {"fp16": 100.0, "fp32": 20.0}, "datasheet": {"fp16": 989.0}}
    row = rl.roofline(entry("fp16", 10.0), int(1e9), peak)["32"]  # 32 GFLOP in 10 ms: 3.2 TFLOP/s
    assert row["tflops"] == pytest.approx(3.2) and row["peak"] == "fp16"
    assert row["pct_of_measured_peak"] == pytest.approx(3.2) and row["pct_of_datasheet"] == pytest.approx(0.3236)
    assert rl.sig(1.23456e-4) == 1.235e-4  # four significant figures, never rounded to 0 on a slow machine
    int8 = rl.roofline(entry("int8", 10.0), int(1e9), peak)["32"]  # no INT8 peak measured: FP16's stands in
    assert int8["peak"] == "fp16" and int8["pct_of_datasheet"] is None
    cpu = rl.roofline(entry("int8", 10.0), int(1e9), {"measured": {"fp32": 2.0}})["32"]  # not FP32's (160 %)
    assert cpu["peak"] == "int8" and cpu["pct_of_measured_peak"] is None and cpu["tflops"] == pytest.approx(3.2)


def test_the_peak_is_measured_once_per_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(rl, "_measure", lambda device: calls.append(device) or {"fp32": 1.5})
    first = rl.peak_tflops("cpu", tmp_path)
    again = rl.peak_tflops("cpu", tmp_path)
    assert first == again and first["measured"] == {"fp32": 1.5} and calls == ["cpu"]
    assert (tmp_path / "peak.json").is_file()


def test_a_real_cpu_gemm_peak_is_positive_and_below_the_physical_floor() -> None:
    """2 x 1024^3 FLOPs per GEMM: a CPU at more than 100 TFLOP/s would be a timing bug."""
    assert 0 < rl._measure("cpu")["fp32"] < 100
