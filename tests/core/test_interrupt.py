"""Ctrl-C stops a command even where Python drops the KeyboardInterrupt (a finalizer), with exit 130."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from kiln.core import interrupt


def test_a_ctrl_c_swallowed_by_a_finalizer_is_raised_at_the_next_check() -> None:
    previous, report = signal.getsignal(signal.SIGINT), sys.unraisablehook
    with interrupt.handled():
        interrupt.check()  # nothing came
        try:  # what a weakref callback does with the KeyboardInterrupt: Python prints "Exception ignored"
            os.kill(os.getpid(), signal.SIGINT)
            signal.pthread_sigmask(signal.SIG_BLOCK, [])  # a bytecode boundary for the handler to run at
        except KeyboardInterrupt:
            pass
        with pytest.raises(KeyboardInterrupt):
            interrupt.check()
        interrupt.check()  # raised once: a later run in this process is not stopped by it
    assert signal.getsignal(signal.SIGINT) is previous and sys.unraisablehook is report  # both given back


def test_ctrl_c_in_a_command_is_one_error_and_exit_130(tmp_path) -> None:
    """In a real process (SIGINT to itself while the command runs): no traceback, no "Aborted!", exit 130."""
    script = textwrap.dedent(
        """
        import os, signal, sys
        import kiln.cli as cli
        def interrupted(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGINT)
            signal.pthread_sigmask(signal.SIG_BLOCK, [])
        cli._run = interrupted
        cli.main(["run", "-w", sys.argv[1]])
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "wd")], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 130, done.stderr
    assert done.stderr.splitlines()[-2:] == [
        "error: interrupted (Ctrl-C)",
        "fix: run the same command again: what it finished is kept (`kiln run` resumes after its finished stages)",
    ]
    assert "Traceback" not in done.stderr and "Aborted" not in done.stderr
