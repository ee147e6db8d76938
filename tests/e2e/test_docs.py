"""Every code block of the README and of docs/ runs here, as written, from an empty folder.

A block whose first line names a file (``# mine.py``, ``# my.yaml``) is that file of the doc's project; other Python
blocks run in the project's folder; every YAML block is a valid config; every ``kiln`` command of a ``bash`` block
runs in the project, except in the documents about hardware or servers this machine does not run, where each command
is checked against the options of the command it calls (``kiln``, the torchrun worker, a benchmark script).
The README's own run goes through the installed ``kiln`` command in a fresh process, as a user types it; the longer
guides' ``kiln`` commands go through the same CLI in this process (a fresh interpreter per command would import
torch and the guide's libraries again each time).
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import click
import pytest
import yaml

from kiln.cli import main
from kiln.pipeline.config import KilnConfig

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = [README, *sorted((REPO / "docs").glob("*.md")), REPO / "benchmarks" / "README.md"]
# documents whose commands need a GPU, several of them, or a server left running: checked, not run
CHECKED_ONLY = {"training.md", "serving.md", "development.md", "README.md (benchmarks)"}
KILN = str(Path(sys.executable).with_name("kiln"))


def blocks(path: Path) -> list[tuple[str, str]]:
    """(language, text) of each fenced block."""
    return re.findall(r"^```(\w*)\n(.*?)^```", path.read_text(), flags=re.M | re.S)


def named(text: str) -> str | None:
    """The file a block is, from its first line (``# mine.py: ...``)."""
    first = text.splitlines()[0] if text.strip() else ""
    found = re.match(r"#\s+([\w./-]+\.(?:py|yaml))\b", first)
    return found.group(1) if found else None


def commands(text: str) -> list[list[str]]:
    """A bash block's commands: continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [shlex.split(line, comments=True) for line in joined.splitlines() if shlex.split(line, comments=True)]


def label(path: Path) -> str:
    return f"{path.name} (benchmarks)" if path.parent.name == "benchmarks" else path.name


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # as a user's shell: the checkout is not on it
    out = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True)
    assert out.returncode == 0, " ".join(args) + "\n" + out.stdout[-2000:] + out.stderr[-3000:]
    return out


def project(tmp: Path, *docs: Path) -> Path:
    """The files the docs tell a user to write, written."""
    for doc in docs:
        for _, text in blocks(doc):
            name = named(text)
            if name:
                (tmp / name).parent.mkdir(parents=True, exist_ok=True)
                (tmp / name).write_text(text)
    return tmp


def run_kiln(args: list[str], folder: Path) -> None:
    """``kiln ARGS`` run from ``folder`` through the CLI in this process: the command-line parsing, the user's
    modules found in the folder, the exit code. The folder, ``sys.path`` and the user's modules are undone after."""
    from click.testing import CliRunner

    cwd, path, modules = os.getcwd(), list(sys.path), set(sys.modules)
    os.chdir(folder)
    try:
        result = CliRunner().invoke(main, args)
    finally:
        os.chdir(cwd)
        sys.path[:] = path
        for name in set(sys.modules) - modules:
            if str(getattr(sys.modules[name], "__file__", None) or "").startswith(str(folder)):
                del sys.modules[name]
    assert result.exit_code == 0, f"kiln {' '.join(args)}: {result.exception!r}\n{result.output[-3000:]}"


def run_block(lang: str, text: str, folder: Path) -> None:
    """One block of a doc that runs: its ``kiln`` commands (:func:`run_kiln`) and ``python`` scripts (a fresh
    process), or its Python (not a project file)."""
    if lang == "python" and not named(text):
        run([sys.executable, "-c", text], folder)
    elif lang == "bash":
        for args in commands(text):
            if args[0] == "kiln":
                run_kiln(args[1:], folder)
            elif args[0] == "python" and args[1].endswith(".py"):
                run([sys.executable, *args[1:]], folder)


@pytest.mark.parametrize("doc", DOCS, ids=label)
def test_every_block_has_a_language_and_every_yaml_block_is_a_config(doc: Path) -> None:
    for lang, text in blocks(doc):
        assert lang in ("python", "yaml", "bash") or (lang == "" and "->" in text), f"{doc.name}: ```{lang}"
        if lang == "yaml":
            KilnConfig.model_validate(yaml.safe_load(text) or {})  # keys and values: its files come from the run


@functools.cache
def _help(script: str) -> str:
    """A benchmark script's ``--help``, once per script (a doc quotes one script in several commands)."""
    return run([sys.executable, str(REPO / script), "--help"], REPO).stdout


def _check_command(args: list[str], doc: str) -> None:
    """A command this machine cannot run for real: its options are the options of what it calls."""
    if args[0] == "kiln":
        cmd = main.get_command(click.Context(main), args[1])
        assert cmd is not None, f"{doc}: no command `kiln {args[1]}`"
        cmd.make_context(args[1], list(args[2:]))  # parses and converts every option and argument
    elif args[0] == "torchrun":
        from kiln.stages.train import worker

        at = args.index("kiln.stages.train.worker")
        with pytest.raises(SystemExit) as done:
            worker.main([*args[at + 1 :], "--help"])
        assert done.value.code == 0
    elif args[0] == "python" and args[1] == "-m":
        paths = [a for prev, a in zip(args[2:], args[3:]) if not a.startswith("-") and prev not in ("-m", "-k", "-p")]
        assert args[2] == "pytest" and all((REPO / a).exists() for a in paths), args
    elif args[0] == "python" and args[1].startswith("benchmarks/"):
        help_text = _help(args[1])
        unknown = [a for a in args[2:] if a.startswith("--") and a.split("=")[0] not in help_text]
        assert not unknown, f"{doc}: {args[1]} has no {unknown}"
    elif args[0] == "bash" and args[1] == "benchmarks/gpu_session.sh":  # each phase is one of the script's cases
        script = (REPO / args[1]).read_text()
        assert all(re.search(rf"^\s+{re.escape(p)}\)", script, flags=re.M) for p in args[2:]), args
    elif args[0] not in ("pip", "ruff", "PYTHONPATH=/tmp/site"):
        raise AssertionError(f"{doc}: no check for `{' '.join(args)}`")


@pytest.mark.parametrize("doc", [d for d in DOCS if label(d) in CHECKED_ONLY], ids=label)
def test_commands_of_hardware_and_server_docs_take_their_options(
    doc: Path, readme_project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(readme_project)  # the files and folders they name (my.yaml, kiln-out) exist there
    for lang, text in blocks(doc):
        if lang == "bash":
            for args in commands(text):
                _check_command(args[1:] if args[0].startswith("PYTHONPATH=") else args, doc.name)


def test_the_readme_commands_are_the_ci_commands() -> None:
    bash = "\n".join(text for lang, text in blocks(README) if lang == "bash")
    ci = (REPO / ".ci" / "run").read_text()
    setup = 'pip install --extra-index-url https://download.pytorch.org/whl/cpu "torch==2.13.0" -e ".[dev]"'
    assert f"{setup} && kiln run" in bash
    assert setup.replace("pip install", "pip install -q") in ci and "kiln run" in ci
    assert "python -m pytest -q" in bash and "python -m pytest -q" in ci and "-m slow" in ci


@pytest.fixture(scope="module")
def readme_project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The README's own model, written as the README says and run as it says: `kiln run my.yaml`."""
    folder = project(tmp_path_factory.mktemp("readme"), README)
    # "In an empty folder, `mine.py` ... and `my.yaml`": those two files and nothing else (no weights, no data)
    assert sorted(p.name for p in folder.iterdir()) == ["mine.py", "my.yaml"]
    run([KILN, "run", "my.yaml"], folder)
    return folder


def test_the_readme_example_runs_as_written(readme_project: Path) -> None:
    import json

    report = json.loads((readme_project / "kiln-out" / "report.json").read_text())
    assert report["ok"] and report["validation"]["passed"] and report["stages"]["train"]["status"] == "ran"
    precisions = {e["precision"] for e in report["validation"]["engines"] if e["status"] == "validated"}
    assert precisions == {"fp32", "int8"}  # what the README says the run builds on the CPU


@pytest.mark.parametrize("doc", [README, REPO / "docs" / "engines.md"], ids=label)
def test_the_python_blocks_run_in_the_readme_project(readme_project: Path, doc: Path) -> None:
    for lang, text in blocks(doc):
        if lang == "python" and not named(text):
            run([sys.executable, "-c", text], readme_project)


@pytest.mark.long
def test_the_bring_your_own_model_guide_runs_as_written(tmp_path: Path) -> None:
    """docs/byom.md: the BERT module through `kiln run`, then its ONNX export through `kiln run` from the ONNX file
    and through the direct commands, each from the project's folder (:func:`run_kiln`)."""
    import json

    pytest.importorskip("transformers")
    doc = REPO / "docs" / "byom.md"
    folder = project(tmp_path, doc)
    run_kiln(["run", "textcls.yaml", "-w", "textcls-out", "--quiet"], folder)
    v = json.loads((folder / "textcls-out" / "validate" / "validation.json").read_text())
    assert (
        v["passed"] and v["baseline"]["shapes"] == [{"seq": 8}, {"seq": 16}] and v["baseline"]["compared"] == ["logits"]
    )
    kept = json.loads((folder / "textcls-out" / "cache" / "data-hashes.json").read_text())  # skip_unchanged
    run_kiln(["run", "textcls.yaml", "-w", "textcls-out", "--quiet"], folder)
    report = json.loads((folder / "textcls-out" / "report.json").read_text())
    assert {s["status"] for s in report["stages"].values()} == {"cached"} and len(kept) == 1
    for lang, text in blocks(doc):
        if lang == "bash":
            run_block(lang, text, folder)
    v = json.loads((folder / "fromonnx-out" / "validate" / "validation.json").read_text())
    assert v["passed"] and v["baseline"]["backend"] == "onnxruntime"
    assert (folder / "engine-int8" / "kiln-engine.json").is_file()


def test_no_doc_runs_blocks_nobody_checks() -> None:
    """Each doc with code is run above or checked: a new doc gets one or the other."""
    ran = {"README.md", "byom.md", "engines.md"}
    yaml_only = {"configuration.md"}
    for doc in DOCS:
        kinds = {lang for lang, _ in blocks(doc)} - {""}
        if kinds and label(doc) not in ran | CHECKED_ONLY | yaml_only:
            raise AssertionError(f"{label(doc)} has {kinds} blocks that no test runs or checks")
        if label(doc) in yaml_only:
            assert kinds <= {"yaml"}
