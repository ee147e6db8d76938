"""What the CLI says on stderr is one line a message where stderr is a pipe or a file (a CI log), as its log lines
are: grep finds a whole message, which rich would otherwise wrap at 80 columns."""

from types import SimpleNamespace

import pytest

from kiln.cli import _say_what_changed, console

LONG = ", ".join(f"config.build.graph_engines_{i}" for i in range(8))


def test_a_rerun_reason_is_one_line_when_piped(capsys: pytest.CaptureFixture[str]) -> None:
    _say_what_changed([SimpleNamespace(name="precision", status="ran", changed=["code", LONG])])
    err = capsys.readouterr().err
    assert err == f"precision ran again: changed since the last run: code, {LONG}\n"


def test_a_long_stderr_message_is_one_line_when_piped(capsys: pytest.CaptureFixture[str]) -> None:
    console.print(f"[yellow]precision variant int8 not made[/], the others were built: {LONG}")
    assert capsys.readouterr().err.count("\n") == 1
