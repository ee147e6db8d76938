"""benchmarks/train_bench.py --smoke runs end to end on CPU and writes its JSON and Markdown; the AMP target
is judged per mode (one mode beating 2.8x does not make the other pass). The --compile table likewise, with
one tiny model and one precision (compiling on CPU takes most of its time)."""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # the training benchmark script, in its own process

ROOT = Path(__file__).resolve().parents[3]


def _bench():
    spec = importlib.util.spec_from_file_location("train_bench", ROOT / "benchmarks" / "train_bench.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def test_train_bench_smoke(tmp_path: Path) -> None:
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "train_bench.py"), "--smoke", "--out", str(tmp_path)],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    )
    res = json.loads((tmp_path / "train_smoke.json").read_text())
    cells = {(r["model"], r["precision"]) for r in res["rows"]}
    assert cells == {(m, p) for m in ("bert_base", "resnet18") for p in ("fp32", "fp16", "bf16")}
    for r in res["rows"]:
        assert r["bare"]["steps_per_s"] > 0 and r["kiln"]["steps_per_s"] > 0
        assert len(r["bare"]["rounds_steps_per_s"]) == len(r["kiln"]["rounds_steps_per_s"]) == res["rounds"]
    assert set(res["targets"]["encoder_amp_at_least_2.8x"]) == {"fp16", "bf16"}
    assert "| bert_base | 8 | fp16 |" in (tmp_path / "train_smoke.md").read_text()


def test_amp_target_is_judged_per_mode() -> None:
    bench = _bench()

    def row(precision: str, bare: float, kiln: float) -> dict:
        return {
            "model": "bert_base",
            "batch": 64,
            "precision": precision,
            "kiln_vs_bare": kiln / bare,
            "bare": {"steps_per_s": bare, "peak_mb": None},
            "kiln": {"steps_per_s": kiln, "peak_mb": None},
            "speedup_vs_fp32": {"bare": bare / 10.0, "kiln": kiln / 10.0},
        }

    rows = [row("fp32", 10.0, 10.0), row("fp16", 22.0, 21.7), row("bf16", 30.0, 29.0)]
    t = bench.targets(rows)
    assert t["encoder_amp_at_least_2.8x"] == {"fp16": False, "bf16": True}
    md = bench.markdown(
        {
            "device": "x",
            "torch": "y",
            "warmup_steps": 8,
            "timed_steps": 32,
            "rounds": 3,
            "rows": [dict(r, dataset_mb=1.0) for r in rows],
            "targets": t,
        }
    )
    assert "fp16 2.17x (NOT met), bf16 2.90x (met)" in md
    assert "(target >= 0.95: met)" in md


def test_train_bench_compile_smoke(tmp_path: Path) -> None:
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "train_bench.py"),
            "--smoke",
            "--compile",
            "--models",
            "bert_base",
            "--precisions",
            "bf16",
            "--windows",
            "2",
            "--phases",
            "--out",
            str(tmp_path),
        ],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    )
    res = json.loads((tmp_path / "train_compile_smoke_bert_base.json").read_text())
    (row,) = res["rows"]
    assert (row["model"], row["precision"]) == ("bert_base", "bf16")
    for loop in ("kiln", "bare", "kiln_compiled", "bare_compiled"):  # interleaved: one figure per window
        assert row[loop]["steps_per_s"] > 0 and len(row[loop]["windows_steps_per_s"]) == 2
    c = row["kiln_compiled"]["compile"]
    assert c["compiled"] and c["fallback"] is None and row["kiln_compiled"]["fallbacks"] == []
    assert row["compile_gain_anchor"] == 1.17 and res["targets"]["fallbacks"] == 0
    lo, hi = row["kiln_compiled_vs_bare_compiled_ci95"]
    assert lo <= row["kiln_compiled_vs_bare_compiled"] <= hi
    md = (tmp_path / "train_compile_smoke_bert_base.md").read_text()
    assert "| bert_base | 8 | bf16 |" in md
    # --phases: host ms per part of the step, for both loops and both modes, inside the timed windows
    for mode in ("phases", "phases_compiled"):
        kiln, bare = row[mode]["kiln"], row[mode]["bare"]
        assert set(kiln) == {"forward", "loss_backward", "tail", "between"} and "data" in bare
        assert all(v > 0 for v in (*kiln.values(), *bare.values()))
    assert "| bert_base | bf16 | compiled | kiln |" in md


def test_compile_target_is_judged_per_cell_and_a_missing_transformers_is_a_note(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bench = _bench()

    def row(model: str, kc: float, bc: float) -> dict:
        cell = {
            "steps_per_s": kc,
            "step_peak_mb": None,
            "fallbacks": [],
            "compile": {"graphs": 2, "recompiles": 1, "graph_breaks": 0},
        }
        return {
            "model": model,
            "batch": 64,
            "precision": "fp16",
            "kiln": {"steps_per_s": 10.0, "step_peak_mb": None},
            "bare": {"steps_per_s": 10.0, "step_peak_mb": None},
            "kiln_compiled": cell,
            "bare_compiled": {"steps_per_s": bc, "step_peak_mb": None},
            "kiln_vs_bare": 1.0,
            "kiln_compiled_vs_bare_compiled": kc / bc,
            "compile_gain_kiln": kc / 10.0,
            "compile_gain_bare": bc / 10.0,
            "compile_gain_anchor": 1.54,
        }

    rows = [row("bert_base", 15.0, 15.2), row("resnet18", 14.0, 15.0)]
    t = bench.compile_targets(rows)
    assert not t["kiln_compiled_at_least_0.97x_bare_compiled"] and t["worst_kiln_compiled_vs_bare_compiled"] == 0.933
    assert bench.compile_targets(rows[:1])["kiln_compiled_at_least_0.97x_bare_compiled"]
    md = bench.compile_markdown(
        {"device": "x", "torch": "y", "timed_steps": 24, "windows": 8, "rows": rows, "targets": t, "notes": []}
    )
    assert "(target >= 0.97: NOT met)" in md and "| 1.50x | 1.52x | 1.54x | 2 / 1 / 0 |" in md

    monkeypatch.setattr(bench, "has_transformers", lambda: False)
    res = bench.run_compile(True, 1, 1, ["bert_base_hf"], ("bf16",))
    assert res["rows"] == [] and "transformers does not import" in res["notes"][0]


def test_interleaved_windows_alternate_and_time_the_same_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Kiln's window and the bare loop's alternate within one process, each over --steps steps, in pairs."""
    bench = _bench()
    spec = bench.specs(True)["resnet18"]
    data = bench.make_data(spec, 4)
    order: list[tuple[str, int]] = []
    in_bare = False
    stop, bare_window = bench.Window.stop, bench.BareLoop.window

    def recorded_stop(self) -> None:  # which loop's window ended, and how many steps it timed
        stop(self)
        order.append(("bare" if in_bare else "kiln", len(self.marks)))

    def recorded_bare_window(self, steps: int, device: torch.device) -> dict:
        nonlocal in_bare
        in_bare = True
        try:
            return bare_window(self, steps, device)
        finally:
            in_bare = False

    monkeypatch.setattr(bench.Window, "stop", recorded_stop)
    monkeypatch.setattr(bench.BareLoop, "window", recorded_bare_window)
    got = bench.interleaved("resnet18", spec, data, "fp32", torch.device("cpu"), 3, 2, compile=False)
    assert order == [("kiln", 3), ("bare", 3), ("kiln", 3), ("bare", 3)]
    assert len(got["kiln"]) == len(got["bare"]) == 2
    assert (
        bench.paired_ratio([{"steps_per_s": 9.0}, {"steps_per_s": 4.0}], [{"steps_per_s": 10.0}, {"steps_per_s": 2.0}])
        == 1.45
    )


def test_the_ratio_interval_brackets_the_median_and_narrows_with_agreeing_windows() -> None:
    bench = _bench()
    bare = [100.0] * 8
    noisy = [90.0, 110.0, 95.0, 105.0, 88.0, 101.0, 97.0, 93.0]
    lo, hi = bench.ratio_interval(noisy, bare)
    assert lo <= statistics.median(k / b for k, b in zip(noisy, bare)) <= hi and hi - lo > 0.05
    assert bench.ratio_interval(noisy, bare) == (lo, hi)  # a fixed seed: the same windows, the same interval
    assert bench.ratio_interval([99.0] * 8, bare) == (0.99, 0.99)  # windows that agree leave nothing to resample
