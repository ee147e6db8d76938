"""kiln.core.compare: an integer output of many levels (uint8 pixel values) is compared by how far it is off, as a
float output is; class ids, token ids and masks stay compared value for value."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.core.compare import compare_arrays


def pixels(x: np.ndarray, dtype: str = "uint8") -> np.ndarray:
    """A tanh image in [-1, 1] as its generator's wrapper writes it: ((x + 1) * 127.5).round() in ``dtype``."""
    return np.clip(np.round((x + 1.0) * 127.5), 0, 255).astype(dtype)


@pytest.mark.parametrize("dtype", ["uint8", "int32", "int64"])
def test_pixel_values_one_level_off_are_a_small_error_not_unequal_answers(dtype: str) -> None:
    """FP16's error of 4e-4 on the tanh image rounds a few percent of pixels to their neighbour level: a cosine
    near 1, where a share of equal values of 0.97 failed a 0.99 gate as if they were class ids."""
    rng = np.random.default_rng(0)
    x = np.tanh(rng.standard_normal((16, 3, 16, 16)))
    ref, got = pixels(x, dtype), pixels(x + 4e-4 * rng.standard_normal(x.shape), dtype)
    assert 0.9 < np.mean(ref == got) < 0.99  # one level off at a few percent of the pixels
    s = compare_arrays(ref, got)
    assert s.cosine is not None and s.cosine > 0.99999 and s.sample_cosine > 0.9999
    assert s.top1_agreement is None and s.max_abs_err == 1.0 and s.levels >= 200


def test_class_ids_token_ids_and_masks_stay_compared_value_for_value() -> None:
    from kiln.core.compare import integer_levels

    rng = np.random.default_rng(0)
    classes = rng.integers(0, 10, (64, 8, 8))  # a class map: few values
    tokens = rng.integers(0, 50_000, (64, 16))  # a vocabulary's ids: sparse over their range
    mask = rng.random((64, 16)) > 0.5
    for ref in (classes, tokens, mask):
        assert integer_levels(ref) is None
        s = compare_arrays(ref, ref.copy())
        assert s.cosine is None and s.top1_agreement == 1.0 and s.levels is None
    image = pixels(np.tanh(rng.standard_normal((16, 3, 8, 8))))
    forced = compare_arrays(image, image, levels=False)  # the caller knows them for class ids
    assert forced.cosine is None and forced.top1_agreement == 1.0
