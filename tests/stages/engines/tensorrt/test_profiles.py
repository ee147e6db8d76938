"""Optimization profiles for dynamic axes beyond batch (a sequence axis): min/opt/max per axis, built and run."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kiln.core.data import take
from kiln.core.errors import ConfigError
from kiln.core.records import TensorSpec
from kiln.models.datasets import synthetic_text
from kiln.models.registry import build_model
from kiln.stages.engines.config import BuildConfig
from kiln.stages.engines.tensorrt.profiles import default_profiles

SEQ_AXES = {"input_ids": {1: "seq"}, "attention_mask": {1: "seq"}}


def test_a_named_axis_spans_its_sizes() -> None:
    specs = [
        TensorSpec(name="input_ids", shape=["batch", "seq"], dtype="int64"),
        TensorSpec(name="feat", shape=["batch", 4], dtype="float32"),
    ]
    (profile,) = default_profiles(specs, 32, {"seq": [8, 128]})
    assert profile["input_ids"].model_dump() == {"min": [1, 8], "opt": [32, 128], "max": [32, 128]}
    assert profile["feat"].model_dump() == {"min": [1, 4], "opt": [32, 4], "max": [32, 4]}
    with pytest.raises(ConfigError, match=r"dynamic axes \['seq'\] besides the batch axis") as err:
        default_profiles(specs, 32)
    assert "signature.shapes={seq: [16, 64]}" in (err.value.hint or "")  # the one name it lacks, not the shape


@pytest.mark.tensorrt
def test_kiln_build_of_a_file_takes_signature_shapes_for_its_named_axes(token_onnx: Path, tmp_path: Path) -> None:
    """`kiln build model.onnx --backend tensorrt` sizes the graph's own dynamic axes from signature.shapes, as its
    error's fix line says, and records them as the engine's ranges."""
    import json

    from click.testing import CliRunner

    from kiln.cli import main

    out, shapes = tmp_path / "e", "signature.shapes={seq: [8, 16]}"
    args = ["build", str(token_onnx), "--backend", "tensorrt", "-o", str(out), "--set", shapes]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert json.loads((out / "kiln-engine.json").read_text())["axis_ranges"] == {"seq": [8, 16]}


@pytest.mark.tensorrt
def test_kiln_build_of_a_file_takes_signature_batch_sizes_for_its_profile(zoo, tmp_path: Path) -> None:
    """`kiln build model.onnx --backend tensorrt` sizes the profile's batch from signature.batch_sizes, as the
    pipeline's build does: an engine asked for batch 64 takes it."""
    import json

    from click.testing import CliRunner

    from kiln.cli import main

    out = tmp_path / "e"
    args = ["build", str(zoo("cnn")), "--backend", "tensorrt", "-o", str(out), "--set", "signature.batch_sizes=[1,64]"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    meta = json.loads((out / "kiln-engine.json").read_text())
    assert meta["batch_range"] == [1, 64]
    assert [p["max"][0] for profile in meta["backend_info"]["profiles"] for p in profile.values()] == [64]


@pytest.fixture(scope="module")
def token_onnx(tmp_path_factory) -> Path:
    from kiln.stages.export.torch_export import export_onnx

    path = tmp_path_factory.mktemp("tok") / "model.onnx"
    model = build_model("token_classifier", {"dim": 16, "layers": 1}).eval()
    export_onnx(model, take(synthetic_text(size=8).val_x, slice(0, 2)), path, dynamic_axes=SEQ_AXES)
    return path


@pytest.mark.tensorrt
def test_tensorrt_profile_covers_the_sequence_axis(token_onnx: Path, tmp_path: Path) -> None:
    from kiln.stages.engines.stage import build_engine

    meta = build_engine(
        token_onnx,
        tmp_path / "e",
        "tensorrt",
        "cuda",
        "fp32",
        BuildConfig(backends=["tensorrt"]),
        tmp_path / "cache",
        max_batch=32,
        axis_sizes={"seq": [8, 16]},
    )
    assert meta.backend_info["profiles"] == [{n: {"min": [1, 8], "opt": [32, 16], "max": [32, 16]} for n in SEQ_AXES}]


@pytest.mark.gpu
@pytest.mark.trt_runtime
@pytest.mark.parametrize("backend", ["tensorrt", "onnxruntime"])
def test_engine_runs_at_both_lengths_and_batches(token_onnx: Path, tmp_path: Path, backend: str) -> None:
    """On a GPU: the engine agrees with ONNX Runtime CPU at seq 8 and 16, batch 1 and 32 (TensorRT: one profile;
    ONNX Runtime CUDA: one slot per shape)."""
    from kiln.core.onnx_io import ort_session
    from kiln.stages.engines.registry import load_engine
    from kiln.stages.engines.stage import build_engine

    build_engine(
        token_onnx,
        tmp_path / "e",
        backend,
        "cuda",
        "fp32",
        BuildConfig(backends=[backend]),
        tmp_path / "cache",
        max_batch=32,
        axis_sizes={"seq": [8, 16]},
    )
    ref = ort_session(token_onnx)
    rng = np.random.default_rng(0)
    with load_engine(tmp_path / "e") as engine:
        for batch in (1, 32):
            for seq in (8, 16):
                mask = (np.arange(seq)[None] < rng.integers(1, seq + 1, (batch, 1))).astype(np.int64)
                feed = {"input_ids": rng.integers(1, 64, (batch, seq)) * mask, "attention_mask": mask}
                want = dict(zip([o.name for o in ref.get_outputs()], ref.run(None, feed)))
                got = engine.infer(feed)
                for name, value in want.items():
                    assert got[name].shape == value.shape
                    assert np.allclose(got[name], value, atol=1e-3, rtol=1e-3), (batch, seq, name)


def test_an_unnamed_dynamic_axis_is_told_to_take_a_name_first() -> None:
    """A file whose axis 1 is dynamic but unnamed: no size can be given by a name, so the fix names it first (a
    signature.shapes key of ``0`` or ``''`` could not work)."""
    spec = TensorSpec(name="x", shape=["batch", 0, 8], dtype="float32")
    with pytest.raises(ConfigError) as err:
        default_profiles([spec], 8, {})
    assert "axis 1 unnamed" in err.value.hint and "signature.dynamic_axes: {x: {1: seq}}" in err.value.hint
    assert "signature.shapes={0:" not in err.value.hint


def test_a_named_dynamic_axis_is_given_sizes_by_its_name() -> None:
    spec = TensorSpec(name="ids", shape=["batch", "seq_len"], dtype="int64")
    with pytest.raises(ConfigError) as err:
        default_profiles([spec], 8, {})
    assert "signature.shapes={seq_len: [16, 64]}" in err.value.hint
