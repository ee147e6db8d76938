"""Padded batches for shape-specialised engines: the sizes, the padding, the answer cut back to the rows asked for,
and which runners get it."""

from __future__ import annotations

from typing import Any

import numpy as np

from kiln.serve.batching import batch_buckets, buckets_for, padded_infer, warm_buckets


class Doubler:
    """A runner whose answer is its input doubled, recording the batch sizes it ran (what a padded call costs)."""

    def __init__(self, per_shape: bool) -> None:
        self.per_shape_sessions, self.ran = per_shape, []

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, Any]:
        x = inputs["x"]
        self.ran.append(len(x))
        return {"y": x * 2}


class _Spec:
    def __init__(self, shape: list[Any]) -> None:
        self.name, self.shape, self.dtype = "x", shape, "float32"


class _Meta:
    def __init__(self, shape: list[Any]) -> None:
        self.inputs = [_Spec(shape)]


def test_buckets_are_powers_of_two_up_to_the_largest_batch() -> None:
    assert batch_buckets(32) == [1, 2, 4, 8, 16, 32] and batch_buckets(24) == [1, 2, 4, 8, 16, 24]
    assert batch_buckets(1) == [1]


def test_only_shape_specialised_engines_with_a_batch_axis_are_padded() -> None:
    assert buckets_for(Doubler(per_shape=True), 8) == [1, 2, 4, 8]
    assert buckets_for(Doubler(per_shape=False), 8) is None
    assert buckets_for(Doubler(per_shape=True), 0) is None  # served without a batch axis


def test_a_padded_call_answers_exactly_the_rows_asked_for() -> None:
    runner = Doubler(per_shape=True)
    x = np.arange(5 * 3, dtype=np.float32).reshape(5, 3)
    out = padded_infer(runner, {"x": x}, [1, 2, 4, 8])
    assert runner.ran == [8] and out["y"].shape == (5, 3)
    np.testing.assert_array_equal(out["y"], x * 2)
    assert padded_infer(runner, {"x": x[:4]}, [1, 2, 4, 8])["y"].shape == (4, 3) and runner.ran[-1] == 4
    assert padded_infer(runner, {"x": x}, None)["y"].shape == (5, 3) and runner.ran[-1] == 5


def test_every_bucket_is_built_before_ready_unless_an_axis_besides_the_batch_is_dynamic() -> None:
    runner = Doubler(per_shape=True)
    assert warm_buckets(runner, _Meta([-1, 3]), [1, 2, 4]) and runner.ran == [1, 2, 4]
    assert not warm_buckets(runner, _Meta([-1, "seq"]), [1, 2, 4]) and runner.ran == [1, 2, 4]
