"""The package stage as the pipeline sees it: what it reads, what it returns and its report section. Light, so a
run that finds the stage cached loads none of the serving code."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import Field

from kiln.core.stage import Stage, StageSettings, Summary
from kiln.stages.package.config import PackageConfig


@dataclass(frozen=True)
class PackageSettings(StageSettings):
    """What packaging reads: its section, the run's name (Triton model names start with it), and the output the run
    holds to top-1 agreement, recorded in each packaged engine for a later ``kiln validate ENGINE``."""

    SOURCES = {"logits_output": "signature.logits_output"}
    name: str
    package: PackageConfig
    logits_output: str | int | None = None


class PackageSummary(Summary):
    """Each engine packaged: its validation figures, the batch sizes it was chosen for, its Triton models."""

    models: list[dict[str, Any]] = Field(default_factory=list)


def report_section(summary: PackageSummary) -> list[str]:
    """What went into the serving repositories, and where (paths relative to the workdir)."""
    models = summary.models
    out = ["", "## Package", ""]
    if not models:
        return out + ["Nothing packaged: no engine passed validation here (only validated engines are served)."]
    out += ["| engine | engine files | Triton (stock backend) | Triton (Python backend) |", "|---|---|---|---|"]
    for m in models:
        stock = f"`package/triton/{m['triton_model']}/`" if m.get("triton_model") else "- (no stock backend)"
        python = f"`package/triton-python/{m['triton_python_model']}/`" if m.get("triton_python_model") else "-"
        out.append(f"| {m['engine']} | `package/engines/{m['engine']}/` | {stock} | {python} |")
    return out + [
        "",
        "Serve with `kiln serve <workdir>`, or point `tritonserver --model-repository` at "
        "`package/triton` (or `package/triton-python`, which needs kiln in Triton's Python). "
        "`cd package && serve run ray/serve.yaml` starts the Ray Serve application (`kiln[ray]`) where written; "
        "`package/kserve.yaml` is a KServe InferenceService for `package/triton`.",
    ]


STAGE = Stage(
    "package",
    "kiln.stages.package.stage:run",
    ("train", "build", "validate"),
    PackageSettings,
    PackageSummary,
    ("kiln.stages.package", "kiln.stages.engines.backend"),
    lambda cfg: {},
    "serving artifacts: engines + metadata, Triton model repository",
    report=report_section,
)
