"""Checks of the PyTorch model on its example rows before anything is exported: float64 inputs to a float32 model,
and outputs that hold no finite value. Each would otherwise surface later as a parity failure that blames the graph.
A forward that answers the same inputs differently from call to call is :mod:`kiln.models.determinism`'s to refuse
(training checks it too)."""

from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

from kiln.core.data import Inputs, input_names, tensors
from kiln.core.errors import ModelError
from kiln.core.text import first_line
from kiln.stages.export.parity import torch_outputs

log = logging.getLogger("kiln.export")


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
