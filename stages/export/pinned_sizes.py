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
from kiln.stages.export.torch_export import SHAPES_LOG, quiet_torch, torch_dims

log = logging.getLogger("kiln.export")


FIXED_SIZE_HINT = (
    "keep sizes in forward as tensor shapes (x.shape[1]), not Python ints (int(x.shape[1]), a length kept from "
    "__init__); a Python loop over a dynamic axis (for t in range(x.shape[1])) is unrolled to the export's size: "
    "write it with tensor ops over the whole axis (cumsum, a vectorised scan); or remove that axis from "
    "signature.dynamic_axes if the model takes one size"
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
    says where (its first equality guard placed from a user's file, else its first on a remainder being unequal), so
    it is read, on error paths only; a torch that words it otherwise leaves the line unnamed."""
    said: list[str] = []
    catch = logging.Handler()
    catch.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
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
    for found in filter(None, [*map(_GUARD.search, said), *map(_MOD_GUARD.search, said)]):
        short, lineno, fn = found.groups()
        path = next((f for f in files if f.endswith(short) and is_user_file(f)), None)
        if path is not None:
            code = linecache.getline(path, int(lineno)).strip()
            return where(traceback.FrameSummary(path, int(lineno), fn)) + (f" ({code})" if code else "")
    return ""


def size_branch(line: str) -> bool:
    """Whether the user's code :func:`pinned_at` names (``forward() at m.py:44 (if L % self.stride != 0:)``) is an
    ``if`` statement on the size: the graph then holds the side of the branch its example took, which no fix of how
    the size is read mends. A conditional expression (``a if flag else b``) may test something else than the size
    that line reads, so it is not one."""
    return re.search(r":\d+ \((?:el)?if\b.*\)$", line) is not None
