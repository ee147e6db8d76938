"""``kiln validate ENGINE --reference ...``: one engine folder against an ONNX model or a PyTorch checkpoint,
on the user's inputs (``--inputs x.npz``) or random ones of the engine's declared shapes. No workdir, no cache."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from kiln.core.errors import InputFileError
from kiln.core.inputs import random_inputs
from kiln.core.onnx_io import load_onnx, ort_session
from kiln.core.outputs import logits_name, named_outputs
from kiln.core.records import EngineValidation, TensorSpec
from kiln.models.model_io import load_weights, read_state_dict
from kiln.models.registry import build_model
from kiln.stages.engines.backend import read_metadata
from kiln.stages.engines.registry import load_engine
from kiln.stages.validate.stage import check_gates, compare_all, gates_for, percentiles, summarize

if TYPE_CHECKING:  # the config assembles every stage's section and sits above them; types only
    from kiln.pipeline.config import KilnConfig


def reference_outputs(reference: Path, feed: dict[str, np.ndarray], cfg: KilnConfig) -> dict[str, np.ndarray]:
    """Every output of the reference, by name: an ONNX model (ONNX Runtime, CPU) or a PyTorch checkpoint of
    ``cfg.model`` (called with the feed's arrays as keyword arguments when there are several)."""
    if reference.suffix != ".onnx":
        model = load_weights(build_model(cfg.model.name, cfg.model.params), read_state_dict(reference), str(reference))
        x = {k: torch.from_numpy(v) for k, v in feed.items()}
        with torch.inference_mode():
            outs = named_outputs(model.float().eval(), next(iter(x.values())) if len(x) == 1 else x)
        return {k: v.float().numpy() for k, v in outs.items()}
    ref_sess = ort_session(load_onnx(reference))
    ref_names = [i.name for i in ref_sess.get_inputs()]
    if sorted(ref_names) != sorted(feed):
        raise InputFileError(
            f"reference inputs {ref_names} differ from the engine's/feed's {sorted(feed)}",
            hint="validate an engine against the ONNX model it was built from",
        )
    return dict(zip([o.name for o in ref_sess.get_outputs()], ref_sess.run(None, feed)))


def read_feed(path: Path, specs: list[TensorSpec]) -> dict[str, np.ndarray]:
    """The arrays of an ``.npz`` keyed by the engine's input names, checked against their declared dtypes and
    shapes (``kiln-engine.json`` "inputs")."""
    names = [s.name for s in specs]
    hint = f"give an .npz with one array per input: np.savez(path, {', '.join(f'{n}=...' for n in names)})"
    if not path.is_file():
        raise InputFileError(f"inputs file not found: {path}", hint=hint)
    try:
        loaded = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        raise InputFileError(f"cannot read inputs {path}: {exc}", hint=hint) from None
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        raise InputFileError(f"{path} holds one bare array, not named arrays", hint=hint)
    with loaded:
        try:
            feed = dict(loaded)
        except ValueError as exc:  # an array of Python objects needs pickle, which is never enabled
            raise InputFileError(f"inputs {path} holds pickled objects ({exc})", hint=hint) from None
    if sorted(feed) != sorted(names):
        raise InputFileError(f"inputs {path} has arrays {sorted(feed)}; the engine takes {sorted(names)}", hint=hint)
    for spec in specs:
        _check_array(spec, feed[spec.name])
    return feed


def _check_array(spec: TensorSpec, array: np.ndarray) -> None:
    want = [d if isinstance(d, int) and d >= 1 else None for d in spec.shape]
    shape_ok = array.ndim == len(want) and all(w is None or w == d for w, d in zip(want, array.shape))
    if array.dtype != np.dtype(spec.dtype) or not shape_ok:
        dims = ", ".join("batch" if w is None else str(w) for w in want)
        raise InputFileError(
            f"input '{spec.name}' is {array.dtype}{list(array.shape)}; the engine takes {spec.dtype}[{dims}]",
            hint=f"save it as {spec.dtype} with that shape, e.g. x.astype('{spec.dtype}')",
        )


def validate_direct(engine_dir: Path, reference: Path, inputs: Path | None, cfg: KilnConfig) -> EngineValidation:
    meta = read_metadata(engine_dir)
    if inputs is not None:
        feed = read_feed(inputs, meta.inputs)
    else:
        sizes = [max(v) for v in cfg.validate_.shapes.values() if v]
        feed = random_inputs(
            meta.inputs,
            batch=max(cfg.validate_.batch_sizes),
            dynamic=max(sizes) if sizes else None,
            hint="pass --inputs file.npz with concrete arrays",
        )
    ref = reference_outputs(reference, feed, cfg)
    with load_engine(engine_dir) as runner:
        got = runner.infer(feed)
        t = runner.time_ms(feed, cfg.validate_.warmup, cfg.validate_.iterations)
    for name, r in ref.items():
        if name in got and got[name].shape != r.shape:
            raise InputFileError(
                f"engine output '{name}' has shape {got[name].shape}, the reference's {r.shape}",
                hint="the engine was built from a different model",
            )
    # No labels: accuracy is agreement with the reference, already gated. Every output is compared.
    logits = logits_name(list(ref), cfg.validate_.logits_output)
    entry = EngineValidation(
        name=meta.name, backend=meta.backend, precision=meta.precision, device=meta.device, status="validated"
    )
    summarize(entry, compare_all(ref, got, logits), logits)
    batch = str(len(next(iter(feed.values()))))
    entry.latency_ms = {batch: percentiles(t)}
    entry.gates = gates_for(cfg.validate_, meta.precision)
    entry.failures = check_gates(entry, None, entry.gates, int(batch))
    entry.passed = not entry.failures
    return entry
