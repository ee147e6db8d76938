"""`kiln validate ENGINE --reference ...` where the reference or the engine's graph draws random numbers at inference:
one error naming the random node and the output it feeds. ONNX Runtime seeds each session alike, so an engine built
from a VAE's sampling graph passed against that graph with a cosine of 1, and a deterministic engine failed against
it with the gates blamed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import save_file

from tests.models.random_models import export_torchscript, one_row, sampling
from tests.pipeline.test_faults import assert_clean, invoke


@pytest.fixture
def engines(tmp_path: Path) -> dict[str, Path]:
    """ONNX Runtime engines of the VAE that samples and of the same VAE returning mu, their graphs, and inputs."""
    made: dict[str, Path] = {}
    for how in ("randn", "mean"):
        made[f"{how}.onnx"] = export_torchscript(sampling(how), tmp_path / f"{how}.onnx")
        made[how] = tmp_path / f"{how}-engine"
        assert invoke("build", made[f"{how}.onnx"], "-o", made[how]).exit_code == 0
    made["x.npz"] = tmp_path / "x.npz"
    np.savez(made["x.npz"], x=np.random.default_rng(0).random((4, 6), np.float32))
    return made


def test_a_random_reference_or_engine_graph_is_refused(engines: dict[str, Path]) -> None:
    said = "draws random numbers at inference (RandomNormalLike '/RandomNormalLike' feeds output 'image')"
    fix = "return the deterministic value at inference"
    for engine in ("randn", "mean"):  # the random engine against its own graph passed, with a cosine of 1
        result = invoke("validate", engines[engine], "--reference", engines["randn.onnx"], "--inputs", engines["x.npz"])
        assert_clean(result, 2, f"error: reference randn.onnx {said}", fix)
    result = invoke("validate", engines["randn"], "--reference", engines["mean.onnx"], "--inputs", engines["x.npz"])
    assert_clean(result, 2, f"error: engine randn-engine (engine.onnx) {said}", fix)


def test_a_checkpoint_reference_that_samples_is_refused(engines: dict[str, Path], tmp_path: Path) -> None:
    weights = tmp_path / "vae.safetensors"
    save_file(sampling("randn").state_dict(), str(weights))
    model = ("--set", "model.name=tests.models.random_models:sampling")
    result = invoke("validate", engines["mean"], "--reference", weights, "--inputs", engines["x.npz"], *model)
    assert_clean(result, 2, "differently from call to call in eval mode", "return the deterministic value")


def test_a_checkpoint_reference_of_one_row_a_call_is_checked_on_the_batches_it_gets(tmp_path: Path) -> None:
    """An engine exported at batch 1 runs the reference one row a call: the check that it answers alike ran it on
    two rows, and a forward that flattens to [1, 6] failed as a reference that cannot take the engine's inputs."""
    graph = export_torchscript(one_row(), tmp_path / "one.onnx", output="y", rows=1)
    assert invoke("build", graph, "-o", tmp_path / "engine").exit_code == 0
    weights, inputs = tmp_path / "one.safetensors", tmp_path / "x.npz"
    save_file(one_row().state_dict(), str(weights))
    np.savez(inputs, x=np.random.default_rng(0).random((3, 6), np.float32))
    model = ("--set", "model.name=tests.models.random_models:one_row")
    result = invoke("validate", tmp_path / "engine", "--reference", weights, "--inputs", inputs, *model)
    assert result.exit_code == 0, result.output
