"""`kiln precision FILE --set signature.shapes=...` records the sizes it was given for the graph's dynamic axes
(variants.json's axis_sizes), and `kiln build` of one of its variants, given no sizes itself, probes that range
and records it with the steps the graph takes between its ends."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from click.testing import CliRunner

from kiln.cli import main
from tests.stages.engines.unet_graph import images, unet_graph

SHAPES = "signature.shapes={H: [8, 32], W: [8, 32]}"


def _precision(tmp: Path, *sets: str) -> object:
    model, feed = unet_graph(tmp / "unet.onnx"), tmp / "seg.npz"
    np.savez(feed, input=images(16, 16))
    args = ["precision", str(model), "-o", str(tmp / "v"), "--variants", "int8", "--calibration", str(feed)]
    return CliRunner().invoke(main, [*args, *(a for s in sets for a in ("--set", s))])


def test_signature_shapes_are_the_sizes_recorded(tmp_path: Path) -> None:
    result = _precision(tmp_path, SHAPES)
    assert result.exit_code == 0, result.output
    recorded = json.loads((tmp_path / "v" / "variants.json").read_text())["axis_sizes"]
    assert recorded == {"H": [8, 32], "W": [8, 32]}


def test_without_shapes_the_datas_size_is_recorded(tmp_path: Path) -> None:
    result = _precision(tmp_path)
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "v" / "variants.json").read_text())["axis_sizes"] == {"H": [16], "W": [16]}


def test_shapes_naming_an_axis_the_graph_lacks_are_one_error(tmp_path: Path) -> None:
    result = _precision(tmp_path, "signature.shapes={seq: [8, 32]}")
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.startswith(("error:", "fix:"))]
    assert lines[0] == (
        "error: signature.shapes names axes ['seq']; the graph's dynamic axes besides batch are ['H', 'W']"
    )
    assert lines[1].startswith("fix: key signature.shapes by the names the graph gives its axes")


def test_a_variant_built_without_sizes_records_the_probed_range_and_steps(tmp_path: Path) -> None:
    assert _precision(tmp_path, SHAPES).exit_code == 0
    result = CliRunner().invoke(main, ["build", str(tmp_path / "v" / "int8"), "-o", str(tmp_path / "engine")])
    assert result.exit_code == 0, result.output
    meta = json.loads((tmp_path / "engine" / "kiln-engine.json").read_text())
    assert meta["axis_ranges"] == {"H": [8, 32], "W": [8, 32]}
    assert meta["axis_steps"] == {"H": [2, 0], "W": [2, 0]}


def test_a_variant_of_one_data_size_says_the_engine_takes_that_size_only(tmp_path: Path) -> None:
    assert _precision(tmp_path).exit_code == 0
    result = CliRunner().invoke(main, ["build", str(tmp_path / "v" / "int8"), "-o", str(tmp_path / "engine")])
    assert result.exit_code == 0, result.output
    assert "the engine takes H=16, W=16 only" in result.output
    meta = json.loads((tmp_path / "engine" / "kiln-engine.json").read_text())
    assert meta["axis_ranges"] == {"H": [16, 16], "W": [16, 16]}
