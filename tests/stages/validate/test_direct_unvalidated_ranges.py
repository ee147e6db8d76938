"""`kiln validate ENGINE --reference` warns of each dynamic axis whose range the engine accepts reaches past the
sizes it compared: an engine built for seq 2..12 and checked on --inputs of seq 6 alone passed with no word, and its
runner still takes seq 2 and 12."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.pipeline.test_faults import invoke
from tests.stages.validate.test_direct_shapes import _engine

WARNED = "the engine accepts seq 2..12, validated here only at seq 6"


def _said(tmp_path: Path, *sets: str) -> str:
    """The output of validating the seq 2..12 engine on --inputs of seq 6, with each ``--set`` of ``sets``."""
    engine = _engine(tmp_path)
    np.savez(tmp_path / "x.npz", x=np.random.default_rng(0).uniform(1, 2, (32, 6)).astype(np.float32))
    args = ("validate", engine, "--reference", tmp_path / "m.onnx", "--inputs", tmp_path / "x.npz")
    out = invoke(*args, *(a for s in sets for a in ("--set", s)))
    assert out.exit_code == 0, out.output
    return " ".join(out.output.split())  # the log's lines wrap at the terminal's width


def test_an_accepted_range_wider_than_the_sizes_validated_is_warned_of(tmp_path: Path) -> None:
    said = _said(tmp_path)
    assert WARNED in said and "--set signature.shapes.seq=[2,12] to validate there" in said, said


def test_the_ranges_ends_validated_are_not_warned_of(tmp_path: Path) -> None:
    said = _said(tmp_path, "signature.shapes.seq=[2,12]")
    assert "the engine accepts" not in said, said
