"""The ordered list of pipeline stages: what each reads, which config it depends on, and its code."""
from __future__ import annotations

from typing import Any

import kiln.calibration
import kiln.models
import kiln.stages.engines
import kiln.stages.engines.stage as build_stage
import kiln.stages.export as export_stage
import kiln.stages.optimize
import kiln.stages.optimize.stage as optimize_stage
import kiln.stages.package as package_stage
import kiln.stages.precision
import kiln.stages.precision.speed as precision_speed
import kiln.stages.precision.stage as precision_stage
import kiln.core.onnx_io as onnx_io
import kiln.stages.train
import kiln.models.model_io as model_io
import kiln.stages.train.stage as train_stage
import kiln.stages.validate as validate_stage
from kiln.config import KilnConfig
from kiln.core.env import environment_subset
from kiln.core.stage import Stage


def _train_env(cfg: KilnConfig) -> dict[str, Any]:
    return environment_subset("torch", device=True)


def _torch_ort_env(cfg: KilnConfig) -> dict[str, Any]:
    return environment_subset("torch", "onnx", "onnxruntime")


def _onnx_env(cfg: KilnConfig) -> dict[str, Any]:
    return environment_subset("onnx", "onnx-graphsurgeon", "onnxruntime")


def _build_env(cfg: KilnConfig) -> dict[str, Any]:
    # Engines depend on the library that built them and on the GPU they were tuned for.
    return environment_subset("onnx", "onnxruntime", "onnxruntime-gpu", "tensorrt", "tensorrt-rtx", device=True)


def _validate_env(cfg: KilnConfig) -> dict[str, Any]:
    return environment_subset("torch", "onnxruntime", "onnxruntime-gpu", "tensorrt", "tensorrt-rtx", device=True)


STAGES: list[Stage] = [
    Stage("train", train_stage.run, (), ("seed", "model", "data", "train"), (kiln.stages.train, kiln.models), _train_env,
          "train the model (AMP, gradient accumulation) or load a checkpoint", data=("dataset", "checkpoint")),
    # ctx.dataset() reads seed, data and (for the default dataset) model.name: every stage calling it hashes them,
    # and the content of a user dataset (data=("dataset",)).
    # Export builds the model from kiln.models (the zoo Transformer has an export-only attention path) and loads it
    # through model_io; validate builds the same PyTorch baseline.
    Stage("export", export_stage.run, ("train",), ("seed", "model", "data", "export"),
          (export_stage, kiln.models, model_io, onnx_io), _torch_ort_env,
          "torch.onnx.export with a dynamic batch axis; checker, shape inference, parity", data=("dataset",)),
    Stage("optimize", optimize_stage.run, ("export",), ("optimize",), (kiln.stages.optimize,), _onnx_env,
          "graph passes with onnx-graphsurgeon"),
    Stage("precision", precision_stage.run, ("optimize", "train"),
          ("seed", "model.name", "data", "precision", "calibration"),
          (kiln.stages.precision, kiln.calibration), _onnx_env,
          "FP16 mixed precision and INT8 (Q/DQ) graphs", data=("dataset", "calibration")),
    # The largest validate batch size sizes the engines' optimization profiles and autotuned shapes.
    Stage("build", build_stage.run, ("precision",), ("build", "validate.batch_sizes"), (kiln.stages.engines,), _build_env,
          "ONNX Runtime and TensorRT engines"),
    # Engines run through kiln.stages.engines's runners, so their code is part of validate's result.
    Stage("validate", validate_stage.run, ("train", "build"), ("seed", "model", "data", "validate",
                                                               "precision.require_speedup"),
          (validate_stage, kiln.stages.engines, kiln.models, model_io, precision_speed), _validate_env,
          "accuracy and latency of every engine vs PyTorch, with gates", data=("dataset",)),
    Stage("package", package_stage.run, ("train", "build", "validate"), ("name", "package"), (package_stage,),
          lambda cfg: {}, "serving artifacts: engines + metadata, Triton model repository"),
]

STAGE_NAMES = [s.name for s in STAGES]


def stage_named(name: str) -> Stage:
    for s in STAGES:
        if s.name == name:
            return s
    from kiln.core.errors import ConfigError

    raise ConfigError(f"unknown stage '{name}'", hint=f"use one of {', '.join(STAGE_NAMES)}")
