"""A command stopped by Ctrl-C or SIGTERM: its fix line says what that command kept (`kiln loadtest` writes its
report only once its last level finishes, not after finished stages as `kiln run` resumes)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from kiln.cli import main


@pytest.mark.parametrize("sigterm, code", [(True, 143), (False, 130)])
def test_a_stopped_loadtest_says_it_kept_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sigterm: bool, code: int
) -> None:
    import kiln.core.interrupt as interrupt
    import kiln.serve.loadtest as loadtest

    def stopped(*args, **kw) -> None:  # a signal while the only level runs
        raise KeyboardInterrupt

    monkeypatch.setattr(loadtest, "loadtest", stopped)
    monkeypatch.setattr(interrupt, "by_sigterm", lambda: sigterm)
    args = ["loadtest", "http://127.0.0.1:8000", "-e", str(tmp_path), "--model", "m", "-o", str(tmp_path / "lt")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == code, result.output
    fix = [line for line in result.output.splitlines() if line.startswith("fix:")]
    assert len(fix) == 1 and "kiln loadtest" in fix[0] and "kiln run" not in fix[0], result.output
    assert "only once its last concurrency level finishes" in fix[0], result.output
