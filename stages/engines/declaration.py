"""The build stage as the pipeline sees it: what it reads, what it returns, its report section and its cache key's
environment. Torch-free and ONNX-free, so a run that finds the stage cached loads neither."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, Field

from kiln.core import cpu_int8
from kiln.core.env import environment_subset
from kiln.core.signature import Signature
from kiln.core.stage import Stage, StageSettings, Summary
from kiln.models.config import ModelConfig
from kiln.stages.engines.config import BuildConfig
from kiln.stages.engines.registry import backend_libraries


@dataclass(frozen=True)
class BuildSettings(StageSettings):
    """What the build stage reads: its section (backends and each one's settings), the model (the torch backend
    compiles the trained model itself) and the signature (the largest batch and the dynamic axes' sizes size the
    engines' profiles and autotuned shapes)."""

    SOURCES = {"signature": ("signature.batch_sizes", "signature.shapes")}
    build: BuildConfig
    model: ModelConfig
    signature: Signature


class EngineEntry(BaseModel):
    """One engine built: the summary's row of it (``kiln-engine.json`` in its folder has everything)."""

    name: str
    backend: str
    device: str
    precision: str
    build_seconds: float
    size_bytes: int
    # kept from the previous build, its inputs unchanged (kiln.stages.engines.reuse): build_seconds is that build's
    reused: bool = False


class BuildSummary(Summary):
    """The engines built, and the ones planned but not built, each with why."""

    engines: list[EngineEntry] = Field(default_factory=list)
    skipped: list[str] = Field(default_factory=list)


def report_section(build: BuildSummary) -> list[str]:
    """The engines' part of report.md: what was built (or not, and why), how long it took, how large; an engine kept
    from the previous build (its inputs unchanged) says so beside the time its build took then."""
    if not build.engines:
        return []
    out = [
        "",
        "## Engines",
        "",
        "| engine | backend | device | precision | build s | size MB |",
        "|---|---|---|---|---|---|",
    ]
    for e in build.engines:
        built = f"kept (built in {e.build_seconds:.2f})" if e.reused else f"{e.build_seconds:.2f}"
        out.append(f"| {e.name} | {e.backend} | {e.device} | {e.precision} | {built} | {e.size_bytes / 1e6:.2f} |")
    return out + [f"- not built: {s}" for s in build.skipped]


def _env(cfg: BuildSettings) -> dict[str, Any]:
    # Engines depend on the library that built them and on the GPU they were tuned for.
    env = environment_subset("onnx", *backend_libraries(*cfg.build.backends), device=True)
    # ORT CPU INT8 engines built where the fast INT8 kernels saturate hold ORT's uint8 weights for its exact kernels
    # (kiln.core.cpu_int8): same outputs, slower kernels; a workdir moved to or from such a CPU rebuilds them. Only
    # recorded there, so the key on every other machine stays what it was.
    if cpu_int8.this_cpu_saturates():
        env["cpu_int8_kernels"] = cpu_int8.int8_kernels()
    return env


# The largest validate batch size sizes the engines' optimization profiles and autotuned shapes.
# The train stage's weights and the model section: the torch backend compiles the trained model itself.
STAGE = Stage(
    "build",
    "kiln.stages.engines.stage:run",
    ("train", "export", "precision"),
    BuildSettings,
    BuildSummary,
    # the engines' code, and what the build runs besides: the audit that labels each engine
    (
        "kiln.stages.engines",
        "kiln.stages.precision.audit",
        "kiln.stages.precision.config",
        "kiln.stages.export.declaration",
        "kiln.stages.export.batch_axes",
    ),
    _env,
    "ONNX Runtime, TensorRT and PyTorch (AOTInductor) engines",
    report=report_section,
)
