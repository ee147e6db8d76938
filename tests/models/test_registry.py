"""models.registry: resolving user code by import path."""
from __future__ import annotations


def test_a_user_package_named_like_a_kiln_package_gets_a_rename_hint() -> None:
    """`models.mynet:build` from a project's own models/ folder cannot resolve (Kiln's `models` is imported first):
    the fix line says to rename, not to 'run kiln from the folder holding the module'."""
    import pytest

    from models.registry import resolve_callable
    from pipeline.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        resolve_callable("models.mynet:build", {}, "model")
    assert "rename your package" in err.value.hint and "my_models" in err.value.hint
