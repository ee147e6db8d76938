"""An output without a batch axis (a 0-D loss beside the logits): one value a call, whose cosine is its sign."""

from __future__ import annotations

import numpy as np

from kiln.core.compare import compare_arrays, compare_outputs


def test_a_0d_output_has_no_cosine_and_its_error_is_over_its_norm() -> None:
    stats = compare_arrays(np.array(2.0, np.float32), np.array(3.0, np.float32))  # 1.5x off
    assert stats.cosine is None and stats.sample_cosine is None and stats.top1_agreement is None
    assert abs(stats.rel_err - 0.5) < 1e-9


def test_values_stacked_one_a_call_are_compared_whole() -> None:
    ref = np.array([2.0, 2.1, 1.9])  # a batch-level loss, one value per call
    stats = compare_outputs({"aux": ref}, {"aux": 1.5 * ref}, whole=["aux"])["aux"]
    assert stats.cosine is None and stats.sample_cosine is None
    assert abs(stats.rel_err - 0.5) < 1e-9
    assert compare_outputs({"aux": ref}, {"aux": 1.5 * ref})["aux"].cosine > 0.9999  # what a cosine would say
