"""Every test file is collected (pytest skips folders named 'build' by default); ``-m ""`` lists the slow tests too,
which the README's command deselects and .ci/run's second step runs. A session that collected the whole of
testpaths (as .ci/run's) already holds the answer (``tests.conftest.COLLECTED``, taken before deselection); another
(one file, a folder) asks a ``pytest --collect-only`` of its own."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import COLLECTED

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_every_test_file_is_collected() -> None:
    collected = set(COLLECTED)
    if not collected:
        out = subprocess.run(
            [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", ""],
            cwd=ROOT,
            capture_output=True,
            text=True,
        ).stdout
        collected = {line.split("::")[0] for line in out.splitlines() if "::" in line}
    files = {p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").rglob("test_*.py")}
    assert files - collected == set()
