"""rel_error: the comparator's relative L2 error, measured without the comparator's other statistics where it sets
nothing aside."""

from __future__ import annotations

import numpy as np
import pytest

import kiln.stages.precision.compare as compare
from kiln.core.compare import compare_arrays


def _pairs() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    r = rng.standard_normal((4, 3, 5)).astype(np.float32)
    g = r + 1e-3 * rng.standard_normal(r.shape).astype(np.float32)
    nan_both, inf_one, fill = r.copy(), g.copy(), r.copy()
    nan_both[0, 0, 0] = np.nan
    inf_one[1, 1, 1] = np.inf
    fill[:, 0, :2] = -1e9  # a mask fill the comparator sets aside where both hold it
    return {
        "close": (r, g),
        "fp16": (r, g.astype(np.float16)),
        "zeros": (np.zeros_like(r), g),
        "both_zero": (np.zeros_like(r), np.zeros_like(r)),
        "empty": (r[:0], g[:0]),
        "nan_in_both": (nan_both, np.where(np.isnan(nan_both), np.nan, g)),
        "inf_in_one": (r, inf_one),
        "mask_fill": (fill, np.where(fill == -1e9, -np.inf, g)),
        "integers": (np.arange(12).reshape(3, 4), np.arange(12).reshape(3, 4) + (np.arange(12).reshape(3, 4) == 5)),
    }


@pytest.mark.parametrize("case", list(_pairs()))
def test_rel_error_is_the_comparators(case: str) -> None:
    ref, got = _pairs()[case]
    expected = compare_arrays(ref, got).rel_err
    assert compare.rel_error(ref, got) == pytest.approx(expected, rel=1e-12, abs=0.0, nan_ok=True)


def test_rel_error_of_plain_arrays_skips_the_full_comparator(monkeypatch: pytest.MonkeyPatch) -> None:
    ref, got = _pairs()["close"]
    expected = compare_arrays(ref, got).rel_err

    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("compare_arrays called for finite arrays without mask fills")

    monkeypatch.setattr(compare, "compare_arrays", refuse)
    assert compare.rel_error(ref, got) == pytest.approx(expected, rel=1e-12)


def test_rel_error_of_other_shapes_is_infinite() -> None:
    assert compare.rel_error(np.zeros((2, 3)), np.zeros((3, 2))) == float("inf")
