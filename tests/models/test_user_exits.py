"""A model factory, data function or user module that calls sys.exit() is an error naming it, not the end of
Kiln's command (it was: `kiln run` exited 0, saying nothing, with no report)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kiln.core.errors import ConfigError
from kiln.core.user_errors import UserCodeError
from kiln.models.registry import build_model, load_dataset, resolve_callable

MODULE = """\
import sys

def exits(**kw):
    sys.exit(0)

def says_bye(**kw):
    raise SystemExit("bye")

def load():
    sys.exit()
"""


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "kiln_t_exits.py").write_text(MODULE)
    (tmp_path / "kiln_t_exits_on_import.py").write_text("import sys\nsys.exit(3)\n\ndef build():\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "kiln_t_exits"
    for name in ("kiln_t_exits", "kiln_t_exits_on_import"):
        sys.modules.pop(name, None)


def test_a_factory_that_calls_sys_exit_is_an_error_naming_it(user_module: str) -> None:
    with pytest.raises(UserCodeError) as err:
        build_model(f"{user_module}:exits")
    message, fix = err.value.message, err.value.hint or ""
    assert message.startswith(f"model factory '{user_module}:exits' called sys.exit(0) (in exits() at "), message
    assert message.endswith("while building the model"), message
    assert fix.startswith("return the model instead of exiting in exits() at ") and "__main__" in fix, fix
    assert err.value.exit_code == 2


def test_raise_system_exit_and_a_data_function_exiting_are_errors_too(user_module: str) -> None:
    with pytest.raises(UserCodeError, match=r"called sys.exit\('bye'\) \(in says_bye\(\)"):
        build_model(f"{user_module}:says_bye")
    with pytest.raises(UserCodeError) as err:
        load_dataset(f"{user_module}:load")
    assert err.value.message.startswith(f"data function '{user_module}:load' called sys.exit() (in load() at ")
    assert err.value.message.endswith("while loading data") and "return the DatasetSplits" in (err.value.hint or "")


def test_a_module_that_exits_when_imported_is_a_config_error(user_module: str) -> None:
    with pytest.raises(ConfigError) as err:
        resolve_callable("kiln_t_exits_on_import:build", {}, "model")
    assert err.value.message.startswith(
        "importing module 'kiln_t_exits_on_import' for model 'kiln_t_exits_on_import:build' called sys.exit(3) "
        "(in <module>() at "
    ), err.value.message
    assert "__main__" in (err.value.hint or "")
