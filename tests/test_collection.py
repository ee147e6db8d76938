"""Every test file is collected (pytest skips folders named 'build' by default); ``-m ""`` lists the slow tests too,
which the README's command deselects and .ci/run's second step runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_every_test_file_is_collected() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", ""],
        cwd=ROOT,
        capture_output=True,
        text=True,
    ).stdout
    collected = {line.split("::")[0] for line in out.splitlines() if "::" in line}
    files = {p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").rglob("test_*.py")}
    assert files - collected == set()
