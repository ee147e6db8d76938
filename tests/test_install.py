"""The README's install for users, as written, in a fresh virtual environment: the base package alone (no extras)
runs the demo, and nothing of CUDA is downloaded for it."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def readme_install_for_users() -> list[str]:
    """The README's `pip install ... . && kiln run` line: the install without `-e` and without extras."""
    text = (REPO / "README.md").read_text()
    for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.M | re.S):
        for line in block.splitlines():
            install, _, then = line.partition(" && ")
            args = shlex.split(install)
            if args[:2] == ["pip", "install"] and args[-1] == "." and then.strip() == "kiln run":
                return args
    raise AssertionError("README.md has no `pip install ... . && kiln run` line")


@pytest.mark.slow
@pytest.mark.long
def test_the_base_package_alone_runs_the_demo_without_cuda_downloads(tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    bin_dir = env_dir / "bin"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    # An index this machine cannot reach (no DNS) is skipped at once instead of after pip's five retries.
    env["PIP_RETRIES"] = "0"
    # The README's arguments, given to this environment's pip aimed at the new one (--python: the same resolution
    # and files as the new one's own pip, without first installing pip there). --no-compile: byte-compiling every
    # installed module (torch's thousands) is much of the install's time and nothing this test checks.
    pip, args = [sys.executable, "-m", "pip", "--python", str(bin_dir / "python")], readme_install_for_users()
    assert args[:2] == ["pip", "install"]
    install = subprocess.run(
        [*pip, "install", "--no-compile", *args[2:]], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-3000:]
    listed = subprocess.run([*pip, "list", "--format=json"], env=env, capture_output=True, text=True)
    names = {p["name"].lower() for p in json.loads(listed.stdout)}
    assert not {n for n in names if n.startswith("nvidia-")}, sorted(names)  # the CPU build of torch
    assert "pytest" not in names and "kiln" in names  # the base set: no extras came with it
    demo = tmp_path / "demo"
    demo.mkdir()
    run = subprocess.run([str(bin_dir / "kiln"), "run"], cwd=demo, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert "Traceback" not in run.stderr
    report = json.loads((demo / "kiln-out" / "report.json").read_text())
    assert report["validation"]["passed"], report["validation"]
