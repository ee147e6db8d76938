"""Which torch engines a run builds: the devices it lists, or by default the GPU, and the CPU only where ONNX
Runtime does not build CPU engines in the same run."""

from __future__ import annotations

import pytest
import torch

from kiln.stages.engines.config import BuildConfig
from kiln.stages.engines.registry import BACKENDS
from kiln.stages.engines.stage import _yields
from kiln.stages.engines.torch import _plan
from kiln.stages.engines.torch.config import TorchConfig


@pytest.mark.skipif(torch.cuda.is_available(), reason="the default device of a machine without a GPU")
def test_by_default_the_cpu_is_left_to_onnxruntime_and_listing_it_forces_it() -> None:
    plan = _plan(TorchConfig(), "fp32")
    assert plan.devices == ["cpu"] and plan.by_default
    why = _yields(BACKENDS["torch"], "cpu", "fp32", BuildConfig(backends=["onnxruntime", "torch"]))
    assert why is not None and "ONNX Runtime" in why and "build.torch.devices: [cpu]" in why
    assert _yields(BACKENDS["torch"], "cpu", "fp32", BuildConfig(backends=["torch"])) is None  # no rival: built
    listed = _plan(TorchConfig(devices=["cpu"]), "fp32")
    assert listed.devices == ["cpu"] and not listed.by_default


def test_onnxruntime_on_the_gpu_only_is_no_rival_on_the_cpu() -> None:
    cfg = BuildConfig.model_validate({"backends": ["onnxruntime", "torch"], "onnxruntime": {"devices": ["cuda"]}})
    assert _yields(BACKENDS["torch"], "cpu", "fp32", cfg) is None
    assert _yields(BACKENDS["torch"], "cuda", "fp16", cfg) is None  # the torch engine does not yield on the GPU
