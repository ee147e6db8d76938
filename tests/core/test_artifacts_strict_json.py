"""Kiln's JSON results (report.json, every file written through ``write_json_atomic``) are strict JSON: a NaN or
infinite metric is written as null, as pydantic writes ``validation.json``, not as a bare NaN/Infinity token."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from kiln.core.artifacts import write_json_atomic


def _refuse(token: str) -> None:
    raise ValueError(f"not strict JSON: {token}")


def test_non_finite_metrics_are_null(tmp_path: Path) -> None:
    report = {"max_abs_err": float("inf"), "cosine": float("nan"), "rel": [np.float64("-inf"), 0.5], "at": tmp_path}
    write_json_atomic(tmp_path / "report.json", report, sort_keys=False)
    got = json.loads((tmp_path / "report.json").read_text(), parse_constant=_refuse)
    assert got == {"max_abs_err": None, "cosine": None, "rel": [None, 0.5], "at": str(tmp_path)}
