"""A graph whose outputs are random draws is refused where it enters the run, naming the random node and the output
it feeds, before optimize, precision and build compare runs of it (where the FP32 engine failed its gate against
its own source, with the gates blamed): an ONNX file given in place of an export, and Kiln's own export, where
draws too small for the two eager calls of ``refuse_random`` to see were called a parity error."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kiln.core.errors import ModelError
from kiln.pipeline.api import run_pipeline
from kiln.pipeline.config import config_from_dict, load_config
from kiln.pipeline.runner import settings_for
from kiln.pipeline.stage_list import stage_named
from kiln.stages.export.stage import export_direct
from kiln.stages.train import stage as train_stage
from tests.conftest import tiny_config_dict
from tests.models.random_models import export_torchscript, sampling

MODELS = "tests.models.random_models"


def test_an_onnx_file_that_samples_stops_the_run_at_the_export(tmp_path: Path) -> None:
    vae = export_torchscript(sampling("randn"), tmp_path / "vae.onnx")
    cfg = config_from_dict(
        tiny_config_dict(**{"model": {"onnx": str(vae)}, "data.name": f"{MODELS}:load", "precision.variants": ["fp32"]})
    )
    result, _ = run_pipeline(cfg, tmp_path / "w")
    assert isinstance(result.error, ModelError)
    assert result.error.message.startswith(
        "model.onnx vae.onnx draws random numbers at inference (RandomNormalLike '/RandomNormalLike' feeds output "
        "'image')"
    )
    assert "return the deterministic value at inference (a VAE's mean, mu)" in result.error.hint
    assert [r.name for r in result.records if r.status == "failed"] == ["export"]
    assert not (tmp_path / "w" / "optimize").exists()


@pytest.mark.parametrize("opset", [17, 18], ids=["torchscript", "dynamo"])
@pytest.mark.parametrize(("how", "op"), [("randn", "RandomNormalLike"), ("dropout", "Dropout with training_mode true")])
def test_draws_too_small_to_tell_apart_in_two_calls_are_refused_in_the_exported_graph(
    tmp_path: Path, opset: int, how: str, op: str
) -> None:
    """Noise of 1e-6 in a VAE's sampling, and MC dropout at a rate of 1e-6, answer two calls alike within
    ``refuse_random``'s margin; the graph then held them, passed parity, and every later check compared draws."""
    torch.manual_seed(0)
    overrides = {"model.name": f"{MODELS}:sampling", "model.params.how": how, "model.params.scale": 1e-6}
    cfg = settings_for(stage_named("export"), load_config(None, {**overrides, "export.opset": opset}))
    with pytest.raises(ModelError, match=rf"the exported graph m\.onnx draws random numbers at inference \({op} ") as e:
        export_direct(cfg, None, ("x=6",), tmp_path / "m.onnx")
    assert "feeds output 'image'" in e.value.message
    assert "F.dropout(x, p, training=self.training)" in e.value.hint


def test_the_pipeline_refuses_small_draws_in_the_graph_it_exported(tmp_path: Path, monkeypatch: Any) -> None:
    overrides = {"model.name": f"{MODELS}:sampling", "model.params": {"how": "randn", "scale": 1e-6}}
    # the train stage's check, which refuses a forward that draws in eval mode (tests/stages/train), off: the
    # export's own check of the graph is what must stop the run
    monkeypatch.setattr(train_stage, "_refuse_random_in_eval", lambda model, x: None)
    cfg = config_from_dict(tiny_config_dict(**overrides, **{"data.name": f"{MODELS}:load", "train.epochs": 1}))
    torch.manual_seed(0)
    result, _ = run_pipeline(cfg, tmp_path, stop="export")
    assert isinstance(result.error, ModelError)
    assert "the exported graph model.onnx draws random numbers at inference (RandomNormalLike" in result.error.message
    assert [r.status for r in result.records] == ["ran", "failed"]
