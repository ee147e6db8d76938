"""benchmarks/train_bench.py --smoke runs end to end on CPU and writes its JSON and Markdown; the AMP target
is judged per mode (one mode beating 2.8x does not make the other pass)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _bench():
    spec = importlib.util.spec_from_file_location("train_bench", ROOT / "benchmarks" / "train_bench.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


@pytest.mark.timeout(180)
def test_train_bench_smoke(tmp_path: Path) -> None:
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "train_bench.py"), "--smoke", "--out", str(tmp_path)],
                   check=True, capture_output=True, text=True, env=env, timeout=170)
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
        return {"model": "bert_base", "batch": 64, "precision": precision, "kiln_vs_bare": kiln / bare,
                "bare": {"steps_per_s": bare, "peak_mb": None}, "kiln": {"steps_per_s": kiln, "peak_mb": None},
                "speedup_vs_fp32": {"bare": bare / 10.0, "kiln": kiln / 10.0}}

    rows = [row("fp32", 10.0, 10.0), row("fp16", 22.0, 21.7), row("bf16", 30.0, 29.0)]
    t = bench.targets(rows)
    assert t["encoder_amp_at_least_2.8x"] == {"fp16": False, "bf16": True}
    md = bench.markdown({"device": "x", "torch": "y", "warmup_steps": 8, "timed_steps": 32, "rounds": 3,
                         "rows": [dict(r, dataset_mb=1.0) for r in rows], "targets": t})
    assert "fp16 2.17x (NOT met), bf16 2.90x (met)" in md
    assert "(target >= 0.95: met)" in md
