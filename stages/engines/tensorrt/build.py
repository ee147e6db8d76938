"""TensorRT engines, built with whichever TensorRT flavour imports: ``tensorrt`` (10/11) or ``tensorrt_rtx``.

One code path chosen by feature detection, not version numbers (see :func:`features`):
- strongly typed (TensorRT 11, TensorRT-RTX; optional in 10): precision comes from the graph (FP16 tensors,
  Q/DQ pairs); no precision flags exist.
- weakly typed (TensorRT 10 handed an FP32 graph for fp16/int8): FP16/INT8 builder flags, an entropy
  calibrator fed from a calibration cache, and per-layer constraints keeping sensitive layers FP32.

Imported lazily: Kiln works without TensorRT, and TensorRT-RTX builds engines even on a CPU-only machine.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import ModuleType
from typing import Any

from kiln.core.errors import BuildError, ConfigError
from kiln.core.onnx_io import graph_carries_precision
from kiln.stages.engines.tensorrt import cache as tensorrt_cache
from kiln.stages.engines.tensorrt import lib as tensorrt_lib
from kiln.stages.engines.tensorrt.config import TensorRTConfig
from kiln.stages.engines.tensorrt.errors import (
    KilnTrtLogger,
    gc_paused_for_tensorrt,
    native_stdout_to_stderr,
    parse_onnx,
)
from kiln.stages.engines.tensorrt.lib import (
    features,
    local_gpu,
)
from kiln.stages.engines.tensorrt.profiles import Profile, as_json
from kiln.stages.engines.tensorrt.runtime import can_execute
from kiln.stages.engines.tensorrt.weak import configure_weak_typing

log = logging.getLogger("kiln.build")


def build_trt_engine(
    onnx_path: Path, out: Path, precision: str, cfg: TensorRTConfig, profiles: list[Profile], cache_dir: Path
) -> dict[str, Any]:
    """Parse, configure, build and serialize; returns the backend's part of the metadata."""
    with gc_paused_for_tensorrt():  # our Python logger runs inside TensorRT's locks
        return _build(onnx_path, out, precision, cfg, profiles, cache_dir)


def _build(
    onnx_path: Path, out: Path, precision: str, cfg: TensorRTConfig, profiles: list[Profile], cache_dir: Path
) -> dict[str, Any]:
    trt = tensorrt_lib.require_tensorrt()
    feats = features(trt)
    logger = KilnTrtLogger(trt)
    builder = trt.Builder(logger)
    strong = feats["strongly_typed"] and (
        not (feats["fp16_flag"] or feats["int8_flag"]) or precision == "fp32" or graph_carries_precision(onnx_path)
    )
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED) if strong else 0)
    parser = parse_onnx(trt, network, logger, onnx_path)
    config = builder.create_builder_config()
    settings = _configure(trt, builder, config, cfg, profiles, feats)
    if not strong:
        settings["weak_typing"] = configure_weak_typing(trt, network, config, precision, cfg)
    elif precision != "fp32" and not graph_carries_precision(onnx_path):
        raise BuildError(
            f"the {precision} graph for TensorRT holds no FP16 tensors or Q/DQ nodes, and "
            f"{trt.__name__} {trt.__version__} is strongly typed (precision comes from the graph)",
            hint="run the precision stage to convert the graph; builder flags cannot do it here",
        )
    target = _target(trt, cfg)
    cache_file = tensorrt_cache.timing_cache_path(cache_dir, trt, target)
    # TensorRT-RTX's timing-cache calls are no-ops that log "Failed to deserialize timing cache" / "will not be
    # used" on every build: on a first run that reads as a failure. Not attaching one there says nothing wrong.
    timing = (
        tensorrt_cache.attach_timing_cache(config, cache_file) if cfg.timing_cache and feats["timing_cache"] else None
    )
    (out / "network_layers.json").write_text(json.dumps(network_layers(network), indent=1))
    with native_stdout_to_stderr():  # TensorRT-RTX prints some warnings to stdout itself
        plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise BuildError(
            f"TensorRT ({trt.__name__} {trt.__version__}) failed to build the engine: " + logger.last_errors(),
            hint=_build_hint(logger.last_errors()),
        )
    if timing is not None:
        timing["saved_bytes"] = tensorrt_cache.save_timing_cache(config, cache_file)
    elif cfg.timing_cache:
        timing = {"note": "not used by TensorRT-RTX: kernels are compiled on the target GPU into the runtime cache"}
    (out / "engine.plan").write_bytes(bytes(plan))
    del parser
    return {
        "files": {
            "model": "engine.plan",
            "network_layers": "network_layers.json",
            **_inspect(trt, bytes(plan), out, logger),
        },
        "flavour": trt.__name__,
        "versions": {trt.__name__: trt.__version__},
        "features": feats,
        "strongly_typed": strong,
        "target": _target_meta(trt, cfg, target),
        "profiles": as_json(profiles),
        "builder_settings": settings,
        "timing_cache": timing,
        "cuda_graph": cfg.cuda_graph,
        "runtime_cache": _runtime_cache(cache_dir, trt, target) if feats["runtime_cache"] else None,
    }


def _runtime_cache(cache_dir: Path, trt: Any, target: str) -> str:
    """Where the engine's loaders keep TensorRT-RTX's JIT kernels: in Kiln's own cache folder of the build, by
    absolute path, the folder made now (a loader on another machine, where it does not exist, uses none)."""
    path = tensorrt_cache.runtime_cache_path(cache_dir, trt, target).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    return str(path)


def _configure(
    trt: ModuleType, builder: Any, config: Any, cfg: TensorRTConfig, profiles: list[Profile], feats: dict[str, bool]
) -> dict[str, Any]:
    config.builder_optimization_level = cfg.optimization_level
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, cfg.workspace_mb << 20)
    settings: dict[str, Any] = {"optimization_level": cfg.optimization_level, "workspace_mb": cfg.workspace_mb}
    if cfg.tactic_shared_memory_kb is not None:
        config.set_memory_pool_limit(trt.MemoryPoolType.TACTIC_SHARED_MEMORY, cfg.tactic_shared_memory_kb << 10)
        settings["tactic_shared_memory_kb"] = cfg.tactic_shared_memory_kb
    if cfg.tactic_sources is not None:
        config.set_tactic_sources(_tactic_mask(trt, cfg.tactic_sources))
        settings["tactic_sources"] = cfg.tactic_sources
    if cfg.avg_timing_iterations is not None:
        config.avg_timing_iterations = cfg.avg_timing_iterations
        settings["avg_timing_iterations"] = cfg.avg_timing_iterations
    if cfg.max_aux_streams is not None:
        config.max_aux_streams = cfg.max_aux_streams
        settings["max_aux_streams"] = cfg.max_aux_streams
    if cfg.detailed_profiling:
        config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED
    if cfg.compute_capabilities:
        if not feats["compute_capability_targets"]:
            raise BuildError(
                f"build.tensorrt.compute_capabilities needs TensorRT-RTX; {trt.__name__} builds for the local GPU only",
                hint="remove compute_capabilities, or install tensorrt-rtx",
            )
        config.num_compute_capabilities = len(cfg.compute_capabilities)
        for i, cc in enumerate(cfg.compute_capabilities):
            config.set_compute_capability(_enum(trt, "ComputeCapability", cc), i)
        settings["compute_capabilities"] = cfg.compute_capabilities
    for profile in profiles:
        p = builder.create_optimization_profile()
        for name, rng in profile.items():
            p.set_shape(name, tuple(rng.min), tuple(rng.opt), tuple(rng.max))
        config.add_optimization_profile(p)
    return settings


def _enum(trt: ModuleType, enum: str, name: str) -> Any:
    members = getattr(trt, enum).__members__
    if name not in members:
        raise ConfigError(
            f"unknown {enum} '{name}' for {trt.__name__} {trt.__version__}", hint=f"use one of {sorted(members)}"
        )
    return members[name]


def _tactic_mask(trt: ModuleType, names: list[str]) -> int:
    mask = 0
    for name in names:
        mask |= 1 << int(_enum(trt, "TacticSource", name.upper()))
    return mask


def _target(trt: ModuleType, cfg: TensorRTConfig) -> str:
    """What the engine is tuned for: RTX targets when given, else the local GPU (or 'cpu' when there is none)."""
    if cfg.compute_capabilities and cfg.compute_capabilities != ["CURRENT"]:
        return "+".join(cfg.compute_capabilities)
    gpu = local_gpu()
    return f"sm{gpu['compute_capability'].replace('.', '')}" if gpu else "no-gpu"


def _target_meta(trt: ModuleType, cfg: TensorRTConfig, target: str) -> dict[str, Any]:
    meta: dict[str, Any] = {"key": target, "local_gpu": local_gpu()}
    if cfg.compute_capabilities:
        meta["compute_capabilities"] = cfg.compute_capabilities
    elif trt.__name__ == "tensorrt_rtx":
        meta["compute_capabilities"] = ["library default (none set)"]
    return meta


def network_layers(network: Any) -> list[dict[str, Any]]:
    """The parsed network's layers (name, type, output dtypes): available on every machine, unlike the inspector."""
    layers = []
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        outs = [layer.get_output(j) for j in range(layer.num_outputs)]
        layers.append(
            {
                "name": layer.name,
                "type": str(layer.type).split(".")[-1],
                "outputs": [{"name": t.name, "dtype": str(t.dtype).split(".")[-1]} for t in outs if t],
            }
        )
    return layers


def _inspect(trt: ModuleType, plan: bytes, out: Path, logger: Any) -> dict[str, str]:
    """The engine inspector's per-layer JSON; it needs to deserialize the engine, so only where it can run."""
    ok, why = can_execute(trt)
    if not ok:
        log.info("no engine inspector layer info: %s", why)
        return {}
    engine = trt.Runtime(logger).deserialize_cuda_engine(plan)
    if engine is None:
        log.warning("engine inspector unavailable: %s", logger.last_errors())
        return {}
    info = engine.create_engine_inspector().get_engine_information(trt.LayerInformationFormat.JSON)
    (out / "layers.json").write_text(info)
    return {"layers": "layers.json"}


def _build_hint(errors: str) -> str:
    if "memory" in errors.lower() or "workspace" in errors.lower():
        return "raise build.tensorrt.workspace_mb, or lower the profile's max shapes"
    if "profile" in errors.lower() or "dimension" in errors.lower():
        return "check build.tensorrt.profiles against the model's input shapes"
    return "the layer named above is the one TensorRT could not implement; try optimize passes or another opset"
