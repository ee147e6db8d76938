"""README examples run as tests: the config example and the serving snippet must stay true."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

README = Path(__file__).resolve().parents[1] / "README.md"


def code_blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_commands_are_the_ci_commands() -> None:
    bash = "\n".join(code_blocks("bash"))
    ci = (README.parent / ".ci" / "run").read_text()
    assert 'pip install "torch==2.13.0" -e ".[dev]" && kiln run' in bash
    assert "python -m pytest -q" in bash and "python -m pytest -q" in ci and "kiln run" in ci


def user_files() -> dict[str, str]:
    """The README's user-project snippets, by the file name on their first line (``# models/mine.py ...``)."""
    files = {}
    for block in code_blocks("python"):
        first = block.splitlines()[0]
        if first.startswith("# ") and first.split()[1].endswith(".py"):
            files[first.split()[1]] = block
    return files


@pytest.fixture(scope="module")
def readme_project(tmp_path_factory) -> Path:
    """The README's config example as a user's project folder (its model and data modules from the README), run
    with `kiln run` from that folder in a fresh process, as a user would."""
    tmp = tmp_path_factory.mktemp("readme")
    for name, text in user_files().items():
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_text(text)
    (tmp / "models" / "__init__.py").touch()
    cfg = yaml.safe_load(code_blocks("yaml")[0])
    scope: dict = {}
    exec(compile(user_files()["models/mine.py"], "README.md", "exec"), scope)
    model = scope["build"](**cfg["model"]["params"])
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp / cfg["model"]["checkpoint"]))
    # The README's gates assume a trained model; random weights are fine for agreement with PyTorch itself.
    cfg["validate"].update({"batch_sizes": [1, 8], "iterations": 3, "warmup": 1, "max_samples": 64})
    cfg["validate"]["gates"]["max_accuracy_drop"] = 1.0
    cfg["build"] = {"backends": ["onnxruntime"]}
    (tmp / "my.yaml").write_text(yaml.safe_dump(cfg))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [str(Path(sys.executable).with_name("kiln")), "run", "my.yaml", "-w", "kiln-out", "--quiet"],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return tmp


def test_readme_config_example_runs(readme_project: Path) -> None:
    import json

    report = json.loads((readme_project / "kiln-out" / "report.json").read_text())
    assert report["stages"]["train"]["status"] == "skipped"  # a checkpoint was given
    assert report["validation"]["passed"]


@pytest.fixture
def in_project(readme_project: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This process as if started in the project's folder: its modules first on sys.path, none cached."""
    monkeypatch.chdir(readme_project)
    monkeypatch.syspath_prepend(str(readme_project))
    for name in [m for m in sys.modules if m in ("models", "mydata") or m.startswith("models.")]:
        monkeypatch.delitem(sys.modules, name)
    return readme_project


def test_readme_python_api_example(in_project: Path) -> None:
    snippet = next(b for b in code_blocks("python") if "run_pipeline(" in b)
    scope: dict = {"batch": np.random.default_rng(0).random((4, 1, 8, 8), dtype=np.float32)}
    exec(compile(snippet, "README.md", "exec"), scope)
    assert scope["report"]["ok"] and scope["result"].error is None
    assert {r.status for r in scope["result"].records} == {"cached"}  # the run above, reused
    assert scope["scores"].shape == (4, 4) and np.isfinite(scope["scores"]).all()


def test_readme_serving_snippet(in_project: Path) -> None:
    snippet = next(b for b in code_blocks("python") if "load_engine" in b and "run_pipeline" not in b)
    scope: dict = {"batch": np.random.default_rng(0).random((4, 1, 8, 8), dtype=np.float32)}
    exec(compile(snippet, "README.md", "exec"), scope)
    assert scope["logits"].shape == (4, 4) and np.isfinite(scope["logits"]).all()


def _section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"## {title}\n")
    return text[start : text.index("\n## ", start + 1)]


def _blocks(section: str, lang: str) -> dict[str, str]:
    """A section's code blocks of ``lang`` by the file name in their first-line comment."""
    return {
        b.splitlines()[0].split()[1].rstrip(":"): b for b in re.findall(rf"```{lang}\n(.*?)```", section, flags=re.S)
    }


def test_readme_bring_your_own_model_examples(tmp_path: Path) -> None:
    """The two worked examples: the BERT module through `kiln run`, then its ONNX export through `kiln run` with
    model.onnx and through the direct commands, each in a fresh process from the project folder."""
    pytest.importorskip("transformers")
    section = _section("Bring your own model")
    (tmp_path / "textcls.py").write_text(_blocks(section, "python")["textcls.py"])
    quick = {"warmup": 1, "iterations": 3, "max_samples": 64}
    for name, text in _blocks(section, "yaml").items():
        cfg = yaml.safe_load(text)
        cfg["validate"].update(quick)
        cfg["build"] = {"backends": ["onnxruntime"]}
        (tmp_path / name).write_text(yaml.safe_dump(cfg))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    kiln = str(Path(sys.executable).with_name("kiln"))

    def run(*args: str) -> subprocess.CompletedProcess:
        out = subprocess.run([kiln, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, " ".join(args) + "\n" + out.stdout[-2000:] + out.stderr[-3000:]
        return out

    run("run", "textcls.yaml", "-w", "textcls-out", "--quiet")
    import json

    v = json.loads((tmp_path / "textcls-out" / "validate" / "validation.json").read_text())
    assert (
        v["passed"] and v["baseline"]["shapes"] == [{"seq": 8}, {"seq": 16}] and v["baseline"]["compared"] == ["logits"]
    )
    # the direct commands' inputs: the run's ONNX export and the validation split as named arrays
    import shutil

    shutil.copy(tmp_path / "textcls-out" / "export" / "model.onnx", tmp_path / "x.onnx")
    sys.path.insert(0, str(tmp_path))
    try:
        val = __import__("textcls").load().val_x
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("textcls", None)
    np.savez(tmp_path / "d.npz", **{k: t.numpy() for k, t in val.items()})
    commands = [
        ln.split() for ln in next(iter(_blocks(section, "bash").values())).splitlines() if ln.startswith("kiln ")
    ]
    assert [c[1] for c in commands] == ["run", "precision", "build", "validate"]
    for command in commands:
        run(
            *command[1:],
            *(["--quiet"] if command[1] != "validate" else []),
            *(["--set", "validate.iterations=3", "--set", "validate.warmup=1"] if command[1] == "validate" else []),
        )
    v = json.loads((tmp_path / "fromonnx-out" / "validate" / "validation.json").read_text())
    assert v["passed"] and v["baseline"]["backend"] == "onnxruntime"
