"""Kiln installs one import package, ``kiln``: a user's project may have its own ``models/``, ``pipeline/``,
``stages/`` and ``calibration/`` packages, and ``import kiln`` needs neither TensorRT nor onnxruntime-gpu."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parents[1]
SETUPTOOLS = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]


def _clean_env() -> dict[str, str]:
    """The environment of a user's shell: the repository is not on sys.path (pytest may have put it there)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def test_every_source_folder_is_a_listed_package() -> None:
    """A new subpackage not listed in pyproject.toml would be missing from the wheel (editable installs hide it)."""
    listed = set(SETUPTOOLS["packages"])
    found = set()
    for package, folder in SETUPTOOLS["package-dir"].items():
        for init in (REPO / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / folder).parts
            found.add(".".join((package, *rel)))
    assert found == listed


def test_kiln_imports_without_tensorrt_or_onnxruntime_gpu(tmp_path: Path) -> None:
    """The user-facing names import on a machine with neither library: both are blocked at import time here."""
    code = textwrap.dedent("""
        import importlib.abc, sys
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("tensorrt", "tensorrt_rtx", "tensorrt_lean"):
                    raise ImportError(f"{name} is blocked for this test")
        sys.meta_path.insert(0, Block())
        import kiln
        from kiln import DatasetSplits, KilnConfig, load_config, load_engine, run_pipeline, KilnError
        import onnxruntime as ort
        assert "CUDAExecutionProvider" not in ort.get_available_providers()
        print("ok", sorted(kiln.__all__))
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=_clean_env(), capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stderr[-2000:]


def test_no_generic_top_level_names_are_installed(tmp_path: Path) -> None:
    """From a folder without them, `models`, `pipeline`, `stages` and `calibration` do not import."""
    code = (
        "import importlib.util as u; "
        "print([n for n in ('models', 'pipeline', 'stages', 'calibration') if u.find_spec(n)])"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=_clean_env(), capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


@pytest.mark.slow
def test_the_wheel_holds_only_kiln(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(REPO),
        ],
        capture_output=True,
        text=True,
        env=_clean_env(),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    (wheel,) = tmp_path.glob("kiln-*.whl")
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"kiln"}, tops
    names = zipfile.ZipFile(wheel).namelist()
    assert "kiln/pipeline/demo.yaml" in names and "kiln/stages/engines/stage.py" in names and "kiln/cli.py" in names


USER_PACKAGES = {
    "models/__init__.py": "",
    "models/mine.py": """
        import torch
        from torch import nn

        def build(hidden: int = 16) -> nn.Module:
            return nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 4))
    """,
    "pipeline/__init__.py": "",
    "pipeline/data.py": """
        import torch
        from kiln import DatasetSplits
        from stages.labels import label
        from calibration.noise import noise

        def load() -> DatasetSplits:
            g = torch.Generator().manual_seed(0)
            x = torch.rand(512, 1, 8, 8, generator=g) + noise(g)
            return DatasetSplits(x[:384], label(x[:384]), x[384:], label(x[384:]), num_classes=4)
    """,
    "stages/__init__.py": "",
    "stages/labels.py": """
        def label(x):
            return x[:, 0, 0, :4].argmax(-1)
    """,
    "calibration/__init__.py": "",
    "calibration/noise.py": """
        import torch

        def noise(g):
            return 0.01 * torch.randn(512, 1, 8, 8, generator=g)
    """,
}


@pytest.mark.slow
def test_a_project_with_its_own_models_pipeline_stages_calibration_packages_runs_end_to_end(tmp_path: Path) -> None:
    for rel, text in USER_PACKAGES.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(textwrap.dedent(text))
    (tmp_path / "kiln.yaml").write_text(
        textwrap.dedent("""
        name: user-project
        model: {name: "models.mine:build", params: {hidden: 16}}
        data: {name: "pipeline.data:load"}
        train: {epochs: 2, batch_size: 64}
        precision: {variants: [fp32]}
        build: {backends: [onnxruntime]}
        validate: {batch_sizes: [1, 8], warmup: 1, iterations: 3}
    """)
    )
    kiln = Path(sys.executable).with_name("kiln")
    out = subprocess.run(
        [str(kiln), "run", "kiln.yaml", "-w", "out", "--quiet"],
        cwd=tmp_path,
        env=_clean_env(),
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["validation"]["passed"] and report["stages"]["train"]["status"] == "ran"
