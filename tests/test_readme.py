"""README examples run as tests: the config example and the serving snippet must stay true."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import yaml
from click.testing import CliRunner
from kiln.cli import main
from kiln.models.registry import build_model

README = Path(__file__).resolve().parents[1] / "README.md"


def code_blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_commands_are_the_ci_commands() -> None:
    bash = "\n".join(code_blocks("bash"))
    ci = (README.parent / ".ci" / "run").read_text()
    assert 'pip install "torch==2.13.0" -e ".[dev]" && kiln run' in bash
    assert "python -m pytest -q" in bash and "python -m pytest -q" in ci and "kiln run" in ci


@pytest.fixture(scope="module")
def readme_run(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("readme")
    cfg = yaml.safe_load(code_blocks("yaml")[0])
    model = build_model(cfg["model"]["name"], cfg["model"]["params"])
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp / cfg["model"]["checkpoint"]))
    # The README's gates assume a trained model; random weights are fine for agreement with PyTorch itself.
    cfg["validate"].update({"batch_sizes": [1, 8], "iterations": 3, "warmup": 1, "max_samples": 64})
    cfg["validate"]["gates"]["max_accuracy_drop"] = 1.0
    (tmp / "kiln.yaml").write_text(yaml.safe_dump(cfg))
    result = CliRunner().invoke(main, ["run", str(tmp / "kiln.yaml"), "-w", str(tmp / "out"), "--quiet",
                                       "--set", "build.backends=[onnxruntime]"])
    assert result.exit_code == 0, result.output
    return tmp / "out"


def test_readme_config_example_runs(readme_run: Path) -> None:
    import json

    report = json.loads((readme_run / "report.json").read_text())
    assert report["stages"]["train"]["status"] == "skipped"  # a checkpoint was given
    assert report["validation"]["passed"]


def test_readme_serving_snippet(readme_run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    snippet = next(b for b in code_blocks("python") if "load_engine" in b)
    monkeypatch.chdir(readme_run.parent)
    (readme_run.parent / "kiln-out").symlink_to(readme_run)
    batch = np.random.default_rng(0).random((4, 1, 8, 8), dtype=np.float32)
    scope: dict = {"batch": batch}
    exec(compile(snippet, "README.md", "exec"), scope)
    assert scope["logits"].shape == (4, 10) and np.isfinite(scope["logits"]).all()
