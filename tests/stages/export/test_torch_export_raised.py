"""Where torch's data-dependent error names the line that raised it (``Caused by: (path:line in fn)``, or ``The
following call raised this error: File ...``), the export's error names that line, says a size read where the line
takes sizes, and puts the user's own export first where the line is a library's code."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from kiln.core import user_errors
from kiln.core.errors import ModelError
from kiln.stages.export import torch_export
from kiln.stages.export.torch_export import DATA_BRANCH_FIX, Raised, _raised_at, _values_fix, export_onnx

GATE = """import torch


def gated(x: torch.Tensor) -> torch.Tensor:
    flag = (x > 0.5).any().item()
    if flag:  # BRANCH
        return x * 2
    return x
"""


@pytest.fixture
def library(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An installed library ``fakelib`` (a site-packages folder on sys.path) whose ``gated`` branches on a value."""
    site = tmp_path / "site-packages"
    (site / "fakelib").mkdir(parents=True)
    (site / "fakelib" / "__init__.py").write_text("")
    (site / "fakelib" / "gate.py").write_text(GATE)
    monkeypatch.syspath_prepend(str(site))
    libraries = user_errors._library_dirs()
    monkeypatch.setattr(user_errors, "_library_dirs", lambda: (*libraries, str(site.resolve()) + os.sep))
    yield site
    sys.modules.pop("fakelib.gate", None)
    sys.modules.pop("fakelib", None)


class CallsTheLibrary(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from fakelib.gate import gated

        return gated(x) + 1


def test_a_branch_in_a_library_is_named_at_its_line_with_the_own_export_first(library: Path, tmp_path: Path) -> None:
    line = GATE.splitlines().index("    if flag:  # BRANCH") + 1
    with pytest.raises(ModelError) as caught:
        export_onnx(CallsTheLibrary().eval(), torch.rand(2, 4), tmp_path / "m.onnx")
    assert f"decides a branch from its inputs' values at gate.py:{line} (" in caught.value.message
    assert (caught.value.hint or "").startswith(
        f"that line (gate.py:{line}) is in fakelib, not your code: export the model yourself and give Kiln the file"
    )


def test_caused_by_names_the_branch_where_the_traced_call_is_a_shape_read(library: Path) -> None:
    named = library / "fakelib" / "gate.py"
    error = RuntimeError(
        "Could not guard on data-dependent expression Eq(u0, 1)\n"
        "Caused by: (fakelib/gate.py:6 in gated)\n"
        "The following call raised this error:\n"
        f'  File "{named}", line 5, in gated\n'
        "    flag = (x > 0.5).any().item()\n"
    )
    assert _raised_at(error) == Raised("gate.py:6", "if flag:  # BRANCH", "fakelib")


def test_a_view_that_raised_is_said_as_a_size_read(library: Path) -> None:
    (library / "fakelib" / "chunk.py").write_text("def chunk(x, n):\n    return x.view(x.size(0), n, -1)\n")
    error = RuntimeError(
        "Could not guard on data-dependent expression 8*u1 < 32\n"
        "Caused by: (_subclasses/fake_impls.py:832 in _compute_stride)\n"
        "The following call raised this error:\n"
        f'  File "{library / "fakelib" / "chunk.py"}", line 2, in chunk\n'
        "    return x.view(x.size(0), n, -1)\n"
    )
    raised = _raised_at(error)
    assert raised == Raised("chunk.py:2", "return x.view(x.size(0), n, -1)", "fakelib") and raised.sizes()
    hint = _values_fix("Could not guard on data-dependent expression 8*u1 < 32", raised)
    assert (
        hint.startswith("that line (chunk.py:2) is in fakelib, not your code: export the model yourself")
        and "sizes" in hint
    )
    with pytest.raises(ModelError, match=r"sizes a tensor by a tensor's value at chunk\.py:2"):
        torch_export.refuse_traced_branch(
            ["chunk.py:2"], ["dynamo exporter: Could not guard on data-dependent expression 8*u1 < 32"], "", raised
        )


def test_the_users_own_branch_keeps_the_plain_fix() -> None:
    assert _values_fix("Could not guard on data-dependent expression u0 > 0", Raised("mine.py:3", "if x:", "")) == (
        DATA_BRANCH_FIX
    )


def test_a_size_fixed_inside_a_library_is_placed_where_torch_s_log_said() -> None:
    """Both exporters failed, the dynamo one by fixing a dynamic axis inside a library's module (a transformers
    model's size check), where no line of the user's is found: the error still says where, as the warning did."""
    errors = [
        "dynamo exporter: it fixed input 'x' axis 1 (frames), which signature.dynamic_axes makes dynamic",
        "torchscript exporter: Exporting the operator 'aten::diff' to ONNX opset version 18 is not supported",
    ]
    err = torch_export._export_failed(
        nn.Identity(), torch.zeros(2, 3), errors, 18, {}, places="modeling_whisper.py:612"
    )
    assert "(in modeling_whisper.py:612)" in err.message and "modeling_whisper.py:612" in (err.hint or "")
