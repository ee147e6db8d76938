"""``kiln build FILE`` records the axis steps the file's export wrote into its metadata (``kiln.axis_steps``: sizes
where the graph runs but computes another function, which a probe of where the graph runs cannot find), merged
with the steps its own probe finds, so the engine refuses sizes off either with Kiln's InputError."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from kiln import load_engine
from kiln.cli import main
from kiln.core.errors import InputError, InputFileError
from kiln.core.onnx_io import set_metadata
from kiln.pipeline.config import load_config
from kiln.pipeline.runner import settings_for
from kiln.pipeline.stage_list import stage_named
from kiln.stages.engines.config import BuildConfig
from kiln.stages.engines.stage import build_direct
from kiln.stages.export.declaration import GRAPH_STEPS_KEY
from kiln.stages.export.stage import export_direct
from tests.stages.engines.unet_graph import images, unet_graph
from tests.stages.export.test_graph_steps import CHANNELS, PadsWhenNotAMultiple

MODELS = "tests.stages.export.test_graph_steps"
SEQ_8_16 = "signature.shapes={seq: [8, 16]}"


def _exported(tmp: Path) -> Path:
    """``kiln export -o`` of the model that pads when a length is not a multiple of 4, on series of 16 steps, with
    the weights of :func:`_weights`."""
    sets = {"model.name": f"{MODELS}:branchy", "data.name": f"{MODELS}:at_16"}
    cfg = load_config(None, {**sets, "signature.dynamic_axes": {"input": {1: "seq"}}})
    path = tmp / "m.onnx"
    weights = tmp / "w.safetensors"
    save_file(_weights().state_dict(), str(weights))
    export_direct(settings_for(stage_named("export"), cfg), str(weights), (), path)
    return path


def _weights() -> PadsWhenNotAMultiple:
    """The model the tests export, its weights seeded."""
    torch.manual_seed(0)
    return PadsWhenNotAMultiple().eval()


def test_kiln_build_of_an_exported_file_refuses_sizes_off_its_recorded_steps(tmp_path: Path) -> None:
    """The graph runs at every length (a probe of where it runs finds no steps) but is right at multiples of 4
    only: the engine records the file's [4, 0], refuses 13 as servers do and answers 12 as PyTorch."""
    path, model = _exported(tmp_path), _weights()
    engine = tmp_path / "engine"
    result = CliRunner().invoke(main, ["build", str(path), "-o", str(engine), "--set", SEQ_8_16])
    assert result.exit_code == 0, result.output
    meta = json.loads((engine / "kiln-engine.json").read_text())
    assert meta["axis_ranges"] == {"seq": [8, 16]} and meta["axis_steps"] == {"seq": [4, 0]}
    x = torch.randn(1, 12, CHANNELS, generator=torch.Generator().manual_seed(1))
    with load_engine(engine) as runner:
        with pytest.raises(InputError, match=r"seq\) is 13: .* only in steps of 4"):
            runner.infer({"input": np.zeros((1, 13, CHANNELS), np.float32)})
        (got,) = runner.infer({"input": x.numpy()}).values()
    assert np.allclose(got, model(x).detach().numpy(), atol=1e-5)


def test_recorded_steps_merge_with_the_probes(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The U-Net graph runs at even sizes (the probe's [2, 0]); its metadata says H is right at multiples of 4 and
    W at sizes 1 modulo 3: a size must be on both, and a given size off the recorded steps is warned of."""
    src = unet_graph(tmp_path / "unet.onnx")
    set_metadata(src, GRAPH_STEPS_KEY, json.dumps({"H": [4, 0], "W": [3, 1]}))
    with caplog.at_level(logging.WARNING, logger="kiln.build"):
        meta = build_direct(
            src, tmp_path / "e", "onnxruntime", "cpu", None, BuildConfig(), {"H": [8, 32], "W": [8, 32]}
        )
    assert meta.axis_steps == {"H": [4, 0], "W": [6, 4]}
    assert "axis W: signature.shapes gives W=8, W=32, where the graph of unet.onnx does not compute" in caplog.text
    assert "axis H: signature.shapes gives" not in caplog.text
    with load_engine(tmp_path / "e") as runner:
        with pytest.raises(InputError, match=r"\(H\) is 10: "):
            runner.infer({"input": images(1, 10)})


def test_steps_metadata_of_another_form_is_one_error_with_its_fix(tmp_path: Path) -> None:
    src = unet_graph(tmp_path / "unet.onnx")
    set_metadata(src, GRAPH_STEPS_KEY, '{"H": [4, 9]}')
    result = CliRunner().invoke(
        main, ["build", str(src), "-o", str(tmp_path / "e"), "--set", "signature.shapes={H: [8, 32], W: [8, 32]}"]
    )
    lines = result.output.splitlines()
    assert result.exit_code != 0 and "Traceback" not in result.output, result.output
    assert [x for x in lines if x.startswith(("error:", "fix:"))] == [
        f"error: {src}: its metadata {GRAPH_STEPS_KEY} is not axis -> [period, *residues] (as "
        '{"seq": [4, 0]}): \'{"H": [4, 9]}\'',
        f"fix: export the file again with `kiln export ... -o FILE`, or remove {GRAPH_STEPS_KEY} from its "
        "metadata_props",
    ]
    with pytest.raises(InputFileError):
        build_direct(src, tmp_path / "e", "onnxruntime", "cpu", None, BuildConfig(), {"H": [8, 32], "W": [8, 32]})
