"""benchmarks/train_bench.py --smoke runs end to end on CPU and writes its JSON and Markdown."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


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
    assert set(res["targets"]) >= {"encoder_amp_at_least_2.8x", "kiln_within_5pct_of_bare"}
    assert "| bert_base | 8 | fp16 |" in (tmp_path / "train_smoke.md").read_text()
