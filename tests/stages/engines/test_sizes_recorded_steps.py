"""An engine built from an exported file given no sizes keeps the axis steps the export recorded in its metadata
(``kiln.axis_steps``), and its feed check refuses a size off them with Kiln's InputError though no range is
recorded."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kiln import load_engine
from kiln.core.errors import InputError
from kiln.core.onnx_io import set_metadata
from kiln.stages.engines.config import BuildConfig
from kiln.stages.engines.stage import build_direct
from kiln.stages.export.declaration import GRAPH_STEPS_KEY
from tests.stages.engines.unet_graph import unet_graph


def test_an_engine_built_without_sizes_refuses_sizes_off_the_recorded_steps(tmp_path: Path) -> None:
    """H runs at every even size in ONNX Runtime; the export recorded that it computes the model at multiples of 4
    only: H=6 runs in the graph but is refused, H=8 answers."""
    src = unet_graph(tmp_path / "unet.onnx")
    set_metadata(src, GRAPH_STEPS_KEY, json.dumps({"H": [4, 0]}))
    build_direct(src, tmp_path / "e", "onnxruntime", "cpu", None, BuildConfig(), None)
    meta = json.loads((tmp_path / "e" / "kiln-engine.json").read_text())
    assert meta["axis_ranges"] == {} and meta["axis_steps"] == {"H": [4, 0]}
    rng = np.random.default_rng(0)
    with load_engine(tmp_path / "e") as runner:
        with pytest.raises(InputError, match=r"\(H\) is 6: .* in steps of 4 .*nearest sizes it takes are 4 and 8"):
            runner.infer({"input": rng.random((1, 3, 6, 8), dtype=np.float32)})
        (got,) = runner.infer({"input": rng.random((1, 3, 8, 6), dtype=np.float32)}).values()
    assert got.shape == (1, 4, 8, 6)
