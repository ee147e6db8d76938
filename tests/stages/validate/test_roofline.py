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


def test_flops_of_an_audit_that_left_nodes_uncounted_are_a_lower_bound() -> None:
    """An audit that counted a quarter of the compute nodes (an STFT model's head alone): its FLOPs, and the TFLOP/s
    from them, are a floor, said in every row; an audit that counted them all says they are not."""
    peak = {"measured": {"fp32": 2.0}}
    partial = rl.roofline(entry("fp32", 10.0), 160, peak, covers=0.25)["32"]
    assert partial["flops_lower_bound"] is True
    assert rl.roofline(entry("fp32", 10.0), 160, peak)["32"]["flops_lower_bound"] is False


def test_a_cpu_peak_is_measured_on_every_core_whatever_torch_runs_on_now(monkeypatch: pytest.MonkeyPatch) -> None:
    """A busy machine lowers PyTorch to one thread while ONNX Runtime's engines take every core: a one-thread peak
    put them at 300 % of it. The peak and its device name take every core; PyTorch's own setting is given back."""
    import torch

    seen: list[int] = []
    monkeypatch.setattr(rl, "_best_seconds", lambda fn, device: seen.append(torch.get_num_threads()) or 1.0)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rl._measure("cpu")
        assert seen == [rl.cpu_threads()] and torch.get_num_threads() == 1
        assert rl.device_name("cpu").endswith(f"x{rl.cpu_threads()} threads")
    finally:
        torch.set_num_threads(before)


def test_the_report_marks_figures_from_a_count_that_left_nodes_out() -> None:
    from kiln.stages.validate.report import at_least

    assert at_least({"flops_lower_bound": True}) == "≥ " and at_least({"flops_lower_bound": False}) == ""
    assert at_least({}) == ""  # a record from before the field
