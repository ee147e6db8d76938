"""The shared check's reference: labels that do not fit the class-logit output are one error naming both shapes."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.core.errors import ModelError
from kiln.stages.accuracy.check import Reference


def reference(logits_shape: tuple[int, ...], labels: np.ndarray) -> Reference:
    x = np.zeros((logits_shape[0], 3), np.float32)
    out = np.random.default_rng(0).standard_normal(logits_shape).astype(np.float32)
    return Reference(lambda feed: {"logits": out[: len(feed["x"])]}, [({}, {"x": x})], [labels], "logits", 4)


@pytest.mark.parametrize(
    "logits_shape, labels_shape",
    [((4, 10), (4, 2)), ((4, 5, 10), (4,)), ((4, 3, 8, 8), (4, 8, 9)), ((4, 10), (3,))],
)
def test_labels_that_do_not_fit_the_logits_are_named(logits_shape: tuple, labels_shape: tuple) -> None:
    with pytest.raises(ModelError, match=rf"labels int64\[{', '.join(map(str, labels_shape))}\] do not fit"):
        reference(logits_shape, np.zeros(labels_shape, np.int64))


def test_labels_per_row_and_per_position_fit() -> None:
    assert reference((4, 10), np.zeros(4, np.int64)).accuracy is not None
    assert reference((4, 5, 10), np.zeros((4, 5), np.int64)).accuracy is not None
    assert reference((4, 3, 8, 8), np.zeros((4, 8, 8), np.int64)).accuracy is not None
