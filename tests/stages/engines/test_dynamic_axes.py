"""Engines keep every dynamic axis of their source graph (issue 12, defect 1)."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from kiln.core.errors import BuildError, InputError
from kiln.core.records import TensorSpec
from kiln.stages.engines.backend import read_metadata
from kiln.stages.engines.config import BuildConfig
from kiln.stages.engines.dynamic_axes import check_engine_graph, lost_axes
from kiln.stages.engines.onnxruntime.config import OnnxRuntimeConfig, OrtAutotuneConfig
from kiln.stages.engines.onnxruntime.runner import pin_shapes
from kiln.stages.engines.registry import load_engine
from kiln.stages.engines.stage import build_engine
from tests.pipeline.test_faults import invoke
from tests.stages.engines.two_input import VOCAB, export_two_input, feeds

HAS_CUDA_EP = "CUDAExecutionProvider" in ort.get_available_providers()


def spec(name: str, *shape: int | str) -> TensorSpec:
    return TensorSpec(name=name, shape=list(shape), dtype="int64")


def test_lost_axes_names_each_fixed_axis_and_accepts_renames() -> None:
    src = [spec("ids", "batch", 128), spec("mask", "batch", "seq")]
    assert lost_axes(src, [spec("ids", "batch", 128), spec("mask", "b", "s")]) == []  # renamed: still dynamic
    assert lost_axes(src, [spec("ids", 1, 128), spec("mask", "batch", 0)]) == ["ids[0]: 'batch' -> 1"]
    assert lost_axes(src, [spec("ids", 1, 128, 1)]) == ["ids: rank 2 -> 3", "mask: missing from the engine"]


def test_check_refuses_an_engine_graph_with_a_pinned_batch(tmp_path: Path) -> None:
    src = export_two_input(tmp_path / "src.onnx")
    pinned = tmp_path / "pinned.onnx"
    onnx.save(pin_shapes(onnx.load(str(src)), {"input_ids": (1, 16), "attention_mask": (1, 16)}), str(pinned))
    check_engine_graph(src, src, "same")  # the source itself passes
    with pytest.raises(BuildError, match=r"lost dynamic axes.*input_ids\[0\]: 'batch' -> 1"):
        check_engine_graph(src, pinned, "pinned")


def test_pin_shapes_refuses_to_overwrite_a_fixed_axis(tmp_path: Path) -> None:
    """The autotuner once timed an engine fixed to batch 1 as batch 32 by pinning over the fixed axis."""
    model = pin_shapes(
        onnx.load(str(export_two_input(tmp_path / "src.onnx"))), {"input_ids": (1, 16), "attention_mask": (1, 16)}
    )
    with pytest.raises(BuildError, match="axis 0 is fixed to 1 in the engine, got 32"):
        pin_shapes(model, {"input_ids": (32, 16)})


def _build_and_run(tmp_path: Path, device: str, precision: str = "fp16") -> None:
    src = export_two_input(tmp_path / "src.onnx")
    cfg = BuildConfig(
        backends=["onnxruntime"],
        onnxruntime=OnnxRuntimeConfig(
            devices=[device], autotune=OrtAutotuneConfig(batch_sizes=[1, 32], iterations=3, warmup=1)
        ),
    )
    meta = build_engine(src, tmp_path / "e", "onnxruntime", device, precision, cfg, tmp_path / "c", max_batch=32)
    engine = onnx.load(str(tmp_path / "e" / "engine.onnx"))
    assert [d.dim_param for i in engine.graph.input for d in i.type.tensor_type.shape.dim][::2] == ["batch"] * 2
    ref = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
    with load_engine(tmp_path / "e") as runner:
        for batch in (1, 32):
            x = feeds(batch, seed=batch)
            got, want = runner.infer(x)["logits"], ref.run(None, x)[0]
            assert got.shape == (batch, 2)
            cos = float(np.dot(got.ravel(), want.ravel()) / np.linalg.norm(got) / np.linalg.norm(want))
            assert cos > 0.999, (batch, cos)
    # Which step would have pinned (issue 12's root-cause check on the GPU host: the CUDA EP's offline save?)
    print(
        "offline_fallback:",
        meta.builder_settings.get("offline_fallback"),
        "offline level:",
        (meta.backend_info["session"] or {}).get("offline_optimization"),
    )
    if device == "cuda":  # every trial that was timed ran its batch (the shape check), none failed on shape
        assert all("another shape" not in (t.get("error") or "") for t in meta.backend_info["autotune"]["trials"])
        assert set(meta.backend_info["autotune"]["choice_by_batch"]) == {"1", "32"}


def test_two_input_transformer_cpu_engine_takes_batch_1_and_32(tmp_path: Path) -> None:
    _build_and_run(tmp_path, "cpu", "fp32")  # FP16 on ORT's CPU provider computes in FP32: the audit refuses it
    meta = read_metadata(tmp_path / "e")
    assert meta.index_ranges == {"input_ids": [0, VOCAB - 1]}  # the embedding's rows; the mask indexes nothing
    x = feeds(2)
    with load_engine(tmp_path / "e") as runner:
        # ONNX's Gather would answer -1 from the table's last row, where the model's nn.Embedding refuses it
        with pytest.raises(InputError, match=rf"input 'input_ids' holds -1: .* from 0 to {VOCAB - 1}"):
            runner.infer({**x, "input_ids": np.where(x["input_ids"] == x["input_ids"][0, 0], -1, x["input_ids"])})
        with pytest.raises(InputError, match=r"inputs 'input_ids' and 'attention_mask' differ on axis batch"):
            runner.infer({**x, "attention_mask": x["attention_mask"][:1]})
        assert runner.infer({**x, "input_ids": np.full_like(x["input_ids"], VOCAB - 1)})["logits"].shape == (2, 2)


@pytest.mark.gpu
def test_two_input_transformer_fp16_cuda_engine_takes_batch_1_and_32(tmp_path: Path) -> None:
    if not HAS_CUDA_EP:
        pytest.skip("onnxruntime-gpu's CUDAExecutionProvider is not installed")
    _build_and_run(tmp_path, "cuda")


def test_cuda_offline_save_that_pins_axes_falls_back_to_the_converted_graph(tmp_path: Path, monkeypatch) -> None:
    """The fallback path, with the CUDA EP's pinning simulated (this machine has no CUDA EP): the engine file is the
    converted FP16 graph itself (FP16 weights, dynamic batch), not a CPU-EP save, and no temporary file is left."""
    from kiln.stages.engines.onnxruntime import build as backend

    src = onnx.load(str(export_two_input(tmp_path / "src.onnx")))
    monkeypatch.setattr(backend, "lost_in_model", lambda a, b: ["input_ids[0]: 'batch' -> 1"])
    dst = tmp_path / "engine.onnx"
    note, offline = backend._write_engine(
        src, dst, "cuda", "fp16", OnnxRuntimeConfig(devices=["cuda"]), cuda_here=True, to_fp16=True, keep_fp32=None
    )
    assert offline == "none" and "float16" in note
    engine = onnx.load(str(dst))
    assert [d.dim_param for d in engine.graph.input[0].type.tensor_type.shape.dim] == ["batch", ""]
    assert any(i.data_type == onnx.TensorProto.FLOAT16 for i in engine.graph.initializer)
    assert not (tmp_path / "engine.source.onnx").exists()


class _TwoTower(torch.nn.Module):
    """Images and texts in counts of their own, scored each against each (CLIP's shape of the problem)."""

    def __init__(self) -> None:
        super().__init__()
        self.img, self.txt = torch.nn.Linear(8, 4), torch.nn.Linear(6, 4)

    def forward(self, img: torch.Tensor, txt: torch.Tensor) -> torch.Tensor:
        return self.img(img) @ self.txt(txt).T


def test_first_axes_named_apart_in_the_graph_stay_apart_in_the_engine(tmp_path: Path) -> None:
    """The way signature.dynamic_axes' axis-0 error offers: a file exported with a name per first axis keeps them."""
    model, src = _TwoTower().eval(), tmp_path / "tt.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the TorchScript exporter, for its dynamic_axes
        torch.onnx.export(
            model,
            (torch.rand(2, 8), torch.rand(3, 6)),
            str(src),
            input_names=["img", "txt"],
            output_names=["scores"],
            dynamic_axes={"img": {0: "images"}, "txt": {0: "texts"}, "scores": {0: "images", 1: "texts"}},
            dynamo=False,
        )
    out = invoke("build", str(src), "-o", str(tmp_path / "engine"))
    assert out.exit_code == 0, out.output
    img, txt = np.random.rand(3, 8).astype(np.float32), np.random.rand(5, 6).astype(np.float32)
    with load_engine(tmp_path / "engine") as engine:
        got = engine.infer({"img": img, "txt": txt})
    with torch.no_grad():
        want = model(torch.from_numpy(img), torch.from_numpy(txt)).numpy()
    np.testing.assert_allclose(next(iter(got.values())), want, rtol=1e-5, atol=1e-6)


SCORES_DATA = """
import torch
from kiln.core.data import DatasetSplits


def load():
    g = torch.Generator().manual_seed(0)
    x = {"img": torch.rand(16, 8, generator=g), "txt": torch.rand(16, 6, generator=g)}
    return DatasetSplits(x, None, x, None)
"""


def test_first_axes_named_apart_stay_apart_through_kiln_run_with_model_onnx(tmp_path: Path, monkeypatch) -> None:
    """``kiln run`` from the same file (model.onnx plus data): its score output carries the texts' count at axis 1
    only, and the built engine still takes 4 images with 8 texts."""
    model, src = _TwoTower().eval(), tmp_path / "tt.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(
            model,
            (torch.rand(2, 8), torch.rand(3, 6)),
            str(src),
            input_names=["img", "txt"],
            output_names=["scores"],
            dynamic_axes={"img": {0: "images"}, "txt": {0: "texts"}, "scores": {0: "images", 1: "texts"}},
            dynamo=False,
        )
    (tmp_path / "scores_data.py").write_text(SCORES_DATA)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(
        f"model: {{onnx: {src}}}\ndata: {{name: scores_data:load}}\nprecision: {{variants: [fp32]}}\n"
        "build: {backends: [onnxruntime]}\nsignature: {batch_sizes: [1, 4]}\n"
    )
    out = invoke("run", str(cfg), "-w", str(tmp_path / "wd"), "--until", "build")
    assert out.exit_code == 0, out.output
    assert "ties" not in out.output, out.output
    img, txt = np.random.rand(4, 8).astype(np.float32), np.random.rand(8, 6).astype(np.float32)
    with load_engine(tmp_path / "wd" / "build" / "onnxruntime-cpu-fp32") as engine:
        got = engine.infer({"img": img, "txt": txt})
    with torch.no_grad():
        want = model(torch.from_numpy(img), torch.from_numpy(txt)).numpy()
    np.testing.assert_allclose(next(iter(got.values())), want, rtol=1e-5, atol=1e-6)
