"""``kiln validate --reference`` on a time-major output: the worst sample is a sample, not a time step."""

from types import SimpleNamespace
from typing import Any

import numpy as np

from kiln.core.records import TensorSpec
from kiln.stages.validate.direct import _compared, batch_axis


def _meta(shape: list[Any]) -> Any:
    """What the comparison reads of an engine's record: its inputs' and outputs' declared axes."""
    return SimpleNamespace(
        inputs=[TensorSpec(name="x", shape=["batch", 4], dtype="float32")],
        outputs=[TensorSpec(name="y", shape=shape, dtype="float32")],
    )


def test_worst_sample_of_a_time_major_output_is_along_its_batch_axis() -> None:
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((12, 5, 8))  # [T=12, N=5, C=8]
    got = ref.copy()
    got[:, 3] += rng.standard_normal((12, 8))  # sample 3 is wrong at every step
    meta = _meta(["batch", "batch", 8])  # as an exporter declares it: both axes dynamic and named alike
    feed = {"x": np.zeros((5, 4), np.float32)}
    stats, _, _ = _compared(meta, [feed], [{"y": ref}], [{"y": got}], None)
    assert stats["y"].worst_sample == 3 and stats["y"].sample_cosine < 0.9


def test_batch_axis_of_the_record() -> None:
    assert batch_axis(_meta(["batch", 8]), "y", (5, 8), 5) == 0
    assert batch_axis(_meta(["time", "batch", 8]), "y", (12, 5, 8), 5) == 1
    assert batch_axis(_meta(["batch", "batch", 8]), "y", (5, 5, 8), 5) is None  # cannot tell them apart
    assert batch_axis(_meta([12, 5, 8]), "y", (12, 5, 8), 5) is None  # no axis declared
