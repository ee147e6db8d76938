"""Where an export fixed a size the signature makes vary: the line of the user's code at which torch.export pinned
a dynamic axis to the example's size (read from torch's symbolic-shapes log), whether that line is a branch on the
size, and the fix each case calls for. Shared by the batch check (:mod:`.parity`), the size checks (:mod:`.sizes`)
and the step probe (:mod:`.size_steps`), whose errors and warnings name that line."""

from __future__ import annotations

import linecache
import logging
import re
import sys
import traceback
from collections.abc import Mapping

import torch
from torch import nn

from kiln.core.data import Inputs, input_names, tensors
from kiln.core.outputs import FlatModel
from kiln.core.text import first_line
from kiln.core.user_errors import is_user_file, where
from kiln.stages.export.quiet import SHAPES_LOG, quiet_torch
from kiln.stages.export.torch_dims import torch_dims

log = logging.getLogger("kiln.export")


FIXED_SIZE_HINT = (
    "keep sizes in forward as tensor shapes (x.shape[1]), not Python ints (int(x.shape[1]), a length kept from "
    "__init__, a count given to numpy or torch.linspace: np.linspace(0, 1, n) is torch.arange(n) / (n - 1)); a "
    "Python loop over a dynamic axis (for t in range(x.shape[1])) is unrolled to the export's size: write it with "
    "tensor ops over the whole axis (cumsum, a vectorised scan); or remove that axis from signature.dynamic_axes if "
    "the model takes one size"
)
# The fix where the line the exporter fixed a size at is an ``if`` on it (:func:`size_branch`): the graph holds the
# branch its example took, so each side's sizes need a graph of their own, or the branch must go
BRANCH_FIX = (
    "make the branch on the size unconditional, so that one graph serves every size: compute what it adds as a "
    "tensor expression that is 0 where nothing is needed (pad = (stride - L % stride) % stride, padding by 0 where "
    "L is a multiple), not under an if"
)


BATCH_FIXED_HINT = (
    "with tensor ops or // on the shape (x.shape[0] // n, not int(x.shape[0] / n)), or pass -1 for the batch axis "
    "to reshape/view"
)
_GUARD = re.compile(r"\bEq\(.*\[guard added\] \((.+?):(\d+) in (\w+)\)")
# a branch on a remainder its example took the other side of (``if L % 4 != 0:`` at L=45): torch guards it unequal
_MOD_GUARD = re.compile(r"\bNe\(Mod\(.*\[guard added\] \((.+?):(\d+) in (\w+)\)")


def batch_pinned_at(model: nn.Module, example: Inputs) -> str:
    """``window_reverse() at swin.py:13 (B = int(...))``: where in the user's code torch.export, tracing ``model``
    with a dynamic batch, pinned the batch to the example's (:func:`pinned_at`)."""
    return pinned_at(model, example, {name: {0: "batch"} for name in input_names(model, example)})


def pinned_at(model: nn.Module, example: Inputs, axes: Mapping[str, Mapping[int, str]]) -> str:
    """``forward() at ssm.py:24 (for t in range(l):)``: where in the user's code torch.export, tracing ``model``
    with ``axes`` (input -> {axis: name}) dynamic, pinned one to the example's size (a Python loop over it, a size
    computed as a Python number, a branch on it); empty where it cannot be told. Only torch's symbolic-shapes log
    says where (its first equality guard placed in a user's file, else its first on a remainder being unequal), so
    it is read, on error paths only; a torch that words it otherwise leaves the line unnamed. Failing those, a guard
    placed in a function the user's line called (numpy's ``linspace`` given ``x.shape[1]``, a torch op) is said at
    that line (:func:`_caller`); one inside a library's module (a ``transformers`` model's ``if width % patch !=
    0``) names no line."""
    said: list[tuple[str, traceback.FrameSummary | None]] = []
    catch = logging.Handler()
    catch.emit = lambda record: said.append(_heard(record.getMessage()))  # type: ignore[method-assign]
    shapes = logging.getLogger(SHAPES_LOG)
    labels = {label for dims in axes.values() for label in dims.values()}
    args = tuple(tensors(example))
    with quiet_torch():
        saved = shapes.level, shapes.propagate, shapes.handlers
        shapes.setLevel(logging.INFO)  # torch's own handler on it writes to the terminal: only ``catch`` hears
        shapes.propagate, shapes.handlers = False, [catch]
        try:
            made, names = torch_dims(labels), input_names(model, example)
            dims = (tuple({int(a): made[d] for a, d in axes.get(n, {}).items()} or None for n in names),)
            torch.export.export(FlatModel(model, example), args, dynamic_shapes=dims, strict=False)
        except Exception as exc:  # noqa: BLE001 - expected: a size is pinned; the guard's log line says where
            log.debug("torch.export with dynamic axes %s: %s", sorted(labels), first_line(exc))
        finally:
            shapes.setLevel(saved[0])
            shapes.propagate, shapes.handlers = saved[1:]
    files = {f for m in list(sys.modules.values()) if isinstance(f := getattr(m, "__file__", None), str)}
    guards = [(g, caller) for pattern in (_GUARD, _MOD_GUARD) for text, caller in said if (g := pattern.search(text))]
    # a guard in the user's files first (the branch on the size), then the user's call into a function holding one
    placed = [_in_user_file(found, files) for found, _ in guards]
    frame = next((f for f in [*placed, *(caller for _, caller in guards)] if f is not None), None)
    if frame is None:
        return ""
    code = linecache.getline(frame.filename, frame.lineno or 0).strip()
    return where(frame) + (f" ({code})" if code else "")


def _in_user_file(found: re.Match[str], files: set[str]) -> traceback.FrameSummary | None:
    """The frame a guard line of torch's log names (``found``: its file's end, line and function), where that file
    is one of the user's (``files``: those of the modules loaded); else None."""
    short, lineno, fn = found.groups()
    path = next((f for f in files if f.endswith(short) and is_user_file(f)), None)
    return traceback.FrameSummary(path, int(lineno), fn) if path is not None else None


def _heard(message: str) -> tuple[str, traceback.FrameSummary | None]:
    """A line of torch's symbolic-shapes log, with the user's frame that called into torch or numpy where it adds a
    guard (:func:`_caller`), read while the guard is being added: the log names the frame the guard lies in only."""
    return message, _caller() if "[guard added]" in message else None


def _caller() -> traceback.FrameSummary | None:
    """The innermost frame of the user's code on the running stack, where no module call lies between it and here:
    a size pinned in a function that line called (``np.linspace(0, 1, x.shape[1])``, ``x.unflatten(0, (2, 2))``)
    is that line's to fix, while one pinned inside a module the user's code called (a library's layer) is not.
    None where no such frame is."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if is_user_file(code.co_filename):
            return traceback.FrameSummary(code.co_filename, frame.f_lineno, code.co_name)
        if code.co_name == "_call_impl" and code.co_filename == _MODULE_FILE:
            return None
        frame = frame.f_back
    return None


_MODULE_FILE = nn.Module._call_impl.__code__.co_filename


def size_branch(line: str) -> bool:
    """Whether the user's code :func:`pinned_at` names (``forward() at m.py:44 (if L % self.stride != 0:)``) is an
    ``if`` statement on the size: the graph then holds the side of the branch its example took, which no fix of how
    the size is read mends. A conditional expression (``a if flag else b``) may test something else than the size
    that line reads, so it is not one."""
    return re.search(r":\d+ \((?:el)?if\b.*\)$", line) is not None
