"""Modules imported on first use: ``onnx = lazy_import("onnx")`` at the top of a module keeps importing that module
cheap, so ``kiln --help`` and reading a config do not load ONNX, onnx-graphsurgeon or torch.

A proxy object, not ``importlib.util.LazyLoader``: that one puts a half-made module into ``sys.modules``, and any
plain ``import onnx`` elsewhere then finishes loading it anyway.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any


class LazyModule:
    """Stands for a module until an attribute is read, then imports it; attributes read once are kept."""

    def __init__(self, name: str) -> None:
        self.__dict__["_name"] = name

    def _module(self) -> ModuleType:
        return importlib.import_module(self.__dict__["_name"])

    def __getattr__(self, attr: str) -> Any:
        value = getattr(self._module(), attr)
        self.__dict__[attr] = value
        return value

    def __repr__(self) -> str:
        return f"<lazy module {self.__dict__['_name']!r}>"


def lazy_import(name: str) -> Any:
    """``name`` as a :class:`LazyModule` (typed ``Any``: use it as the module)."""
    return LazyModule(name)
