"""Direct export's example inputs (:func:`kiln.stages.export.input_specs.example_inputs`): an integer input named
like lengths holds a length within every axis of the other inputs, not 0 or 1, which would mask every attention key
and make the parity check blame the model."""

from __future__ import annotations

import torch

from kiln.stages.export.input_specs import example_inputs, parse_input_shapes


def test_lengths_hold_a_length_within_every_axis_and_ids_stay_small() -> None:
    specs = parse_input_shapes(("features=64,80", "lengths=():int64", "seq_len=1:int32", "ids=4:int64"))
    x = example_inputs(specs, 8)
    assert isinstance(x, dict)
    # the frames (64), not the features (80): a length past the frames would fail pack_padded_sequence
    assert torch.equal(x["lengths"], torch.full((8,), 4, dtype=torch.int64))  # ids' 4 is the smallest axis
    assert torch.equal(x["seq_len"], torch.full((8, 1), 4, dtype=torch.int32))
    assert int(x["ids"].max()) <= 1
    x = example_inputs(parse_input_shapes(("features=64,80", "lengths=():int64")), 2)
    assert torch.equal(x["lengths"], torch.full((2,), 64, dtype=torch.int64))
