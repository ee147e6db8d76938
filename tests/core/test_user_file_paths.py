"""Which file is the user's: an existing file named by an absolute path, outside Kiln and the libraries. torch's op
namespaces have a relative ``__file__`` ("_ops.py"), which is no file of the user's wherever Kiln runs."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from torch import nn

from kiln.core.user_errors import is_user_file, user_frame, where
from kiln.stages.export.pinned_sizes import pinned_at


def _module(path: Path, text: str) -> object:
    """``text`` imported as a module from ``path``, as Kiln imports a config's ``mine:build``."""
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["_ops.py", "_classes.py"])
def test_a_relative_file_name_is_no_users_file_even_where_one_of_that_name_lies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """torch.ops' ``__file__`` "_ops.py", resolved against the current folder, was taken for the user's file."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / name).write_text("")
    assert not is_user_file(name)


def test_torchs_op_namespaces_are_no_users_files() -> None:
    assert not is_user_file(torch.ops.__file__)
    assert not is_user_file(torch.classes.__file__)


def test_an_absolute_path_to_no_file_is_no_users_file(tmp_path: Path) -> None:
    assert not is_user_file(str(tmp_path / "gone.py"))


def test_the_users_own_module_is_and_its_frame_is_found(tmp_path: Path) -> None:
    """The user's module, imported from its folder: its file is the user's, and an error it raises is placed there."""
    mine = _module(tmp_path / "kiln_probe_paths.py", "def load():\n    raise ValueError('no data')\n")
    assert is_user_file(str(tmp_path / "kiln_probe_paths.py"))
    with pytest.raises(ValueError) as caught:
        mine.load()  # type: ignore[attr-defined]
    frame = user_frame(caught.value)
    assert frame is not None and frame.filename == str(tmp_path / "kiln_probe_paths.py")
    assert where(frame).startswith("load() at ") and where(frame).endswith("kiln_probe_paths.py:2")


def test_a_size_pinned_inside_a_torch_op_is_not_placed_in_torchs_op_namespace(tmp_path: Path) -> None:
    """``x.unflatten(0, (2, 2))`` pins the batch inside torch's OpOverload.__call__ (torch's log: "_ops.py:875"):
    the place said was "__call__() at _ops.py:875", a torch internal, not the user's or a library's line."""
    mine = _module(
        tmp_path / "kiln_probe_pinned.py",
        "from torch import nn\n\n\nclass Net(nn.Module):\n    def forward(self, x):\n"
        "        return x.unflatten(0, (2, 2))\n",
    )
    model: nn.Module = mine.Net()  # type: ignore[attr-defined]
    said = pinned_at(model, (torch.rand(4, 3),), {"x": {0: "batch"}})
    assert "_ops.py" not in said and "__call__()" not in said
