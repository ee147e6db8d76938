"""Kiln's modules import one way: core <- models <- calibration <- stages <- pipeline <- entry points.

Read from the source with ``ast`` rather than import-linter: its import graph walks one folder per package,
and ``kiln`` is laid over four folders (``package-dir`` in pyproject.toml). Imports under ``if TYPE_CHECKING:``
are annotations only and never run, so they are not dependencies.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOTS = {"kiln": "pipeline", "kiln.models": "models", "kiln.calibration": "calibration", "kiln.stages": "stages"}
# Programs started by a user or by torchrun: they sit on top of everything, like the CLI.
ENTRY_POINTS = {"kiln", "kiln.cli", "kiln.stages.train.worker"}
LAYERS = ["kiln.core", "kiln.models", "kiln.calibration", "kiln.stages", "kiln (pipeline)", "entry points"]


def _modules() -> dict[str, Path]:
    out = {}
    for package, folder in ROOTS.items():
        for path in (REPO / folder).rglob("*.py"):
            parts = path.relative_to(REPO / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join((package, *parts))
            if package == "kiln" and len(parts) and parts[0] in {"models", "calibration", "stages"}:
                continue  # not reachable: these names are the mapped packages
            out[name] = path
    return out


MODULES = _modules()


def layer(module: str) -> int:
    if module in ENTRY_POINTS:
        return 5
    for i, prefix in enumerate(LAYERS[:4]):
        if module == prefix or module.startswith(prefix + "."):
            return i
    return 4  # kiln.config, kiln.runner, kiln.stage_list, kiln.report, kiln.api, ...


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING" or \
        isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING"


def kiln_imports(path: Path, module: str) -> list[tuple[str, bool]]:
    """(imported kiln module, inside a function?) for every import that runs."""
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    visit(sub, in_function)
                continue
            if isinstance(child, ast.Import):
                found.extend((a.name, in_function) for a in child.names if a.name.split(".")[0] == "kiln")
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0 \
                    and child.module.split(".")[0] == "kiln":
                # `from kiln.x import y` may import the submodule kiln.x.y
                found.extend((f"{child.module}.{a.name}" if f"{child.module}.{a.name}" in MODULES else child.module,
                              in_function) for a in child.names)
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(path.read_text()), False)
    return found


def test_the_scan_sees_every_layer() -> None:
    assert {layer(m) for m in MODULES} == set(range(6)), "a layer has no module: the mapping above is stale"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_run_downwards_only(module: str) -> None:
    up = [(m, LAYERS[layer(m)]) for m, _ in kiln_imports(MODULES[module], module) if layer(m) > layer(module)]
    assert not up, f"{module} ({LAYERS[layer(module)]}) imports a higher layer: {up}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_kiln_import_hides_inside_a_function(module: str) -> None:
    """An import inside a function is how cycles get dodged; heavy third-party libraries may still load lazily."""
    hidden = sorted({m for m, in_function in kiln_imports(MODULES[module], module) if in_function})
    assert not hidden, f"{module} imports {hidden} inside a function"
