"""What a backend is: one module that registers how to build its engines, run them, and serve them.

Adding a backend is one module defining a :class:`Backend` plus one line in :mod:`.registry`; the build stage,
validation, packaging and ``kiln build`` go through this interface and never test a backend's name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.core.records import EngineMetadata, PrecisionVariant, TensorSpec
from kiln.core.sections import Section
from kiln.stages.engines.config import BuildConfig
from kiln.stages.engines.engines import Runner


@dataclass(frozen=True)
class BuildRequest:
    """One engine to build: ``onnx_path`` into the (staging) folder ``out``."""

    onnx_path: Path
    out: Path
    device: str
    precision: str
    config: BuildConfig
    cache_dir: Path
    inputs: list[TensorSpec]
    max_batch: int = 32  # bounds default optimization profiles and the batch sizes autotuned
    keep_fp32: list[str] | None = None  # FP16 converted at build time: nodes the precision stage kept FP32
    axis_sizes: dict[str, list[int]] = field(default_factory=dict)  # dynamic axis besides batch -> [min, max]
    name: str = ""  # the engine's name, for messages (``out`` is a staging folder whose name means nothing to users)
    # The trained PyTorch model (FP32, eval, CPU), for backends that compile it rather than the ONNX graph; None
    # where no PyTorch model exists (``kiln build model.onnx``). A loader, so other backends never load it.
    torch_model: Callable[[], Any] | None = None


@dataclass(frozen=True)
class TritonModel:
    """How Triton's stock backend loads this engine kind: ``platform`` and the model file's name."""

    platform: str
    model_file: str


@dataclass(frozen=True)
class Plan:
    """What the build stage makes of one backend under a config: the devices to build for, and why not others."""

    devices: list[str]
    skipped: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Backend:
    name: str
    devices: tuple[str, ...]  # devices it can build for
    settings: Callable[[BuildConfig], Section]  # its config section (part of each engine's settings hash)
    plan: Callable[[BuildConfig, str], Plan]  # which devices to build this precision for, under this config
    build: Callable[[BuildRequest], dict[str, Any]]  # writes the engine files; returns its part of the metadata
    runners: dict[str, type[Runner]]  # device -> runner class
    can_run: Callable[[EngineMetadata], tuple[bool, str]]  # on this machine, and why not
    triton: TritonModel | None = None  # None: no stock Triton backend loads it
    # Which of its engines that stock backend can load (e.g. not TensorRT-RTX engines, which Triton cannot run).
    triton_loads: Callable[[EngineMetadata], bool] = lambda meta: True
    # A build failure under this config skips the engine (reported) instead of failing the stage.
    optional: Callable[[BuildConfig], bool] = lambda cfg: False
    # Which graph of a precision variant this engine is built from, and the nodes to keep FP32 when converting.
    source: (
        Callable[[Backend, str, str, dict[str, PrecisionVariant], BuildConfig], tuple[str, list[str] | None]] | None
    ) = None
    # Preference among engines within timing noise of each other (validate's per-batch choice): lower first.
    rank: int = 100

    def stock_triton(self, meta: EngineMetadata) -> TritonModel | None:
        """How Triton's stock backend loads this engine, or None where it cannot."""
        return self.triton if self.triton is not None and self.triton_loads(meta) else None

    def engine_name(self, device: str, precision: str) -> str:
        return f"{self.name}-{device}-{precision}" if len(self.devices) > 1 else f"{self.name}-{precision}"

    def source_for(
        self, device: str, precision: str, variants: dict[str, PrecisionVariant], cfg: BuildConfig
    ) -> tuple[str, list[str] | None]:
        """The variant's graph made for this engine kind if it has one, else its graph; no nodes to keep."""
        if self.source is not None:
            return self.source(self, device, precision, variants, cfg)
        variant = variants[precision]
        return variant.backend_paths.get(f"{self.name}-{device}", variant.path), None
