"""DDP on GPUs: 2 NCCL processes (torchrun) give the result of one GPU process with the same global batch.

Needs 2 CUDA GPUs; skipped otherwise (the gloo version of this test runs in CI on CPU).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kiln.pipeline.config import KilnConfig, config_from_dict
from kiln.stages.train.launch import run_torchrun
from tests.stages.train.ddp_helpers import LOG, train_one_and_two

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]


def _config(nproc: int, model: str = "transformer", **train: Any) -> KilnConfig:
    params = {"dim": 32, "heads": 2, "layers": 1} if model == "transformer" else {"width": 8, "depth": 2}
    return config_from_dict(
        {
            "seed": 1,
            "model": {"name": model, "params": params},
            "data": {"name": "digits"} if model == "cnn" else {"name": "synthetic", "params": {"size": 256}},
            "train": {
                "epochs": 2,
                "batch_size": 32,
                "grad_accum_steps": 2,
                "precision": "fp32",
                "optimizer": "sgd",
                "lr": 0.05,
                "device": "cuda",
                "distributed": {"nproc_per_node": nproc},
                **train,
            },
        }
    )


@pytest.mark.timeout(300)
def test_two_nccl_processes_equal_one_gpu_process(tmp_path: Path) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    r = train_one_and_two(tmp_path, _config)
    diff = r.max_weight_diff()
    assert diff < 1e-5, diff
    assert r.multi["world_size"] == 2 and r.multi["steps"] == r.single["steps"]
    assert sorted(p.name for p in r.two.iterdir()) == sorted(p.name for p in r.one.iterdir())


@pytest.mark.timeout(600)
def test_compiled_ddp_on_two_gpus_equals_one_compiled_gpu_process(tmp_path: Path) -> None:
    """train.compile with DDP: torch.compile of the DDP module (DDPOptimizer splits the graph at the gradient
    buckets), 2 NCCL processes against one compiled GPU process. On 2 gloo CPU processes the same comparison
    gave a weight difference of 4.5e-8."""
    torch.backends.cuda.matmul.allow_tf32 = False
    r = train_one_and_two(tmp_path, lambda nproc: _config(nproc, compile=True))
    diff = r.max_weight_diff()
    assert diff < 1e-5, diff
    for summary in (r.single, r.multi):
        c = summary["compile"]
        assert c["compiled"] and c["fallback"] is None and c["graphs"] >= 1, c
    assert r.multi["world_size"] == 2 and r.multi["steps"] == r.single["steps"]


@pytest.mark.timeout(600)
def test_compiled_fp16_cuda_graphs_train_on_two_gpus(tmp_path: Path) -> None:
    """mode reduce-overhead (CUDA graphs) with fp16 + GradScaler, accumulation, BatchNorm (buffers mutated in the
    graph), evaluation and DDP. max-autotune takes the same path in Kiln (plus kernel autotuning, minutes)."""
    cfg = _config(
        2,
        "cnn",
        precision="fp16",
        optimizer="adamw",
        lr=3e-3,
        epochs=3,
        batch_size=64,
        compile={"mode": "reduce-overhead"},
    )
    summary = run_torchrun(cfg, tmp_path, tmp_path / "ck", LOG)
    losses = [e["loss"] for e in summary["epochs"]]
    assert summary["compile"]["compiled"] and summary["compile"]["fallback"] is None, summary["compile"]
    assert losses[-1] < losses[0] and summary["val_accuracy"] > 0.3


@pytest.mark.timeout(300)
def test_fp16_sync_batchnorm_trains_on_two_gpus(tmp_path: Path) -> None:
    cfg = _config(
        2,
        "cnn",
        precision="fp16",
        optimizer="adamw",
        lr=3e-3,
        epochs=8,
        batch_size=64,
        grad_accum_steps=1,
        distributed={"nproc_per_node": 2, "sync_batchnorm": True},
    )
    summary = run_torchrun(cfg, tmp_path, tmp_path / "ck", LOG)
    # This tiny CNN learns slowly (one CPU process reaches ~0.69 after 8 epochs; on 2 H200s with fp16 and
    # SyncBatchNorm it reached 0.58 after 3 epochs): the test asserts it trains, not how well.
    losses = [e["loss"] for e in summary["epochs"]]
    assert summary["world_size"] == 2 and losses[-1] < losses[0] and summary["val_accuracy"] > 0.3
