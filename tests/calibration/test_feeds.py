"""Calibration batches saved by the precision stage for the torch backend's FP8/INT8 scales."""

from __future__ import annotations

import numpy as np

from kiln.calibration.feeds import load_feeds, save_feeds


def test_feeds_round_trip_within_their_caps(tmp_path) -> None:
    """One input's batches (arrays) and several inputs' (named feeds) come back by name, capped in rows and bytes."""
    rng = np.random.default_rng(0)
    one = [rng.standard_normal((8, 4)).astype(np.float32) for _ in range(5)]
    assert save_feeds(one, ["x"], tmp_path / "a.npz", max_rows=20) == 3  # 8 + 8 + 4 rows
    back = load_feeds(tmp_path / "a.npz", ["x"])
    assert [len(f["x"]) for f in back] == [8, 8, 4] and np.array_equal(back[0]["x"], one[0])
    two = [{"ids": rng.integers(0, 9, (4, 6)), "mask": np.ones((4, 6), np.int64)} for _ in range(3)]
    assert save_feeds(two, ["ids", "mask"], tmp_path / "b.npz", max_bytes=2 * 4 * 6 * 8 * 2) == 2  # two batches fit
    back = load_feeds(tmp_path / "b.npz", ["ids", "mask"])
    assert len(back) == 2 and np.array_equal(back[1]["ids"], two[1]["ids"])
    assert load_feeds(tmp_path / "b.npz", ["ids", "other"]) == []  # a feed must hold every input the engine takes
