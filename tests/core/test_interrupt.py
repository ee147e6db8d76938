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


def test_sigterm_unwinds_as_ctrl_c_does_and_says_which_signal_came() -> None:
    """SIGTERM (`timeout`, CI, `docker stop`) ended the process on the spot, its staging folders and scratch left
    behind; inside the block it raises KeyboardInterrupt through the same cleanups, and says it was SIGTERM."""

    def unhandled(signum: int, frame: object) -> None:  # not Python's default here: that would end pytest
        raise AssertionError("SIGTERM not handled by interrupt.handled()")

    previous = signal.signal(signal.SIGTERM, unhandled)
    cleaned = []
    try:
        _unwind_by_sigterm(cleaned)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _unwind_by_sigterm(cleaned: list[bool]) -> None:
    previous = signal.getsignal(signal.SIGTERM)
    with interrupt.handled():
        with pytest.raises(KeyboardInterrupt):
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                signal.pthread_sigmask(signal.SIG_BLOCK, [])
            finally:
                cleaned.append(True)
        assert interrupt.last_signal() == signal.SIGTERM and interrupt.by_sigterm() and cleaned
        with pytest.raises(KeyboardInterrupt):  # swallowed (a finalizer): raised again at the next check
            interrupt.check()
    assert signal.getsignal(signal.SIGTERM) is previous
    assert interrupt.by_sigterm()  # still said after the block, for the command's error
    with interrupt.handled():  # a new block starts with no signal seen
        assert interrupt.last_signal() is None


def test_a_handler_installed_inside_the_block_wins_and_ours_comes_back() -> None:
    """`kiln serve` installs its own SIGINT/SIGTERM handlers (a graceful stop) inside the command's block."""
    previous = signal.getsignal(signal.SIGTERM)
    with interrupt.handled():
        own = signal.signal(signal.SIGTERM, lambda *a: None)  # serve's _StopRequest
        os.kill(os.getpid(), signal.SIGTERM)
        signal.pthread_sigmask(signal.SIG_BLOCK, [])  # nothing raised: serve's handler ran
        signal.signal(signal.SIGTERM, own)
    assert signal.getsignal(signal.SIGTERM) is previous


def test_sigterm_in_a_command_is_one_error_and_exit_143(tmp_path) -> None:
    script = textwrap.dedent(
        """
        import os, signal, sys
        import kiln.cli as cli
        def terminated(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGTERM)
            signal.pthread_sigmask(signal.SIG_BLOCK, [])
        cli._run = terminated
        cli.main(["run", "-w", sys.argv[1]])
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "wd")], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 143, (done.returncode, done.stderr)
    assert done.stderr.splitlines()[-2:] == [
        "error: stopped by SIGTERM (what `timeout`, `kill`, CI runners and `docker stop` send)",
        "fix: run the same command again, with more time if a time limit sent it: what it finished is kept (`kiln "
        "run` resumes after its finished stages)",
    ]
    assert "Traceback" not in done.stderr


def test_a_forked_worker_stopped_by_sigterm_ends_as_it_would_have() -> None:
    """A child forked inside the block (multiprocessing, a DataLoader's workers) inherits the handler; its parent's
    SIGTERM (Process.terminate) must still end it, not raise in it and print a traceback."""
    script = textwrap.dedent(
        """
        import os, signal, time
        from kiln.core import interrupt
        with interrupt.handled():
            child = os.fork()
            if child == 0:
                time.sleep(30)
                os._exit(0)
            time.sleep(0.5)
            os.kill(child, signal.SIGTERM)
            _, status = os.waitpid(child, 0)
        print(os.WIFSIGNALED(status) and os.WTERMSIG(status))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == str(int(signal.SIGTERM)), (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr
