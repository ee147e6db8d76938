"""kiln.stages.engines.tensorrt.errors.native_stdout_to_stderr: what native code prints to descriptor 1 during a
build lands on stderr, and stdout is itself again afterwards."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import pytest

from kiln.stages.engines.tensorrt.errors import native_stdout_to_stderr


def test_native_writes_to_stdout_land_on_stderr(capfd: pytest.CaptureFixture[str]) -> None:
    print("result before")
    with native_stdout_to_stderr():
        os.write(1, b"WARNING: raw write\n")
        ctypes.CDLL(None).printf(b"WARNING: from C stdio\n")  # buffered: a file, not a terminal
        subprocess.run([sys.executable, "-c", "print('WARNING: from a child')"], check=True)
    print("result after")
    out, err = capfd.readouterr()
    assert out.split() == ["result", "before", "result", "after"]
    assert "WARNING: raw write" in err and "WARNING: from C stdio" in err and "WARNING: from a child" in err


def test_nested_redirects_restore_stdout_once(capfd: pytest.CaptureFixture[str]) -> None:
    with native_stdout_to_stderr():
        with native_stdout_to_stderr():
            os.write(1, b"inner\n")
        os.write(1, b"outer\n")
    os.write(1, b"result\n")
    out, err = capfd.readouterr()
    assert out == "result\n" and err.split() == ["inner", "outer"]
