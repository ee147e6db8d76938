"""The version of a user's own code (``model.name: mymodels:build``), for cache keys.

Editing the model must rerun training just as editing Kiln does, and so must editing a helper the model imports
(``from mylayers import Act``); editing an unrelated script in the same folder must not. So the version is a hash
of the module's file plus every local module it imports, found by reading the import statements (``ast``), not by
what happens to be in ``sys.modules`` (which depends on what ran before). "Local" means under the folder its
absolute imports resolve from: a top-level module's own folder, or the folder holding its top-level package
(namespace packages included).
Code installed in site-packages is versioned by its distribution's version instead: hashing an installed package
(torchvision) file by file would be slow and say nothing more.
"""
from __future__ import annotations

import ast
import functools
import importlib.metadata
import importlib.util
import site
import sys
from pathlib import Path
from types import ModuleType

from pipeline.artifacts import hash_file, hash_json


def code_version(module: ModuleType) -> str | None:
    """A hash standing for ``module``'s code; None when it has no source (a built-in or compiled module)."""
    top = sys.modules.get(module.__name__.partition(".")[0], module)
    roots = _roots(top)
    origin = getattr(module, "__file__", None)
    if not origin or not roots:
        return None
    if any(_installed(r) for r in roots):
        return hash_json({"installed": list(_distribution_versions(top.__name__))})
    files = local_sources(Path(origin), roots)
    return hash_json({str(p.relative_to(_root_of(p, roots))): hash_file(p) for p in files})


def local_sources(start: Path, roots: list[Path]) -> list[Path]:
    """``start`` and the local modules it imports, transitively."""
    seen: set[Path] = set()
    todo = [start.resolve()]
    while todo:
        path = todo.pop()
        if path in seen or not path.is_file():
            continue
        seen.add(path)
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except SyntaxError:
            continue  # importing it fails with a clear message elsewhere; its bytes are hashed all the same
        for name in _imported_names(tree, path):
            found = _find(name, roots)
            if found is not None:
                todo.append(found)
    return sorted(seen)


def _imported_names(tree: ast.AST, path: Path) -> list[str | Path]:
    """Absolute module names, or for relative imports the candidate path of the module."""
    names: list[str | Path] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]  # a submodule, maybe
        elif isinstance(node, ast.ImportFrom):
            base = path.parent
            for _ in range(node.level - 1):
                base = base.parent
            parts = node.module.split(".") if node.module else []
            names += [base.joinpath(*parts)] + [base.joinpath(*parts, a.name) for a in node.names]
    return names


def _find(name: str | Path, roots: list[Path]) -> Path | None:
    """The source file of a local module, without importing anything."""
    if isinstance(name, Path):
        candidates = [name.with_suffix(".py"), name / "__init__.py"]
    else:
        parts = name.split(".")
        candidates = [r.joinpath(*parts).with_suffix(".py") for r in roots]
        candidates += [r.joinpath(*parts, "__init__.py") for r in roots]
    for c in candidates:
        if c.is_file() and _root_of(c.resolve(), roots) is not None:
            return c.resolve()
    return None


def _roots(top: ModuleType) -> list[Path]:
    """The folders absolute imports of ``top``'s code resolve from."""
    paths = getattr(top, "__path__", None)  # a package, namespace packages included (no __file__)
    if paths is not None:
        return list(dict.fromkeys(Path(p).resolve().parent for p in paths))
    origin = getattr(top, "__file__", None)
    return [Path(origin).resolve().parent] if origin else []


def _root_of(path: Path, roots: list[Path]) -> Path | None:
    for r in roots:
        if path.is_relative_to(r):
            return r
    return None


def _installed(path: Path) -> bool:
    dirs = [Path(p).resolve() for p in [*site.getsitepackages(), site.getusersitepackages()]]
    return any(path == d or path.is_relative_to(d) for d in dirs)


@functools.lru_cache(maxsize=None)  # scanning every installed distribution's metadata takes ~0.2 s
def _distribution_versions(top_name: str) -> tuple[str, ...]:
    dists = importlib.metadata.packages_distributions().get(top_name, [])
    out = []
    for d in sorted(set(dists)):
        try:
            out.append(f"{d}=={importlib.metadata.version(d)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return tuple(out) or (top_name,)
