"""The version of a user's own code (``model.name: mymodels:build``), for cache keys.

Editing the model must rerun training just as editing Kiln does, and so must editing a helper the model imports or a
package ``__init__`` that runs on import; editing an unrelated script in the same folder must not. So the version is
a hash of the module's file plus the local modules it imports, found by reading import statements (``ast``) rather
than ``sys.modules`` (which depends on what ran before), plus the ``__init__.py`` of every package on the way.

"Local" is where the module's absolute imports resolve among its own code: for a project folder, that folder; for
code installed in site-packages, its distribution's RECORD (pip's list of every installed file with its sha256), so
a package reinstalled at the same version still changes the key without a scan of everything it imports. Code
loaded dynamically (``importlib`` plugins) is not seen.

The code a stage runs must be the code its key hashes: :func:`import_fresh`, which resolving a user's function
(``kiln.models.registry``) imports with, reloads a local module that an earlier run in the same process (a
notebook) or the user loaded before its files changed.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.metadata
import os
import site
import sys
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from importlib.machinery import ModuleSpec, PathFinder
from pathlib import Path
from types import ModuleType

from kiln.core.artifacts import hash_file, hash_json
from kiln.models.registry import use_importer

# A local module's file -> its hash when Kiln last imported, reloaded or found it current (see import_fresh)
_RAN: dict[str, str] = {}


def code_version(module: ModuleType | str) -> str | None:
    """A hash standing for a module's code (given imported, or by name: then found without running it or its
    packages); None when it has no source file (built-in or frozen)."""
    if isinstance(module, str):
        name, (origin, roots) = module, _unrun_source(module)
    else:
        name, origin = module.__name__, getattr(module, "__file__", None)
        top = sys.modules.get(name.partition(".")[0], module)
        roots = _roots(getattr(top, "__path__", None), getattr(top, "__file__", None))
    if not origin or not roots:
        return None
    if all(_installed(r) for r in roots):
        return hash_json({"installed": list(_distribution_records(name.partition(".")[0]))})
    roots = [r for r in roots if not _installed(r)]  # a namespace package partly installed: scan the local part
    files = local_sources(Path(origin).absolute(), roots)
    return hash_json({_label(p, roots): hash_file(p) for p in files})


def import_root(module: str) -> str | None:
    """The folder ``module`` is imported from (``datasets.synth`` at ``/proj/datasets/synth.py``: ``/proj``), found
    without running it; None for an installed or built-in module, which any process imports as it is."""
    top, _ = _find_unrun(module)
    if top is None:
        return None
    if top.has_location and top.origin:
        origin = Path(top.origin).absolute()
        folder = origin.parent.parent if top.submodule_search_locations is not None else origin.parent
    elif top.submodule_search_locations:  # a namespace package (no __init__.py): the folder above its own
        folder = Path(next(iter(top.submodule_search_locations))).absolute().parent
    else:
        return None
    return None if _installed(folder) else str(folder)


def defined_unrun(module: str, attr: str) -> bool | None:
    """Whether ``module`` defines ``attr`` at its top level (a def, class, assignment or import, under an ``if`` or
    ``try`` too), read from its source without running it or its packages: a run checks that the functions its
    config names exist before it calls the user's data function (seconds). None where the source cannot tell (no
    Python source, a ``from x import *``, a module ``__getattr__``): the stages' own checks find out, importing no
    module on a run whose stages are cached. False for a module not found or not parsed, whose import names why,
    and for a name the source lacks, which may still be wrong (bound by ``for``, ``with`` or ``globals()``): the
    caller imports the module to confirm before it says so."""
    loaded = sys.modules.get(module)
    if loaded is not None:
        return hasattr(loaded, attr)
    try:
        origin, _ = _unrun_source(module)
    except (ImportError, ValueError):
        return False  # no such module: the import names it
    if not origin or not origin.endswith(".py"):
        return None
    try:
        tree = ast.parse(Path(origin).read_text(encoding="utf-8"))
    except SyntaxError:
        return False  # the import names the line
    except (OSError, ValueError):
        return None
    names = _top_level_names(tree.body)
    return None if "*" in names else attr in names


def _top_level_names(body: list[ast.stmt]) -> set[str]:
    """The names statements bind in the namespace they run in (not inside the functions or classes they define)."""
    names: set[str] = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {a.asname or a.name.partition(".")[0] for a in node.names}
        if isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):  # blocks that run where they stand
            blocks = [node.body, getattr(node, "orelse", []), getattr(node, "finalbody", [])]
            blocks += [h.body for h in getattr(node, "handlers", [])]
            names |= {n for block in blocks for n in _top_level_names(block)}
    return names - {"__getattr__"} | ({"*"} if "__getattr__" in names else set())


def _unrun_source(name: str) -> tuple[str | None, list[Path]]:
    """The source file of module ``name`` (None without one) and the roots of its top-level package, found without
    running either."""
    top, spec = _find_unrun(name)
    if spec is None or top is None:
        return None, []
    origin = spec.origin if spec.has_location else None
    return origin, _roots(top.submodule_search_locations, top.origin if top.has_location else None)


def _find_unrun(name: str) -> tuple[ModuleSpec | None, ModuleSpec | None]:
    """The specs of ``name``'s top-level package and of ``name`` itself, found along the packages' paths without
    running any of them (``importlib.util.find_spec`` runs a submodule's parents: a ``models/__init__.py`` that
    imports the model, and what it imports, would load on every cached run)."""
    parts = name.split(".")
    top = sys.modules[parts[0]].__spec__ if parts[0] in sys.modules else PathFinder.find_spec(parts[0])
    spec = top
    for part in parts[1:]:
        if spec is None or spec.submodule_search_locations is None:
            return top, None
        spec = PathFinder.find_spec(part, list(spec.submodule_search_locations))
    return top, spec


def local_sources(start: Path, roots: list[Path]) -> list[Path]:
    """``start``, the local modules it imports (transitively) and the ``__init__.py`` of their packages."""
    return sorted(_import_order(start, roots))


def _import_order(start: Path, roots: list[Path]) -> list[Path]:
    """:func:`local_sources` with each file after the files it imports (a cycle broken where it closes)."""
    order: list[Path] = []
    seen: set[Path] = set()
    todo: list[tuple[Path, bool]] = [(start, False)]  # (file, its imports are placed already)
    while todo:
        path, done = todo.pop()
        if done:
            order.append(path)
            continue
        if path in seen or not path.is_file():
            continue
        seen.add(path)
        todo.append((path, True))
        todo += [(p, False) for p in reversed(_imports_of(path, roots))]
    return order


def _imports_of(path: Path, roots: list[Path]) -> list[Path]:
    """The local files ``path`` imports and the ``__init__.py`` of its packages (which run before it)."""
    found = _package_inits(path, roots)
    try:
        tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    except (SyntaxError, ValueError):
        return found  # not Python source (an extension module): its bytes are hashed all the same
    return found + [f for name in _imported_names(tree, path) if (f := _find(name, roots)) is not None]


def import_fresh(name: str) -> ModuleType:
    """``importlib.import_module``, except that a user's local modules loaded before their files changed (edited
    since Kiln last ran them, or imported by the user before Kiln saw them) are reloaded from their files first,
    each after the local modules it imports: the code a stage runs is then the code its cache key hashes
    (:func:`code_version`). Modules unchanged since Kiln last ran them are not reloaded; installed packages, Kiln's
    own modules and ``__main__`` (reloading it would rerun the script) are imported as they are."""
    files = _reloadable(name)
    if files is None:
        return importlib.import_module(name)
    hashes = {path: hash_file(Path(path)) for path in files}
    loaded = _loaded(files)
    stale: list[ModuleType] = []  # each after what it imports: a reloaded dependent picks up its dependencies' names
    for path in files:
        module = loaded.get(path)
        if module is not None and (stale or _changed_since_loaded(path, hashes[path])):
            stale.append(module)
    if stale:
        with _no_bytecode():
            for module in stale:
                importlib.reload(module)
    module = importlib.import_module(name)
    _RAN.update({path: hashes[path] for path in _loaded(files)})  # those it loaded for the first time included
    return module


def _changed_since_loaded(path: str, digest: str) -> bool:
    """Whether a loaded module's file may differ from the code loaded from it: against Kiln's record of the file
    where Kiln loaded or checked it before, else whether it was written after this process started (a module the
    user imported before editing it; one whose file is older than the process holds the code on disk, and is kept,
    so the classes the user imported from it stay the ones Kiln's model is made of)."""
    if path in _RAN:
        return _RAN[path] != digest
    return os.stat(path).st_mtime >= _process_start()


@functools.cache
def _process_start() -> float:
    """When this process started (seconds since the epoch)."""
    import psutil

    return psutil.Process().create_time()


def _loaded(files: list[str]) -> dict[str, ModuleType]:
    """The modules in ``sys.modules`` loaded from ``files``, by file (not ``__main__``, a script run as one)."""
    wanted = set(files)
    return {
        path: m
        for key, m in list(sys.modules.items())
        if not _kept(key) and (path := _file_of(m)) is not None and path in wanted
    }


def _kept(name: str) -> bool:
    """Is module ``name`` one :func:`import_fresh` never reloads: ``__main__``, Kiln's own or Python's?"""
    top = name.partition(".")[0]
    return name == "__main__" or top == "kiln" or top in sys.stdlib_module_names


def _reloadable(name: str) -> list[str] | None:
    """The files of module ``name`` and the local modules it imports, each after those it imports, found without
    running it; None for code Kiln must not reload (see :func:`import_fresh`) or cannot find."""
    if _kept(name):
        return None
    try:
        origin, roots = _unrun_source(name)
    except (ImportError, ValueError):
        return None
    roots = [r for r in roots if not _installed(r)]
    if not origin or not roots:
        return None
    return [os.path.abspath(p) for p in _import_order(Path(origin).absolute(), roots)]


def _file_of(module: ModuleType | None) -> str | None:
    file = getattr(module, "__file__", None)
    return os.path.abspath(file) if isinstance(file, str) else None


@contextmanager
def _no_bytecode() -> Iterator[None]:
    """Compile from the source file, neither reading nor writing ``__pycache__``: Python takes a ``.pyc`` of the
    old code as current when the edit kept the file's size and the second of its mtime."""
    prefix, dont_write = sys.pycache_prefix, sys.dont_write_bytecode
    with tempfile.TemporaryDirectory() as empty:
        sys.pycache_prefix, sys.dont_write_bytecode = empty, True
        try:
            importlib.invalidate_caches()
            yield
        finally:
            sys.pycache_prefix, sys.dont_write_bytecode = prefix, dont_write


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
        # a project root holds top-level names; an installed package's root is that package's own folder
        bases = dict.fromkeys(b for r in roots for b in (r, r.parent))
        candidates = [
            c for b in bases for c in (b.joinpath(*parts).with_suffix(".py"), b.joinpath(*parts, "__init__.py"))
        ]
    return next((c for c in candidates if c.is_file() and _root_of(c, roots) is not None), None)


def _package_inits(path: Path, roots: list[Path]) -> list[Path]:
    """The ``__init__.py`` files of the packages holding ``path``, up to its root (they run on import)."""
    root = _root_of(path, roots)
    out, folder = [], path.parent
    while root is not None and folder != root and folder.is_relative_to(root):
        out.append(folder / "__init__.py")
        folder = folder.parent
    return out


def _roots(paths: Iterable[str] | None, origin: str | None) -> list[Path]:
    """The folders holding a top-level module's code (a package's ``__path__``, namespace packages included, or a
    module's file), as explained in the module docstring."""
    if paths is not None:
        dirs = [Path(p).absolute() for p in paths]
        return list(dict.fromkeys(d if _installed(d) else d.parent for d in dirs))
    if not origin:
        return []
    file = Path(origin).absolute()
    return [file] if _installed(file.parent) else [file.parent]  # an installed module stands alone


def _root_of(path: Path, roots: list[Path]) -> Path | None:
    for r in roots:
        if path == r or path.is_relative_to(r):
            return r
    return None


def _label(path: Path, roots: list[Path]) -> str:
    """The file's name in the hash: relative to its root, so moving a project keeps its keys."""
    root = _root_of(path, roots)
    return str(path.relative_to(root.parent if root == path else root)) if root is not None else str(path)


@functools.cache  # mapping modules to distributions reads every installed package's metadata
def _distribution_records(top_name: str) -> tuple[str, ...]:
    out = []
    for dist in sorted(set(importlib.metadata.packages_distributions().get(top_name, []))):
        try:
            meta = importlib.metadata.distribution(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        out.append(meta.read_text("RECORD") or f"{dist}=={meta.version}")
    return tuple(out) or (top_name,)


def _installed(path: Path) -> bool:
    dirs = [Path(p).absolute() for p in [*site.getsitepackages(), site.getusersitepackages()]]
    return any(path == d or path.is_relative_to(d) for d in dirs)


use_importer(import_fresh)
