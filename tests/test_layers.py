"""Kiln's modules import one way: core <- models <- calibration <- stages <- pipeline <- serve <- kiln (CLI, API).

Read from the source with ``ast``: every import counts, relative ones and those under ``if TYPE_CHECKING:`` too
(an annotation that needs a higher layer is a dependency on it). The folders come from the one mapping in
pyproject.toml (``[tool.setuptools.package-dir]``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import tomllib

from kiln.pipeline.stage_list import STAGES

REPO = Path(__file__).resolve().parents[1]
FOLDERS: dict[str, str] = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
LAYERS = ["kiln.core", "kiln.models", "kiln.calibration", "kiln.stages", "kiln.pipeline", "kiln.serve", "kiln"]
# Programs started by a user or by torchrun: they sit on top of everything, like the CLI.
ENTRY_POINTS = {"kiln.cli", "kiln.stages.train.worker"}


def _modules() -> dict[str, Path]:
    out = {}
    for package, folder in FOLDERS.items():
        for path in (REPO / folder).rglob("*.py"):
            parts = path.relative_to(REPO / folder).with_suffix("").parts
            out[".".join((package, *parts[: -1 if parts[-1] == "__init__" else None]))] = path
    return out


MODULES = _modules()


def layer(module: str) -> int:
    if module in ENTRY_POINTS:
        return len(LAYERS)
    owner = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)  # the deepest match
    return LAYERS.index(owner)


def imports(module: str) -> list[tuple[str, bool]]:
    """(imported Kiln module, inside a function?) for every import in the module's source."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend((a.name, in_function) for a in child.names if a.name.split(".")[0] == "kiln")
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # `from . import x`, `from ..y import z`
                    anchor = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                if base.split(".")[0] == "kiln":  # `from kiln.x import y` may import the submodule kiln.x.y
                    found.extend(
                        (f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base, in_function)
                        for a in child.names
                    )
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(path.read_text()), False)
    return found


def test_every_folder_is_a_layer() -> None:
    assert set(FOLDERS) == set(LAYERS), "pyproject.toml's package-dir and this test's layers disagree"
    assert {layer(m) for m in MODULES} >= set(range(len(LAYERS))), "a layer has no module"


def test_imports_point_down_only() -> None:
    up = [
        f"{m} ({LAYERS[min(layer(m), len(LAYERS) - 1)]}) imports {i}"
        for m in MODULES
        for i, _ in imports(m)
        if layer(i) > layer(m)
    ]
    assert not up, "\n".join(up)


# Where a Kiln import may wait inside a function: the command line, the registries whose entries load the code
# that needs torch, ONNX or ONNX Runtime only when they are used (so `kiln --help` and reading a config load neither),
# and the runner and its user-data hashes (a run whose stages are all cached loads neither).
LAZY_BOUNDARIES = {
    "kiln.cli",
    "kiln.models.registry",
    "kiln.pipeline.fingerprints",
    "kiln.pipeline.runner",
    "kiln.stages.engines.onnxruntime",
    "kiln.stages.engines.tensorrt",
    "kiln.stages.engines.torch",
    "kiln.stages.validate.direct",  # torch only for a checkpoint reference
}


def test_kiln_imports_wait_inside_functions_only_at_the_lazy_boundaries() -> None:
    """An import inside a function is how cycles get dodged: it is allowed where a module loads code on first use,
    and still points down (``test_imports_point_down_only`` reads it too)."""
    hidden = [
        f"{m} imports {i} inside a function"
        for m in MODULES
        if m not in LAZY_BOUNDARIES
        for i, inside in imports(m)
        if inside
    ]
    assert not hidden, "\n".join(hidden)


def _stage_of(module: str) -> int | None:
    """The position in the stage order of the stage whose package (or module) holds ``module``."""
    for i, stage in enumerate(STAGES):
        root = ".".join(stage.entry.split(".")[:3])  # kiln.stages.<stage package or module>
        if module == root or module.startswith(root + "."):
            return i
    return None


def test_stages_import_earlier_stages_only() -> None:
    """A stage may use what an earlier stage made (validate runs the build stage's engines), never a later one."""
    later = [
        f"{m} ({STAGES[_stage_of(m)].name}) imports {i} ({STAGES[_stage_of(i)].name})"
        for m in MODULES
        if _stage_of(m) is not None and m not in ENTRY_POINTS
        for i, _ in imports(m)
        if (_stage_of(i) or -1) > _stage_of(m)
    ]
    assert not later, "\n".join(later)


def test_a_backend_folder_imports_no_other_backend() -> None:
    """A backend is one folder (``stages/engines/<name>/``): it uses Kiln's shared engine code, never another
    backend's, so one can be added or removed alone."""
    folders = {p.parent.name for p in (REPO / "stages" / "engines").glob("*/__init__.py")}
    owner = {m: m.split(".")[3] for m in MODULES if m.startswith("kiln.stages.engines.") and m.split(".")[3] in folders}
    crossing = [f"{m} imports {i}" for m, b in owner.items() for i, _ in imports(m) if owner.get(i, b) != b]
    assert folders >= {"onnxruntime", "tensorrt", "torch"} and not crossing, "\n".join(crossing)


def test_the_rules_see_relative_and_type_checking_imports(tmp_path: Path) -> None:
    """The scan itself: a relative import and one under TYPE_CHECKING are both found."""
    MODULES["kiln.stages.fake"] = tmp_path / "fake.py"
    (tmp_path / "fake.py").write_text(
        "from typing import TYPE_CHECKING\nfrom .engines import registry\n"
        "if TYPE_CHECKING:\n    from kiln.pipeline.config import KilnConfig\n"
    )
    try:
        assert imports("kiln.stages.fake") == [("kiln.stages.engines.registry", False), ("kiln.pipeline.config", False)]
    finally:
        del MODULES["kiln.stages.fake"]


def test_a_stages_code_covers_the_stage_modules_its_entry_imports() -> None:
    """``Stage.code`` (what the cache key hashes) is listed apart from the code that runs: every module of
    ``kiln.stages`` the stage's entry module imports is in it, or in a package it lists."""
    missing = []
    for stage in STAGES:
        entry = stage.entry.partition(":")[0]
        for imported, _ in imports(entry):
            covered = any(imported == c or imported.startswith(c + ".") for c in stage.code)
            if imported.startswith("kiln.stages.") and not covered:
                missing.append(f"{stage.name}: {imported}")
    assert not missing, "\n".join(missing)
