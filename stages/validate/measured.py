"""Whether a comparison measured anything: outputs whose every value the reference and the engine hold alike as no
number (NaN, infinity, a mask's fill) compare as equal (:func:`~kiln.core.compare.set_aside`), with cosine 1 and
error 0, so such an output would pass its gates; nothing measured is no pass. One check for ``kiln validate ENGINE``
and the pipeline's validate stage, and the fix they give for it."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import numpy as np

from kiln.core.compare import set_aside

log = logging.getLogger("kiln.validate")

NOTHING_COMPARED = "nothing was compared there"  # in every failure of nothing_measured: how the fix tells them apart
NO_FINITE_FIX = (
    "the model gives no finite output at these inputs (it overflows, or they are sizes it cannot take): validate at "
    "inputs/sizes it takes (signature.shapes; real inputs: data.name in a run, --inputs for kiln validate ENGINE)"
)


def empty_samples(ref: np.ndarray, got: np.ndarray) -> np.ndarray | None:
    """Per sample (row of the batch axis) of a float output, whether every value is one ``ref`` and ``got`` hold
    alike as no number (:func:`~kiln.core.compare.set_aside`); None for an output with no samples to tell apart
    (an integer one, a scalar, an empty one, shapes that differ)."""
    if ref.dtype.kind != "f" or not ref.size or ref.ndim == 0 or np.shape(got) != ref.shape:
        return None
    return set_aside(ref, got).reshape(len(ref), -1).all(axis=1)


def has_no_number_samples(outputs: dict[str, np.ndarray]) -> bool:
    """Whether some sample of a float output of the reference holds no number at all (NaN, infinity or a mask's
    fill at every value): only there can an engine's output compare as equal with nothing measured."""
    return any((empty := empty_samples(r, r)) is not None and empty.any() for r in outputs.values())


def nothing_measured(
    ref: dict[str, np.ndarray], got: dict[str, np.ndarray], at: str = "", engine: str = "the engine"
) -> list[str]:
    """A failure for each float output with nothing compared on any sample (``at``: where, e.g. `` at seq=96``);
    a warning for one with nothing compared on some samples only, which are left out of its statistics while the
    others are compared as usual (a sample with a masked value among others is compared on those others)."""
    failures = []
    for name, r in ref.items():
        empty = empty_samples(r, got[name]) if name in got else None
        if empty is None or not empty.any():
            continue
        if empty.all():
            failures.append(
                f"reference output '{name}' is NaN, infinite or a mask's fill at every value of all {len(r)} "
                f"samples{at}, and so is {engine}'s output: {NOTHING_COMPARED} (the model overflows at these "
                "inputs, or they are inputs it cannot take, e.g. lengths shorter than its subsampling)"
            )
            continue
        log.warning(
            "reference output '%s' is NaN, infinite or a mask's fill at every value of %d of %d samples (sample %d "
            "first)%s, and so is %s's output: nothing was compared on those samples",
            name,
            int(empty.sum()),
            len(r),
            int(np.flatnonzero(empty)[0]),
            at,
            engine,
        )
    return failures


def unmeasured(failures: Iterable[str]) -> list[str]:
    """Of gate failures, those :func:`nothing_measured` gave: no gate setting or precision changes them."""
    return [f for f in failures if NOTHING_COMPARED in f]
