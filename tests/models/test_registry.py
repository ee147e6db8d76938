"""Errors of resolving a user's ``module:function``: an import failing inside the user's module is told apart from
the module not being found."""

import sys
import uuid
from pathlib import Path

import pytest

from kiln.core.errors import ConfigError
from kiln.models.registry import resolve_callable


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, Path]:
    """A fresh user package (a unique name, so no earlier import is reused) with an empty ``data`` module set up by
    each test, on sys.path, with the current folder its parent."""
    name = f"userpkg_{uuid.uuid4().hex[:8]}"
    (tmp_path / name).mkdir()
    (tmp_path / name / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    yield name, tmp_path / name
    for module in [m for m in sys.modules if m == name or m.startswith(f"{name}.")]:
        del sys.modules[module]


def _error(ref: str) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        resolve_callable(ref, {}, "dataset")
    return err.value


def test_a_missing_package_imported_by_the_users_module_says_install_it_and_where(package) -> None:
    name, folder = package
    (folder / "data.py").write_text("x = 1\nimport no_such_dist_kiln\n\ndef load():\n    pass\n")
    err = _error(f"{name}.data:load")
    assert f"'no_such_dist_kiln', imported at {name}/data.py:2, is not installed" in err.message, err.message
    assert "-m pip install no_such_dist_kiln" in err.hint and "run kiln from the folder" not in err.hint


def test_a_missing_local_module_imported_by_the_users_module_is_named_with_its_line(package) -> None:
    name, folder = package
    (folder / "data.py").write_text(f"from {name}.layers import Tokenizer\n")
    err = _error(f"{name}.data:load")
    assert f"'{name}.layers', imported at {name}/data.py:1, does not exist" in err.message, err.message
    assert err.hint == f"create {name}/layers.py or correct the import at {name}/data.py:1"


def test_a_name_missing_from_an_imported_module_names_the_line(package) -> None:
    name, folder = package
    (folder / "data.py").write_text(f"\nfrom {name} import Tokenizer\n")
    err = _error(f"{name}.data:load")
    assert f"failed at {name}/data.py:2: cannot import name 'Tokenizer'" in err.message, err.message


@pytest.mark.parametrize("missing", ["data", "nothing.data"])
def test_a_module_not_found_keeps_the_run_from_its_folder_hint(package, missing: str) -> None:
    name, _ = package
    ref = f"{name}.{missing}:load" if missing == "data" else f"{missing}:load"
    err = _error(ref)
    assert err.message.startswith("cannot import module") and "run kiln from the folder" in err.hint
