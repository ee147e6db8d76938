"""The validation section names the data's own sizes as the ones the held-out inputs were cut or lengthened from,
not the validated size accuracy was measured at (``signature.shapes: {nodes: [4, 8]}`` on data of 12 nodes scores at
nodes=8, cut from 12)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from kiln.core.data import DatasetSplits
from kiln.core.records import Baseline, ValidationResult
from kiln.stages.validate.report import report_section
from kiln.stages.validate.stage import own_sizes


def _line(own: dict[str, int] | None) -> str:
    base = Baseline(accuracy=1.0, samples=1, latency_ms={}, logits_output="logits", compared=["logits"])
    base.shapes, base.scored_at, base.own_sizes = [{"nodes": 4}, {"nodes": 8}], {"nodes": 8}, own
    lines = report_section(ValidationResult(passed=True, baseline=base, engines=[], failures=[]))
    return next(line for line in lines if "Dynamic axes validated at" in line)


def test_the_cut_is_said_from_the_datas_own_size() -> None:
    line = _line({"nodes": 12})
    assert (
        "validated at: nodes=4; nodes=8 (at nodes=4; nodes=8 the held-out inputs are cut short of the data's own "
        "nodes=12" in line
    ), line


def test_a_record_without_own_sizes_reads_the_scored_point() -> None:
    assert "at nodes=4 the held-out inputs are cut short of the data's own nodes=8" in _line(None)


def test_own_sizes_are_read_from_the_held_out_data() -> None:
    x = torch.zeros(3, 12, 5)
    data = DatasetSplits(train_x=x, train_y=None, val_x=x, val_y=None)
    feeds = [({"nodes": 4}, {"x": np.zeros((3, 4, 5), np.float32)}), ({"nodes": 8}, {"x": np.zeros((3, 8, 5))})]
    ref = SimpleNamespace(feeds=feeds, axes={"x": {0: "batch", 1: "nodes"}})
    assert own_sizes(ref, data, 3) == {"nodes": 12}  # type: ignore[arg-type]
    assert own_sizes(SimpleNamespace(feeds=[({}, {"x": x.numpy()})], axes={}), data, 3) is None  # type: ignore[arg-type]
