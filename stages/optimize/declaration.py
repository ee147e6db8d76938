"""The optimize stage as the pipeline sees it: what it reads, what it returns, its report section and its cache
key's environment. Torch-free and ONNX-free, so a run that finds the stage cached loads neither."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import Field

from kiln.core.env import environment_subset
from kiln.core.stage import Stage, StageSettings, Summary
from kiln.stages.optimize.config import OptimizeConfig


@dataclass(frozen=True)
class OptimizeSettings(StageSettings):
    """The optimize stage reads its own section only: the graph and the data's sizes come from the export stage."""

    optimize: OptimizeConfig


class OptimizeSummary(Summary):
    """Node counts and op histograms before and after, whether the safety net checked the passes (``checks``: how
    many times it ran the graph), and each pass's entry per round (``rolled_back``: the passes that changed the
    outputs and were undone)."""

    nodes_before: int
    nodes_after: int
    ops_before: dict[str, int] = Field(default_factory=dict)
    ops_after: dict[str, int] = Field(default_factory=dict)
    verified: bool = False
    rounds: int = 0
    checks: int = 0
    rolled_back: list[str] = Field(default_factory=list)
    seconds: float = 0.0
    passes: list[dict[str, Any]] = Field(default_factory=list)


def report_section(opt: OptimizeSummary) -> list[str]:
    """Graph optimization's part of report.md: node counts and the passes that fired or were rolled back."""
    fired = [p["name"] for p in opt.passes if p.get("nodes_before") != p.get("nodes_after")]
    return [
        "",
        "## Graph optimization",
        "",
        f"{opt.nodes_before} -> {opt.nodes_after} nodes; passes that changed the graph: "
        f"{', '.join(dict.fromkeys(fired)) or 'none'}; rolled back: {', '.join(opt.rolled_back) or 'none'}.",
    ]


def _env(cfg: OptimizeSettings) -> dict[str, Any]:
    return environment_subset("onnx", "onnx-graphsurgeon", "onnxruntime")


STAGE = Stage(
    "optimize",
    "kiln.stages.optimize.stage:run",
    ("export",),
    OptimizeSettings,
    OptimizeSummary,
    ("kiln.stages.optimize", "kiln.stages.export.declaration"),
    _env,
    "graph passes with onnx-graphsurgeon",
    report=report_section,
)
