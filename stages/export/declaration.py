"""The export stage as the pipeline sees it: what it reads, what it returns, the files it leaves for later stages
and its cache key's environment. Torch-free and ONNX-free, so a run that finds the stage cached loads neither."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import Field

from kiln.core.env import environment_subset
from kiln.core.errors import ConfigError, InputFileError
from kiln.core.records import IntRange
from kiln.core.signature import Signature
from kiln.core.stage import Stage, StageSettings, Summary
from kiln.models.config import DataConfig, ModelConfig
from kiln.stages.export.config import ExportConfig


@dataclass(frozen=True)
class ExportSettings(StageSettings):
    """What the export stage reads: the model (or the ONNX file that replaces it), its data for the example and
    the parity check, the exporter's settings and the signature's dynamic axes."""

    SOURCES = {"signature": ("signature.dynamic_axes", "signature.shapes")}
    seed: int
    model: ModelConfig
    data: DataConfig
    export: ExportConfig
    signature: Signature


class ExportSummary(Summary):
    """The exported (or taken) graph: its size and opset, its parity with PyTorch, the sizes the data gave each
    dynamic axis and integer input; for ``model.onnx``, the file taken and its inputs and outputs."""

    nodes: int
    opset: int
    parity: dict[str, Any] | None = None
    dynamic_sizes: dict[str, dict[int, list[int]]] = Field(default_factory=dict)
    int_ranges: dict[str, IntRange] = Field(default_factory=dict)
    axis_steps: dict[str, list[int]] = Field(default_factory=dict)  # axis -> [step, offset]: the sizes it takes
    # output -> {axis: name}: axes the export fixed although they follow a dynamic input axis, declared dynamic
    output_axes: dict[str, dict[int, str]] = Field(default_factory=dict)
    source: str | None = None
    inputs: list[str] = Field(default_factory=list)
    outputs: list[str] = Field(default_factory=list)
    freed_batch: int | None = None  # the batch size the taken file fixed, made symbolic (checked: take_onnx)


DYNAMIC_SIZES = "dynamic_sizes.json"


INT_RANGES = "int_ranges.json"


def read_int_ranges(export_dir: Path) -> dict[str, IntRange] | None:
    """:data:`INT_RANGES` of an export folder (None without one: no integer inputs, or a model.onnx): input name ->
    [smallest, largest], or one per column of a packed input (:data:`~kiln.core.records.IntRange`; files of
    either form read alike)."""
    path = export_dir / INT_RANGES
    return json.loads(path.read_text()) if path.is_file() else None


def read_dynamic_sizes(export_dir: Path) -> dict[str, dict[int, list[int]]] | None:
    """:data:`DYNAMIC_SIZES` of an export folder (None without one: no axes besides batch, or a model.onnx)."""
    path = export_dir / DYNAMIC_SIZES
    if not path.is_file():
        return None
    stored = json.loads(path.read_text())
    return {name: {int(axis): sizes for axis, sizes in dims.items()} for name, dims in stored.items()}


AXIS_STEPS = "axis_steps.json"


SIZE_PROBES = 8  # sizes tried across an axis's range before it is probed whole (size_pattern, kiln build's probe)
MAX_PERIOD = 64  # the longest period looked for; the range is probed over two of them at most


def read_axis_steps(export_dir: Path) -> dict[str, list[int]]:
    """:data:`AXIS_STEPS` of an export folder ({} without one: every size between the validated ones runs)."""
    path = export_dir / AXIS_STEPS
    return json.loads(path.read_text()) if path.is_file() else {}


# The key of an exported ONNX file's own metadata (``metadata_props``) that holds the steps its export found, as
# JSON of :data:`AXIS_STEPS`'s form: ``kiln export -o FILE`` writes it, ``kiln build FILE`` records it on the engine.
GRAPH_STEPS_KEY = "kiln.axis_steps"


def parse_graph_steps(text: str | None, shown: str) -> dict[str, list[int]]:
    """The axis steps (axis -> ``[period, *residues]``) an ONNX file's metadata holds under :data:`GRAPH_STEPS_KEY`
    (``text``; None: the file has none, {}); ``shown``: the file, for the error where the value is not of that form
    (an engine cannot refuse by steps it cannot read, and a file with them computes wrong answers off them)."""
    if text is None:
        return {}
    try:
        steps = json.loads(text)
    except ValueError:
        steps = None
    if not isinstance(steps, dict) or not all(isinstance(k, str) and _is_steps(v) for k, v in steps.items()):
        raise InputFileError(
            f"{shown}: its metadata {GRAPH_STEPS_KEY} is not axis -> [period, *residues] "
            f'(as {{"seq": [4, 0]}}): {text[:80]!r}',
            hint=f"export the file again with `kiln export ... -o FILE`, or remove {GRAPH_STEPS_KEY} from its "
            "metadata_props",
        )
    return steps


def _is_steps(value: object) -> bool:
    """Whether ``value`` is ``[period, *residues]``: a period of 1 or more, each residue below it."""
    if not isinstance(value, list) or len(value) < 2 or not all(type(v) is int for v in value):
        return False
    return value[0] >= 1 and all(0 <= r < value[0] for r in value[1:])


def _env(cfg: ExportSettings) -> dict[str, Any]:
    return environment_subset("torch", "onnx", "onnxruntime")


# Export builds the model from kiln.models (the zoo Transformer has an export-only attention path) and loads it
# through model_io.
def check_dynamic_batch(settings: ExportSettings) -> None:
    """The stage's quick check (run before the first stage does work, training included): the pipeline exports with
    a dynamic batch, since it checks and times the engines at every size of ``signature.batch_sizes``; a graph fixed
    at one batch is ``kiln export -o``'s alone. A run from ``model.onnx`` takes the file's batch as it is."""
    if not settings.export.dynamic_batch and not settings.model.onnx:
        raise ConfigError(
            "export.dynamic_batch: false cannot run through the pipeline, which checks and times "
            "the engines at every size in signature.batch_sizes",
            hint="keep export.dynamic_batch: true; for a fixed-batch file use `kiln export "
            "--checkpoint W.safetensors -o model.onnx --set export.dynamic_batch=false`",
        )


STAGE = Stage(
    "export",
    "kiln.stages.export.stage:run",
    ("train",),
    ExportSettings,
    ExportSummary,
    ("kiln.stages.export", "kiln.models", "kiln.models.model_io", "kiln.core.onnx_io"),
    _env,
    "torch.onnx.export with a dynamic batch axis; checker, shape inference, parity (or model.onnx, checked)",
    data=("dataset", "onnx"),
    # a model.onnx that is not FP32; signature.shapes naming axes signature.dynamic_axes does not declare
    checks=(
        "kiln.stages.precision.audit:check_model_onnx",
        "kiln.core.signature:check_declared_shapes",
        "kiln.stages.export.declaration:check_dynamic_batch",
    ),
)
