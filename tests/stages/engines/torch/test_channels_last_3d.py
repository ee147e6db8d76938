"""channels_last on a model of Conv3d layers builds, its 5-D weights and inputs in their own layout:
``model.to(memory_format=torch.channels_last)`` refused them, and the build blamed torch.export."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from kiln.core.records import TensorSpec
from kiln.stages.engines.backend import BuildRequest
from kiln.stages.engines.torch import build
from kiln.stages.engines.torch.config import TorchConfig


def _video() -> nn.Module:
    return nn.Sequential(nn.Conv3d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool3d(1), nn.Flatten())


def _request(tmp_path: Path) -> BuildRequest:
    return BuildRequest(
        onnx_path=tmp_path / "unused.onnx",
        out=tmp_path / "out",
        device="cpu",
        precision="fp32",
        settings=TorchConfig(devices=["cpu"], channels_last="on"),
        cache_dir=tmp_path / "cache",
        inputs=[TensorSpec(name="video", shape=["batch", 3, 4, 8, 8], dtype="float32")],
        max_batch=2,
        axis_sizes={},
        name="torch-cpu-fp32",
        torch_model=_video,
    )


def test_channels_last_on_a_conv3d_model_captures_it_in_its_own_layout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    captured: list[Any] = []

    def package(req: BuildRequest, exported: Any, args: Any, common: dict[str, Any]) -> dict[str, Any]:
        captured.append((exported, args))
        return {"common": common}

    monkeypatch.setattr(build, "_build_package", package)
    common = build.build_torch_engine(_request(tmp_path))["common"]
    assert common["channels_last"] is True
    exported, args = captured[0]
    weight = next(t for t in exported.state_dict.values() if t.dim() == 5)
    assert weight.is_contiguous()
    torch.testing.assert_close(exported.module()(*args)[0], _video_like(exported)(*args))


def _video_like(exported: Any) -> nn.Module:
    """A plain copy of the exported model's weights, in its own layout: the reference its outputs must match."""
    model = _video()
    model.load_state_dict({k.removeprefix("model."): v.contiguous() for k, v in exported.state_dict.items()})
    return model.eval()


def test_only_4d_weights_take_channels_last() -> None:
    mixed = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Conv3d(3, 4, 3), nn.Linear(3, 4))
    build._weights_in_channels_last(mixed)
    assert mixed[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert mixed[1].weight.is_contiguous()
    assert mixed[2].weight.is_contiguous()
