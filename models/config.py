"""The ``model:`` and ``data:`` config sections: which model and dataset, built-in or the user's own."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field

from kiln.core.sections import Section


class ModelConfig(Section):
    name: str = Field("cnn", description="built-in model name or import path 'package.module:function'")
    params: dict[str, Any] = Field(default_factory=dict, description="keyword arguments for the model factory")
    checkpoint: str | None = Field(
        None,
        description="state dict (.safetensors/.pt) of model.name to start from; skips training. Relative to the "
        "config file's folder (given with --set: to the current folder)",
    )
    onnx: str | None = Field(
        None,
        description="start from this ONNX file: optimize through package, no train/export; "
        "the reference is this file in ONNX Runtime unless model.name is set. Relative to the config file's "
        "folder (given with --set: to the current folder)",
    )


class DataConfig(Section):
    name: str | None = Field(None, description="built-in dataset or 'package.module:function'; default per model")
    params: dict[str, Any] = Field(default_factory=dict)
    skip_unchanged: bool = Field(
        False,
        description="a data function: a run whose stages are cached does not call it while its code, params and "
        "every file it read last time are unchanged (turn on only for data read from this machine's files)",
    )
    depends_on: list[str] = Field(
        default_factory=list,
        description="with skip_unchanged: files or folders the data function reads that Python's open() does not "
        "see (a library reading them in C: pyarrow, h5py)",
    )

    # How the run checks the data is unchanged, not what the data is: not part of any stage's cache key
    UNKEYED: ClassVar[tuple[str, ...]] = ("skip_unchanged", "depends_on")
