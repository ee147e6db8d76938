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
    monkeypatch.setattr(rl, "_measure", lambda device: calls.append(device) or ({"fp32": 1.5}, False))
    first = rl.peak_tflops("cpu", tmp_path)
    again = rl.peak_tflops("cpu", tmp_path)
    assert first == again and first["measured"] == {"fp32": 1.5} and calls == ["cpu"]
    assert (tmp_path / "peak.json").is_file()


def test_a_real_cpu_gemm_peak_is_positive_and_below_the_physical_floor() -> None:
    """2 x 1024^3 FLOPs per GEMM: a CPU at more than 100 TFLOP/s would be a timing bug."""
    assert 0 < rl._measure("cpu")[0]["fp32"] < 100


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
        assert seen[0] == rl.cpu_threads() and torch.get_num_threads() == 1
        assert rl.device_name("cpu").endswith(f"x{rl.cpu_threads()} threads")
    finally:
        torch.set_num_threads(before)


def test_the_report_marks_figures_from_a_count_that_left_nodes_out() -> None:
    from kiln.stages.validate.report import at_least

    assert at_least({"flops_lower_bound": True}) == "≥ " and at_least({"flops_lower_bound": False}) == ""
    assert at_least({}) == ""  # a record from before the field


def test_a_peak_measured_while_other_work_ran_is_not_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A peak measured on a busy machine is low (it put engines at 300 % of it): this run uses it, marked busy, and
    the next measures again rather than reading it from the cache for good."""
    calls: list[str] = []
    monkeypatch.setattr(rl, "_measure", lambda device: calls.append(device) or ({"fp32": 0.0331}, True))
    first = rl.peak_tflops("cpu", tmp_path)
    rl.peak_tflops("cpu", tmp_path)
    assert calls == ["cpu", "cpu"] and first["busy"] is True and first["measured"] == {"fp32": 0.0331}
    assert not (tmp_path / "peak.json").exists()


def test_a_peak_cached_by_the_earlier_method_is_measured_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A workdir's cache from before (one timing, cached however busy the machine was) is measured again, once."""
    import json

    name = rl.device_name("cpu")
    old = {name: {"measured": {"fp32": 0.0331}, "datasheet": {}, "gemm": 1024}}
    (tmp_path / "peak.json").write_text(json.dumps(old))
    monkeypatch.setattr(rl, "_measure", lambda device: ({"fp32": 0.19}, False))
    assert rl.peak_tflops("cpu", tmp_path)["measured"] == {"fp32": 0.19}
    assert json.loads((tmp_path / "peak.json").read_text())[name]["measured"] == {"fp32": 0.19}


def test_a_cpu_peak_whose_threads_lacked_their_cores_is_busy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The every-core run's threads got a third of the wall time (other work held the cores): busy; all of it: not."""
    monkeypatch.setattr(rl, "_measure_cpu", lambda n: (0.04, 0.3))
    assert rl._measure("cpu") == ({"fp32": 0.04}, True)
    monkeypatch.setattr(rl, "_measure_cpu", lambda n: (0.19, 0.98))
    assert rl._measure("cpu") == ({"fp32": 0.19}, False)


def test_the_cpu_peak_is_the_best_of_every_core_and_the_idle_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a loaded machine, fewer threads than cores can outrun every core (the others wait for time slices): the
    peak is the faster of the two."""
    import torch

    monkeypatch.setattr(rl, "cpu_threads", lambda: 2)
    monkeypatch.setattr(rl.os, "getloadavg", lambda: (1.5, 1.5, 1.5))  # one core taken: one thread also timed
    seconds = {2: 2.0, 1: 1.0}  # two threads twice as slow as one
    monkeypatch.setattr(rl, "_best_seconds", lambda fn, device: seconds[torch.get_num_threads()])
    rate, _ = rl._measure_cpu(100)
    assert rate == rl.sig(2 * 100**3 / 1.0 / 1e12)  # the share is timed: the test above gives it


def test_an_engine_faster_than_the_measured_peak_gets_no_share_of_it() -> None:
    """A peak measured low (0.0331 TFLOP/s) below an engine's 0.0986: no 297.9 % printed as a fact; the row says
    the engine outran it. An engine below the peak keeps its share."""
    peak = {"measured": {"fp32": 0.0331}}
    fast = rl.roofline(entry("fp32", 10.0), int(0.0986e12 * 0.01 / 32), peak)["32"]
    assert fast["pct_of_measured_peak"] is None and fast["above_measured_peak"] is True
    assert fast["tflops"] == pytest.approx(0.0986, rel=1e-3)
    slow = rl.roofline(entry("fp32", 10.0), int(0.0165e12 * 0.01 / 32), peak)["32"]
    assert slow["pct_of_measured_peak"] == pytest.approx(49.85, rel=1e-3) and slow["above_measured_peak"] is False


def test_the_report_says_an_engine_outran_a_peak_measured_while_other_work_ran() -> None:
    from kiln.core.records import Baseline, ValidationResult
    from kiln.stages.validate.report import report_section

    peak = {"device": "cpu", "measured": {"fp32": 0.0331}, "busy": True}
    fast = entry("fp32", 10.0)
    fast.roofline, fast.flops_per_sample = rl.roofline(fast, int(0.0986e12 * 0.01 / 32), peak), 3
    v = ValidationResult(
        passed=True, baseline=Baseline(accuracy=None, samples=8, latency_ms={}), engines=[fast], failures=[]
    )
    v.peaks = {"cuda": peak}
    lines = report_section(v)
    row = [x for x in lines if x.startswith("| e | ")][-1]  # the roofline table is the last to list it
    assert "| > 100 (fp32) |" in row, row
    assert "while other work ran" in next(x for x in lines if x.startswith("Peak TFLOP/s")), lines


def test_a_containers_cpu_limit_is_read_from_its_cgroup(tmp_path: Path) -> None:
    """Sixteen threads under a two-core limit get an eighth of the wall each on an idle host: the busy share counts
    the two cores the limit gives, not the threads."""
    limit = tmp_path / "cpu.max"
    limit.write_text("200000 100000\n")
    assert rl.cgroup_cores(limit) == 2.0
    limit.write_text("max 100000\n")
    assert rl.cgroup_cores(limit) is None
    assert rl.cgroup_cores(tmp_path / "absent") is None
