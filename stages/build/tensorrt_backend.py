"""TensorRT engines, built with whichever TensorRT flavour imports: ``tensorrt`` (10/11) or ``tensorrt_rtx``.

Imported lazily: Kiln works without TensorRT, and TensorRT-RTX builds engines even on a CPU-only machine.
"""
from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType
from typing import Any

from pipeline.errors import BackendUnavailable, BuildError
from stages.build.config import TensorRTConfig

FLAVOURS = ("tensorrt", "tensorrt_rtx")


def import_tensorrt() -> ModuleType | None:
    for name in FLAVOURS:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    return None


def require_tensorrt() -> ModuleType:
    trt = import_tensorrt()
    if trt is None:
        raise BackendUnavailable("no TensorRT package imports (tried tensorrt, tensorrt_rtx)",
                                 hint="pip install 'kiln[rtx]' (TensorRT-RTX) or 'kiln[tensorrt]'")
    return trt


def build_trt_engine(onnx_path: Path, out: Path, cfg: TensorRTConfig, input_shape: tuple[int, ...],
                     max_batch: int) -> dict[str, Any]:
    trt = require_tensorrt()
    logger = trt.Logger(trt.Logger.ERROR)
    builder = trt.Builder(logger)
    flags = 0
    if hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED"):
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errs = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise BuildError(f"TensorRT's ONNX parser rejected the model: {'; '.join(errs)[:500]}",
                         hint="run the optimize stage, or export with another opset")
    config = builder.create_builder_config()
    config.builder_optimization_level = cfg.optimization_level
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, cfg.workspace_mb << 20)
    profile = builder.create_optimization_profile()
    for i in range(network.num_inputs):
        inp = network.get_input(i)
        dims = tuple(input_shape)
        profile.set_shape(inp.name, (1, *dims), (max_batch, *dims), (max_batch, *dims))
    config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise BuildError("TensorRT failed to build the engine", hint="see the TensorRT log above")
    (out / "engine.plan").write_bytes(bytes(plan))
    return {"files": {"model": "engine.plan"}, "flavour": trt.__name__, "trt_version": trt.__version__,
            "not_runnable_reason": "TensorRT engine execution is not wired on this machine"}
