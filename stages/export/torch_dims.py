"""The dynamic axes as ``torch.export`` takes them: each axis name of ``signature.dynamic_axes`` as a
``torch.export.Dim`` (whose name must be a Python identifier), and the config's names given back to the graph the
dynamo exporter wrote. Its own module because both the export and the probe of where torch.export pinned a size
hand the exporter these dims."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import onnx
import torch


def _dim_names(labels: Iterable[str]) -> dict[str, str]:
    """Axis name -> the name its ``torch.export.Dim`` gets, which must be a Python identifier: an identifier as it
    is, another name with each other character as ``_`` (``seq-len`` -> ``seq_len``; ``2d`` -> ``d_2d``), kept apart
    from every other name. ``signature.dynamic_axes`` may name an axis anything; the graph's axes get those names
    back (:func:`restore_axis_names`)."""
    labels = sorted(set(labels))
    out = {label: label for label in labels if label.isidentifier()}
    taken = set(out)
    for label in labels:
        if label in out:
            continue
        base = re.sub(r"\W", "_", label)
        base = base if base[:1].isalpha() or base[:1] == "_" else f"d_{base}"
        name = next(n for k in range(len(taken) + 1) if (n := f"{base}_{k}" if k else base) not in taken)
        out[label] = name
        taken.add(name)
    return out


def torch_dims(labels: Iterable[str]) -> dict[str, Any]:
    """Axis name -> its ``torch.export.Dim`` (:func:`_dim_names`): sizes from 1, the batch's at most 65536."""
    names = _dim_names(labels)
    return {
        label: torch.export.Dim(name, min=1, max=65536) if label == "batch" else torch.export.Dim(name, min=1)
        for label, name in names.items()
    }


def restore_axis_names(graph: onnx.GraphProto, labels: Iterable[str]) -> None:
    """The names ``signature.dynamic_axes`` gives its axes (``labels``) back in the graph's inputs, outputs and value
    infos where the dynamo exporter wrote the identifiers :func:`_dim_names` gave them instead (``seq_len`` for
    ``seq-len``, also inside a size it derived: ``seq_len - 6``), so the file declares the axes by the config's
    names as the TorchScript exporter's does."""
    renamed = {name: label for label, name in _dim_names(labels).items() if name != label}
    if not renamed:
        return
    found = re.compile(r"\b(" + "|".join(map(re.escape, renamed)) + r")\b")
    for value in (*graph.input, *graph.output, *graph.value_info):
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param:
                dim.dim_param = found.sub(lambda m: renamed[m.group(1)], dim.dim_param)
