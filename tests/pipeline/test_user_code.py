"""The version of user code in cache keys: the module and the local modules it imports, nothing else."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import pytest

from kiln.pipeline.user_code import code_version, local_sources


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    names: list[str] = []

    def load(name: str):
        importlib.invalidate_caches()
        for m in [m for m in sys.modules if m == name.partition(".")[0] or m.startswith(name.partition(".")[0] + ".")]:
            sys.modules.pop(m)
        names.append(name)
        return importlib.import_module(name)

    yield tmp_path, load
    for name in names:
        for m in [m for m in sys.modules if m.partition(".")[0] == name.partition(".")[0]]:
            sys.modules.pop(m)


def test_imported_siblings_count_unrelated_files_do_not(project) -> None:
    root, load = project
    (root / "kuc_layers.py").write_text("ACT = 'relu'\n")
    (root / "kuc_plot.py").write_text("print('a script')\n")
    (root / "kuc_model.py").write_text("from kuc_layers import ACT\n\ndef build():\n    return ACT\n")
    first = code_version(load("kuc_model"))
    assert [p.name for p in local_sources(root / "kuc_model.py", [root])] == ["kuc_layers.py", "kuc_model.py"]
    (root / "kuc_plot.py").write_text("print('edited')\n")
    assert code_version(load("kuc_model")) == first  # editing an unrelated script retrains nothing
    (root / "kuc_layers.py").write_text("ACT = 'tanh'\n")
    assert code_version(load("kuc_model")) != first  # editing what the model imports does


def test_namespace_package_and_relative_imports(project) -> None:
    """A folder without __init__.py has no __file__: its modules were once left out of the key."""
    root, load = project
    pkg = root / "kuc_ns"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "layers.py").write_text("WIDTH = 4\n")
    (pkg / "model.py").write_text("from .sub.layers import WIDTH\n\ndef build():\n    return WIDTH\n")
    first = code_version(load("kuc_ns.model"))
    assert first is not None
    (pkg / "sub" / "layers.py").write_text("WIDTH = 8\n")
    assert code_version(load("kuc_ns.model")) != first


def test_installed_code_is_versioned_by_its_installed_files_record() -> None:
    """Installed code is keyed by pip's RECORD (every file's sha256), not by scanning it (torch.nn reaches 1,700
    files) nor by its version alone (a user's own package reinstalled at the same version)."""
    import importlib.metadata

    import torch.nn

    from kiln.core.artifacts import hash_json

    record = importlib.metadata.distribution("torch").read_text("RECORD")
    assert record and code_version(torch.nn) == hash_json({"installed": [record]})


def test_package_inits_count_and_symlinked_modules_work(project) -> None:
    """An __init__.py runs on import (it may patch what the model uses): editing it changes the key. A module
    file that is a symlink to elsewhere once crashed the hashing with a traceback."""
    root, load = project
    pkg = root / "kuc_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("DTYPE = 'float32'\n")
    shared = root.parent / f"{root.name}_shared.py"
    shared.write_text("def build():\n    return 1\n")
    (pkg / "model.py").symlink_to(shared)
    first = code_version(load("kuc_pkg.model"))
    assert first is not None
    (pkg / "__init__.py").write_text("DTYPE = 'float64'\n")
    assert code_version(load("kuc_pkg.model")) != first


def test_a_module_named_by_path_is_hashed_without_running_it_or_its_package(project) -> None:
    """A cached run hashes the user's model by name: neither the module nor a package ``__init__`` that imports it
    (and torch, transformers...) runs; the hash is the one of the imported module."""
    root, load = project
    pkg = root / "kuc_lazy"
    pkg.mkdir()
    ran = root / "ran.txt"
    (pkg / "__init__.py").write_text(f"open({str(ran)!r}, 'a').write('init ')\nfrom .net import build\n")
    (pkg / "net.py").write_text(f"open({str(ran)!r}, 'a').write('net ')\n\ndef build():\n    return 1\n")
    by_name = code_version("kuc_lazy.net")
    assert by_name is not None and not ran.exists()
    assert code_version(load("kuc_lazy.net")) == by_name and ran.read_text() == "init net "
    assert code_version("kuc_missing.net") is None


def test_the_folder_user_code_is_imported_from_is_recorded_for_loadtest(project, tmp_path: Path) -> None:
    """A project's `datasets/synth.py` (a package), a top-level module and a namespace package resolve from the
    project folder; the run's manifest keeps it, so `kiln loadtest` run from elsewhere imports the data function
    from there; installed code is not recorded."""
    import json

    from kiln.pipeline.runner import code_roots
    from kiln.serve.loadtest import recorded_code_roots

    root, _ = project
    (root / "kuc_datasets").mkdir()
    (root / "kuc_datasets" / "__init__.py").write_text("")
    (root / "kuc_datasets" / "synth.py").write_text("def load():\n    return None\n")
    (root / "kuc_top.py").write_text("def build():\n    return None\n")
    (root / "kuc_nspkg" / "inner").mkdir(parents=True)
    (root / "kuc_nspkg" / "inner" / "m.py").write_text("def f():\n    return None\n")
    importlib.invalidate_caches()
    refs = {"kuc_datasets.synth:load": "v", "kuc_top:build": "v", "kuc_nspkg.inner.m:f": "v", "numpy:ones": "v"}
    assert code_roots(refs) == [str(root)]
    validate = tmp_path / "wd" / "validate"
    validate.mkdir(parents=True)
    project = tmp_path / "project"  # the run's, not on this process's path
    project.mkdir()
    recorded = [str(project), str(root), str(tmp_path / "gone")]  # root: on the path (PYTHONPATH's), left as it is
    (validate / "manifest.json").write_text(json.dumps({"code_roots": recorded}))
    assert recorded_code_roots(tmp_path / "wd" / "build" / "onnxruntime-cpu-fp32") == [project]


@pytest.fixture
def kfr(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A project folder on sys.path whose ``kfr_*`` modules are dropped from sys.modules afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", False)  # a __pycache__ as most users have one
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith("kfr_")]:
        sys.modules.pop(name)


def _resolve(ref: str):
    from kiln.models.registry import resolve_callable

    return resolve_callable(ref, {}, "model")


def test_a_module_edited_after_kiln_loaded_it_is_reloaded_with_what_it_imports(kfr: Path) -> None:
    """A notebook runs the pipeline, edits the model's file (or a helper it imports), runs again: the second run
    must run the code its cache key hashes, not the module Python keeps in sys.modules."""
    (kfr / "kfr_layers.py").write_text("SHIFT = 0.0\n")
    model = kfr / "kfr_model.py"
    model.write_text("from kfr_layers import SHIFT\n\nSCALE = 1.0\n\n\ndef build():\n    return SCALE + SHIFT\n")
    assert _resolve("kfr_model:build")() == 1.0
    stat = model.stat()
    model.write_text(model.read_text().replace("SCALE = 1.0", "SCALE = 3.0"))
    os.utime(model, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # same size and mtime: the old .pyc looks current
    assert _resolve("kfr_model:build")() == 3.0
    (kfr / "kfr_layers.py").write_text("SHIFT = 0.5\n")
    assert _resolve("kfr_model:build")() == 3.5


def test_a_module_the_user_imported_before_editing_it_is_reloaded(kfr: Path) -> None:
    model = kfr / "kfr_user.py"
    model.write_text("SCALE = 1.0\n\n\ndef build():\n    return SCALE\n")
    importlib.invalidate_caches()
    mine = importlib.import_module("kfr_user")  # `import kfr_user` in a notebook cell
    model.write_text("SCALE = 3.0\n\n\ndef build():\n    return SCALE\n")
    assert _resolve("kfr_user:build")() == 3.0 and mine.SCALE == 3.0


def test_an_unchanged_module_is_not_reloaded(kfr: Path) -> None:
    """Stages resolve the same function several times a run: the module stays the one loaded."""
    (kfr / "kfr_same.py").write_text("LOADS = []\nLOADS.append(1)\n\n\ndef build():\n    return len(LOADS)\n")
    first = _resolve("kfr_same:build")
    module = sys.modules["kfr_same"]
    assert _resolve("kfr_same:build") is first and sys.modules["kfr_same"] is module and first() == 1


def test_installed_and_kiln_modules_are_imported_as_they_are() -> None:
    from kiln.pipeline.user_code import _reloadable

    assert _reloadable("kiln.models.cnn") is None and _reloadable("pytest") is None
    assert _reloadable("__main__") is None and _reloadable("json") is None
