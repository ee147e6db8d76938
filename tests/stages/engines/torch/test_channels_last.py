"""channels_last chosen by auto that breaks torch.export is dropped, the model captured in its own layout, and the
engine records why; asked for explicitly, the failure names the setting. The export itself is replaced here by one
that refuses channels_last (the held-out UNet's failure needs that model), the decision around it is Kiln's own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from torch import nn

from kiln.core.errors import BuildError
from kiln.core.records import TensorSpec
from kiln.stages.engines.backend import BuildRequest
from kiln.stages.engines.torch import build
from kiln.stages.engines.torch.config import TorchConfig


def _request(tmp_path: Path, channels_last: str) -> BuildRequest:
    return BuildRequest(
        onnx_path=tmp_path / "unused.onnx",
        out=tmp_path / "out",
        device="cpu",
        precision="fp32",
        settings=TorchConfig(devices=["cpu"], channels_last=channels_last),
        cache_dir=tmp_path / "cache",
        inputs=[TensorSpec(name="input", shape=["batch", 3, "height", "width"], dtype="float32")],
        max_batch=2,
        axis_sizes={"height": [8, 16], "width": [8, 16]},
        name="torch-cpu-fp32",
        torch_model=lambda: nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU()),
    )


@pytest.fixture
def export_refusing_channels_last(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    layouts: list[bool] = []

    def capture(model: Any, req: BuildRequest, args: Any, settings: dict[str, Any]) -> tuple[str, dict]:
        layouts.append(settings["channels_last"])
        if settings["channels_last"]:
            raise RuntimeError("Constraints violated (width)!")
        return "exported", {}, {}

    monkeypatch.setattr(build, "_capture", capture)
    monkeypatch.setattr(build, "_build_package", lambda req, exported, args, common: {"common": common})
    return layouts


def test_auto_channels_last_is_dropped_when_the_export_fails_with_it(
    tmp_path: Path, export_refusing_channels_last: list[bool]
) -> None:
    common = build.build_torch_engine(_request(tmp_path, "auto"))["common"]
    assert export_refusing_channels_last == [True, False]  # auto chose it (the model has a Conv2d), then dropped it
    assert common["channels_last"] is False and "Constraints violated" in common["channels_last_dropped"]


def test_channels_last_asked_for_is_kept_and_the_failure_names_it(
    tmp_path: Path, export_refusing_channels_last: list[bool]
) -> None:
    with pytest.raises(BuildError, match="Constraints violated") as failed:
        build.build_torch_engine(_request(tmp_path, "on"))
    assert "build.torch.channels_last: off" in failed.value.hint and export_refusing_channels_last == [True]
