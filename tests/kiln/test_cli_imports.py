"""What `kiln --help`, `kiln config` and a config error load: none of the heavy libraries, and no stage or backend
code. A fresh interpreter each, as a user's shell starts one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HEAVY = ("torch", "onnx", "onnxruntime", "onnx_graphsurgeon", "tensorrt", "tensorrt_rtx", "transformers", "matplotlib")
PROBE = """
import json, sys
from click.testing import CliRunner
from kiln.cli import main
result = CliRunner().invoke(main, sys.argv[1:])
loaded = [m for m in sys.modules if m.split(".")[0] in {heavy} or m.startswith("kiln.stages.") and (
    m.endswith((".stage", ".build", ".runner", ".runtime", ".autotune", ".program")))]
print(json.dumps({{"code": result.exit_code, "loaded": sorted(loaded), "out": result.output[-500:]}}))
"""


@pytest.mark.parametrize(
    "args, code",
    [
        ([], 2),  # click: no command given, the usage and exit code 2
        (["--help"], 0),
        (["build", "--help"], 0),
        (["optimize", "--help"], 0),
        (["config"], 0),
        (["run", "missing.yaml"], 2),
        (["config", "--set", "train.epochz=3"], 2),
    ],
)
def test_answers_without_loading_torch_onnx_or_the_stages(tmp_path: Path, args: list[str], code: int) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(heavy=set(HEAVY)), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    got = json.loads(out.stdout.splitlines()[-1])
    assert got["code"] == code, got["out"]
    assert got["loaded"] == [], f"kiln {' '.join(args)} loaded {got['loaded']}"


@pytest.mark.parametrize("args", [["--help"], ["run", "--help"], ["build", "--help"]])
def test_help_loads_neither_yaml_nor_rich(tmp_path: Path, args: list[str]) -> None:
    """Help is click's own text: YAML (``kiln config``'s output) and rich (tables, progress, log lines) load with
    the commands that print through them."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(heavy={"yaml", "rich"}), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    got = json.loads(out.stdout.splitlines()[-1])
    assert got["code"] == 0, got["out"]
    assert [m for m in got["loaded"] if m.split(".")[0] in {"yaml", "rich"}] == [], got["loaded"]
