"""Checks of the PyTorch model on its example rows before anything is exported: a forward that answers the same
inputs differently from call to call (random draws, buffers it updates, inputs it changes in place), float64 inputs
to a float32 model, and outputs that hold no finite value. Each would otherwise surface later as a parity failure
that blames the graph."""

from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

from kiln.core.compare import max_abs_err
from kiln.core.data import Inputs, input_names, rebuild, tensors
from kiln.core.errors import ModelError
from kiln.core.text import first_line
from kiln.stages.export.parity import torch_outputs

log = logging.getLogger("kiln.export")


# Two calls on the same inputs differ by more than this share of the output's largest value (or this much, for
# outputs near zero) only where forward draws random numbers: arithmetic on one machine repeats itself exactly.
_RANDOM_SHARE, _RANDOM_FLOOR = 1e-3, 1e-5

RANDOM_HINT = (
    "draw random numbers only in training (`if self.training:`; F.dropout(x, p, training=self.training)), and "
    "return the deterministic value at inference (a VAE's mean, mu): engines are checked by comparing their "
    "outputs with the model's, which draws of their own make impossible"
)


def warn_wide_inputs(model: nn.Module, x: Inputs) -> None:
    """Say which float64 inputs a model of float32 weights is given: the graph keeps the data's dtype at its inputs,
    so every engine and every served request would take twice the bytes of float32 for a model that computes in
    float32 (numpy's default dtype is float64; a model that casts its inputs runs fine on them)."""
    weights = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if weights != {torch.float32}:
        return
    wide = [n for n, t in zip(input_names(model, x), tensors(x)) if t.dtype == torch.float64]
    if wide:
        log.warning(
            "inputs %s are float64 and the model's weights float32: the engines would take float64 inputs (twice "
            "the bytes of float32 per request); give float32 from the data function (x.float()) unless the model "
            "needs float64",
            wide,
        )


def refuse_random(model: nn.Module, x: Inputs) -> None:
    """A model that answers the same inputs differently from call to call in eval mode is an error naming why,
    before the export: its export parity, the optimizer's safety net and validation would each fail on it, or read
    it as a model whose rows depend on their batch, and blame something else. Why: buffers forward updates (a state
    kept from call to call), inputs it changes in place, or else random draws (``torch.randn_like`` in a VAE's
    forward, ``F.dropout(x, p, training=True)``). Two forwards of the export's example rows, each on a copy of them
    (the data is not changed)."""
    copy = lambda: rebuild(x, [t.clone() for t in tensors(x)])  # noqa: E731
    given = copy()
    first = torch_outputs(model, given)
    if not all(_same(a, b) for a, b in zip(tensors(given), tensors(x))):
        raise ModelError(
            "the model's forward changes its inputs in place (x.mul_(...), x /= 255): the export, the parity check "
            "and validation would each see other inputs than the data's",
            hint="compute on new tensors (x = x / 255), not in place on the inputs",
        )
    buffers = {k: b.clone() for k, b in model.named_buffers()}
    second = torch_outputs(model, copy())
    moved = _moved_output(first, second)
    if moved is None:
        return
    said = f"the model answers the same inputs differently from call to call in eval mode ({moved})"
    updated = [k for k, b in model.named_buffers() if k in buffers and not _same(b, buffers[k])]
    if updated:
        raise ModelError(
            f"{said}: its forward updates buffers ({', '.join(updated[:3])}{', ...' if len(updated) > 3 else ''}), a "
            "state kept from call to call",
            hint="update state only in training (`if self.training:`), or pass it in and return it as tensors: an "
            "engine keeps no state between calls",
        )
    raise ModelError(
        f"{said}: its forward draws random numbers (torch.randn_like, torch.rand, F.dropout with training=True)",
        hint=RANDOM_HINT,
    )


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal tensors, NaN equal to NaN."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(torch.equal(a, b) or (a.is_floating_point() and torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)))


def _moved_output(first: dict[str, np.ndarray], second: dict[str, np.ndarray]) -> str | None:
    """The first output that differs between two calls beyond arithmetic's repetition, in words; None if none."""
    for name, a in first.items():
        b = second[name]
        if a.shape != b.shape:
            return f"output '{name}': shape {a.shape}, then {b.shape}"
        if a.dtype.kind != "f":
            if not np.array_equal(a, b):
                return f"output '{name}': {int(np.sum(a != b))} of {a.size} values"
            continue
        err = max_abs_err(a, b)
        finite = np.abs(a[np.isfinite(a)])
        if err > max(_RANDOM_FLOOR, _RANDOM_SHARE * (float(finite.max()) if finite.size else 0.0)):
            return f"output '{name}': by up to {err:.3g}"
    return None


def nothing_finite(ref: Mapping[str, np.ndarray]) -> list[str]:
    """The float outputs of ``ref`` that are NaN or infinite at every value of every row (``exp`` of a sum that
    grows with the length overflows float32): the graph's NaN there equals PyTorch's, so nothing in them would be
    compared and the parity check would pass with an error of 0. An output with finite values beside its
    infinities (-inf at masked positions) is compared as usual."""
    return [n for n, r in ref.items() if r.dtype.kind == "f" and r.size and not np.isfinite(r).any()]


# The fix where random --input-shape values are what the model cannot take
REAL_INPUTS_HINT = (
    "give it real inputs in place of --input-shape's random ones: a config whose data.name is a data function the "
    "model takes (kiln export CONFIG -o FILE)"
)


def refuse_nothing_finite(model: nn.Module, x: Inputs, source: str, random: bool = False) -> None:
    """A ModelError where an output of PyTorch's on ``kiln export -o``'s own rows ``x`` (``source``, in words) is NaN
    or infinite at every value (:func:`nothing_finite`): the parity check would pass it with an error of 0, nothing
    compared, and no validation follows to fail it (the pipeline's does, at the data's size). On ``random`` inputs
    (``--input-shape``'s standard normal values) those values are the likely cause (the log of a negative number),
    and the fix asks for real ones. A model that fails on ``x`` is left to the parity check, which says why."""
    try:
        empty = nothing_finite(torch_outputs(model, x))
    except Exception as exc:  # noqa: BLE001 - the parity check runs it again and names the error
        log.debug("outputs on %s not checked for finite values: %s", source, first_line(exc))
        return
    if not empty:
        return
    said = (
        f"the model's output '{empty[0]}' is NaN or infinite at every value on {source}: nothing there can be compared"
    )
    if random:
        raise ModelError(
            f"{said}, and random normal values may be what it cannot take (the log or square root of a negative "
            "number)",
            hint=REAL_INPUTS_HINT,
        )
    raise ModelError(
        said,
        hint="find where it turns NaN or infinite (the log of 0, an exp that overflows float32, 0/0) and compute in "
        "a form that stays finite there, or check the data function's values",
    )
