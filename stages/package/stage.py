"""Package stage: engines that passed validation, with metadata, laid out as Triton model repositories.

``triton/<model>/``: the stock backend (``onnxruntime_onnx`` / ``tensorrt_plan``) for engines it can express;
``triton-python/<model>/``: Triton's Python backend running the Kiln engine itself, for every engine (see
:mod:`kiln.stages.package.triton`). ``ray/serve.yaml``: a Ray Serve application per engine
(:mod:`kiln.stages.package.rayserve`); ``kserve.yaml``: a KServe InferenceService for ``triton/``
(:mod:`kiln.stages.package.kserve`). ``kiln serve`` serves ``engines/`` directly through PyTriton.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from typing import Any

from kiln.core.errors import GateFailure
from kiln.core.records import EngineMetadata, EngineValidation, ValidationResult
from kiln.core.stage import StageContext
from kiln.stages.package import INDEX

__all__ = [
    "engine_max_batch",
    "run",
    "triton_config",
    "triton_model_name",
    "PackageConfig",
    "PackageSettings",
    "PackageSummary",
]

from kiln.stages.engines.backend import SIDECAR, engine_dirs, read_metadata
from kiln.stages.package import kserve, rayserve
from kiln.stages.package.config import PackageConfig, RayConfig
from kiln.stages.package.declaration import PackageSettings, PackageSummary
from kiln.stages.package.triton import (
    batchable,
    engine_max_batch,
    first_axes,
    scalar_tensors,
    stock_model,
    triton_config,
    unbatchable_reason,
    write_python_model,
    write_stock_model,
)


def triton_model_name(config_name: str, engine_name: str) -> str:
    """Triton model names: letters, digits and underscores (the repository folder's name)."""
    return re.sub(r"[^A-Za-z0-9_]", "_", f"{config_name}_{engine_name}")


def _with_logits(
    meta: EngineMetadata, setting: str | int | None, result: EngineValidation, held: str | None
) -> EngineMetadata:
    """``meta`` naming the output the run held to top-1 agreement and what that agreement counted (a multi-label
    head's decisions), which ``kiln validate ENGINE`` then holds it to too: ``signature.logits_output`` where set (by
    name or index), else the one validation chose (``held``, the baseline's ``logits_output``: integer labels beside
    ``num_classes`` pick it), else the one the engine's record gives a top-1 agreement. Unchanged where validation
    did not hold one (``result`` has no top-1 agreement: a regression head's values, which no top-1 agreement
    guards)."""
    names = [o.name for o in meta.outputs]
    if result.top1_agreement is None:
        return meta
    # validation checked the setting against the outputs; read here without kiln.core.outputs, which loads torch
    if setting is not None:
        name = str(setting) if str(setting) in names else names[setting] if isinstance(setting, int) else None
    else:
        agreed = [n for n, stats in result.outputs.items() if stats.get("top1_agreement") is not None]
        name = next((n for n in [held, *agreed] if n in names), None)
    if name is None:
        return meta
    return meta.model_copy(update={"logits_output": name, "logits_agreement": result.agreement})


def run(ctx: StageContext[PackageSettings]) -> PackageSummary:
    cfg = ctx.config.package
    if not cfg.enabled:
        return PackageSummary(status="skipped")
    validation = ValidationResult.read(
        ctx.inputs["validate"] / "validation.json", hint="run `kiln run --from validate`"
    )
    if not validation.passed:  # `kiln package` after a failed gate: keep the last good package
        kept = (ctx.workdir / ctx.name).is_dir()
        raise GateFailure(
            f"validation failed ({'; '.join(validation.failures) or 'see report.md'}): nothing is packaged"
            + (f"; {ctx.name}/ keeps an earlier run's engines, which `kiln serve` refuses meanwhile" if kept else ""),
            hint="fix the engines, or relax validate.gates if the numbers are acceptable, then `kiln run` again",
        )
    results = {e.name: e for e in validation.engines}
    packaged: list[dict[str, Any]] = []
    ray_apps: list[dict[str, Any]] = []
    capped: list[EngineMetadata] = []
    below: list[EngineMetadata] = []
    own_counts: list[EngineMetadata] = []
    unbatched: list[EngineMetadata] = []
    for engine_dir in engine_dirs(ctx.inputs["build"]):
        meta = read_metadata(engine_dir)
        result = results.get(meta.name)
        if result is None or result.passed is not True or result.dropped:
            continue  # only engines proven against PyTorch (and, with precision.require_speedup, faster) are served
        packaged_dir = ctx.out / "engines" / meta.name
        shutil.copytree(engine_dir, packaged_dir)
        validated = _with_logits(
            validation.served_metadata(meta), ctx.config.logits_output, result, validation.baseline.logits_output
        )
        if validated != meta:  # said in the packaged engine itself, for every server and command that loads it
            meta = validated
            meta.write(packaged_dir / SIDECAR)
        max_batch = _max_batch(cfg, meta)
        capped += [meta] if _capped(meta, max_batch) else []
        below += [meta] if _below_validated(meta, max_batch) else []
        own_counts += [meta] if len(first_axes(meta)) > 1 else []
        unbatched += [meta] if (cfg.triton or cfg.triton_python) and _unbatched(meta) else []
        record: dict[str, Any] = {
            "engine": meta.name,
            "validation": result.model_dump(
                mode="json", include={"max_abs_err", "cosine", "top1_agreement", "accuracy", "latency_ms"}
            ),
            # the batch sizes at which validation found this engine the fastest that passes (a router's hint)
            "chosen_for_batches": sorted((int(b) for b, n in validation.chosen.items() if n == meta.name)),
        }
        model_name = triton_model_name(ctx.config.name, meta.name)
        if cfg.triton and stock_model(meta) is not None and scalar_tensors(meta):
            _say_no_stock_scalars(ctx, meta)
        elif cfg.triton and stock_model(meta) is not None:
            write_stock_model(ctx.out / "triton" / model_name, packaged_dir, meta, max_batch)
            record["triton_model"] = model_name
        if cfg.triton_python:
            write_python_model(ctx.out / "triton-python" / model_name, packaged_dir, meta, max_batch)
            record["triton_python_model"] = model_name
        if cfg.ray.enabled:
            ray_apps.append(rayserve.application(model_name, meta, cfg.ray, _max_batch(cfg.ray, meta)))
            record["ray_route"] = ray_apps[-1]["route_prefix"]
        packaged.append(record)
    if capped:  # a warning where the user asked for the larger batch; the default's cap is information
        _say_batch_limit(ctx, capped, cfg.max_batch_size, asked="max_batch_size" in cfg.model_fields_set)
    if below:
        _say_below_validated(ctx, below, cfg.max_batch_size)
    if own_counts:
        _say_own_counts(ctx, own_counts)
    _say_unbatched(ctx, unbatched)
    if ray_apps:
        rayserve.write_serve_config(ctx.out / "ray", ray_apps, cfg.ray)
    if cfg.kserve.enabled and any("triton_model" in m for m in packaged):
        gpu = any(read_metadata(ctx.out / "engines" / m["engine"]).device == "cuda" for m in packaged)
        kserve.write_manifest(ctx.out / "kserve.yaml", ctx.config.name, cfg.kserve, gpu)
    (ctx.out / INDEX).write_text(json.dumps({"name": ctx.config.name, "models": packaged}, indent=2))
    return PackageSummary(models=packaged)


def _max_batch(cfg: PackageConfig | RayConfig, meta: EngineMetadata) -> int:
    """The largest batch a server of ``meta``'s engine forms, as ``cfg`` (the Triton repositories' section, or Ray's)
    gives it: its ``max_batch_size`` where the config sets it, else the default or the largest batch the engine was
    validated at (and its profiles take), the larger: servers take batches up to the largest validated
    (docs/serving.md), and a default holds none below it."""
    limit = engine_max_batch(meta)
    if "max_batch_size" in cfg.model_fields_set or limit is None or not batchable(meta):
        return cfg.max_batch_size
    return max(cfg.max_batch_size, limit)


def _below_validated(meta: EngineMetadata, max_batch: int) -> bool:
    """Whether ``max_batch`` (above 0: batched) is below the largest batch the engine was validated at."""
    limit = meta.validated_max_batch()
    return limit is not None and 0 < max_batch < limit and batchable(meta)


def _say_below_validated(ctx: StageContext[PackageSettings], metas: list[EngineMetadata], requested: int) -> None:
    """Say once that the config's ``package.max_batch_size`` serves these engines below the largest batch validation
    compared them at: what the config asked, so information, but not what ``signature.batch_sizes`` suggests."""
    ctx.log.info(
        "%s: served with batches up to package.max_batch_size %d rows, below the largest validated batch %s "
        "(signature.batch_sizes); to serve those, raise package.max_batch_size or leave it unset",
        ", ".join(m.name for m in metas),
        requested,
        " / ".join(map(str, sorted({m.validated_max_batch() or 0 for m in metas}))),
    )


def _capped(meta: EngineMetadata, requested: int) -> bool:
    """Whether ``package.max_batch_size`` is more than the engine was validated for: it is served with less."""
    limit = meta.validated_max_batch()
    return limit is not None and requested > limit and batchable(meta)


def _unbatched(meta: EngineMetadata) -> bool:
    """Whether Triton serves ``meta``'s engine unbatched (:func:`batchable`) for a reason not said apart: inputs in
    counts of their own are (:func:`_say_own_counts`)."""
    return not batchable(meta) and len(first_axes(meta)) <= 1


def _say_no_stock_scalars(ctx: StageContext[PackageSettings], meta: EngineMetadata) -> None:
    """Warn that ``meta``'s engine is left out of ``triton/``: Triton declares its 0-d tensors as ``[1]``, which a
    stock backend checks against the graph's ``[]`` (:func:`scalar_tensors`); ``triton-python/`` serves it."""
    ctx.log.warning(
        "%s: left out of triton/ (Triton's stock backend): its 0-d tensors %s cannot be declared there; "
        "triton-python/ and `kiln serve` serve it, sending them as [1]; to have the stock backend serve it, "
        "return them with a batch axis or leave them out of the served model",
        meta.name,
        scalar_tensors(meta),
    )


def _say_unbatched(ctx: StageContext[PackageSettings], metas: list[EngineMetadata]) -> None:
    """Warn of the engines written to a Triton repository unbatched (``max_batch_size: 0``, no dynamic batching),
    once per reason, with why and what would batch them (:func:`unbatchable_reason`): every request then runs alone,
    which a config that looks like any other does not show."""
    by_reason: dict[str, list[str]] = {}
    for meta in metas:
        by_reason.setdefault(unbatchable_reason(meta) or "", []).append(meta.name)
    for reason, names in by_reason.items():
        ctx.log.warning(
            "%s: packaged for Triton unbatched (max_batch_size 0, no dynamic batching; each request runs alone): %s",
            ", ".join(names),
            reason,
        )


def _say_batch_limit(
    ctx: StageContext[PackageSettings], capped: list[EngineMetadata], requested: int, asked: bool
) -> None:
    """Say that these engines are served with smaller batches than ``package.max_batch_size``: validation compared
    them at no larger batch, so the repositories and the Ray app take only up to what was validated. A warning
    where the config ``asked`` for that size, else a log line (the default's 32 above smaller validated sizes)."""
    limits = sorted({m.validated_max_batch() or 0 for m in capped})
    ctx.log.log(
        logging.WARNING if asked else logging.INFO,
        "%s: served with batches up to %s rows, the largest validated (signature.batch_sizes), not "
        "package.max_batch_size %d; to serve larger batches, add the size to signature.batch_sizes",
        ", ".join(m.name for m in capped),
        " / ".join(map(str, limits)),
        requested,
    )


def _say_own_counts(ctx: StageContext[PackageSettings], metas: list[EngineMetadata]) -> None:
    """Say that these engines take inputs in counts of their own (:func:`first_axes`), so every server runs each
    request whole (``max_batch_size: 0``): a model whose inputs share one batch axis gets the batcher back."""
    ctx.log.info(
        "%s: inputs in counts of their own (first axes %s) are served unbatched (max_batch_size 0), each request run "
        "whole; to have servers batch requests, give every input's first axis one name",
        ", ".join(m.name for m in metas),
        ", ".join(map(str, first_axes(metas[0]))),
    )
