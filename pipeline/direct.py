"""Single stages applied straight to files, for users who bring their own model (no workdir, no cache)."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kiln.config import KilnConfig
from kiln.core.errors import ConfigError, InputFileError
from kiln.core.onnx_io import load_onnx, ort_session

log = logging.getLogger("kiln")


def export_direct(cfg: KilnConfig, checkpoint: str | None, input_shape: str | None, output: Path) -> dict[str, Any]:
    from kiln.models.registry import build_model
    from kiln.stages.export import export_onnx, parity
    from kiln.models.model_io import dataset_for, load_weights, read_state_dict

    model = build_model(cfg.model.name, cfg.model.params)
    checkpoint = checkpoint or cfg.model.checkpoint  # --checkpoint wins over the config's model.checkpoint
    if checkpoint:
        load_weights(model, read_state_dict(Path(checkpoint)), checkpoint)
    else:
        log.warning("exporting '%s' with its initial weights: no --checkpoint and no model.checkpoint given",
                    cfg.model.name)
    model.eval()
    if input_shape:
        example = torch.randn(2, *parse_shape(input_shape))
        try:
            with torch.no_grad():
                model(example)
        except Exception as exc:  # the model rejects this shape: say so, not "an op ONNX cannot express"
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            raise ConfigError(f"the model rejects an input of shape [batch, {input_shape}]: {reason}",
                              hint="give --input-shape the shape of one sample the model takes") from None
    else:
        example = dataset_for(cfg).val_x[:2]
    output.parent.mkdir(parents=True, exist_ok=True)
    proto = export_onnx(model, example, output, cfg.export.opset, cfg.export.dynamic_batch)
    check = parity(model, output, example)
    return {"path": str(output), "nodes": len(proto.graph.node), **check}


def parse_shape(text: str) -> tuple[int, ...]:
    """``--input-shape``: one sample's shape, positive integers separated by commas."""
    try:
        shape = tuple(int(s) for s in text.split(","))
    except ValueError:
        shape = ()
    if not shape or any(d < 1 for d in shape):
        raise ConfigError(f"--input-shape '{text}' is not comma-separated positive integers",
                          hint="one sample's shape without the batch axis, e.g. 3,224,224")
    return shape


def optimize_direct(src: Path, dst: Path, cfg: KilnConfig) -> dict[str, Any]:
    from kiln.stages.optimize.api import optimize_file

    if not src.is_file():
        raise InputFileError(f"ONNX file not found: {src}", hint="check the path")
    return optimize_file(src, dst, cfg.optimize)


def build_direct(src: Path, out: Path, backend: str, device: str, precision: str, cfg: KilnConfig) -> dict[str, Any]:
    from kiln.stages.engines.stage import build_engine

    load_onnx(src, load_external_data=False)  # clear error for a missing or corrupt file before any builder runs
    out.mkdir(parents=True, exist_ok=True)
    cache = out.parent / ".kiln-cache"
    return build_engine(src, out, backend, device, precision, cfg.build, cache)


def reference_outputs(reference: Path, feed: dict[str, np.ndarray], cfg: KilnConfig) -> np.ndarray:
    """First output of the reference: an ONNX model (ONNX Runtime, CPU) or a PyTorch checkpoint of ``cfg.model``."""
    if reference.suffix != ".onnx":
        from kiln.models.registry import build_model
        from kiln.models.model_io import load_weights, read_state_dict

        model = load_weights(build_model(cfg.model.name, cfg.model.params), read_state_dict(reference), str(reference))
        if len(feed) != 1:
            raise InputFileError("a PyTorch reference takes one input; this engine has several",
                                 hint="validate against the ONNX model instead")
        with torch.inference_mode():
            return model.float().eval()(torch.from_numpy(next(iter(feed.values())))).numpy()
    ref_sess = ort_session(load_onnx(reference))
    ref_names = [i.name for i in ref_sess.get_inputs()]
    if sorted(ref_names) != sorted(feed):
        raise InputFileError(f"reference inputs {ref_names} differ from the engine's/feed's {sorted(feed)}",
                             hint="validate an engine against the ONNX model it was built from")
    return ref_sess.run(None, feed)[0]


def read_feed(path: Path, specs: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    """The arrays of an ``.npz`` keyed by the engine's input names, checked against their declared dtypes and
    shapes (``kiln-engine.json`` "inputs")."""
    names = [s["name"] for s in specs]
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
        feed = dict(loaded)
    if sorted(feed) != sorted(names):
        raise InputFileError(f"inputs {path} has arrays {sorted(feed)}; the engine takes {sorted(names)}", hint=hint)
    for spec in specs:
        _check_array(spec, feed[spec["name"]])
    return feed


def _check_array(spec: dict[str, Any], array: np.ndarray) -> None:
    want = [d if isinstance(d, int) and d >= 1 else None for d in spec["shape"]]
    shape_ok = array.ndim == len(want) and all(w is None or w == d for w, d in zip(want, array.shape))
    if array.dtype != np.dtype(spec["dtype"]) or not shape_ok:
        dims = ", ".join("batch" if w is None else str(w) for w in want)
        raise InputFileError(f"input '{spec['name']}' is {array.dtype}{list(array.shape)}; the engine takes "
                             f"{spec['dtype']}[{dims}]",
                             hint=f"save it as {spec['dtype']} with that shape, e.g. x.astype('{spec['dtype']}')")


def validate_direct(engine_dir: Path, reference: Path, inputs: Path | None, cfg: KilnConfig) -> dict[str, Any]:
    from kiln.stages.engines.engines import load_engine, random_feed, read_metadata
    from kiln.stages.validate import check_gates, compare, gates_for, percentiles

    meta = read_metadata(engine_dir)
    if inputs is not None:
        feed = read_feed(inputs, meta["inputs"])
    else:
        feed = random_feed(meta["inputs"], batch=max(cfg.validate_.batch_sizes),
                           hint="pass --inputs file.npz with concrete arrays")
    ref = reference_outputs(reference, feed, cfg)
    with load_engine(engine_dir) as runner:
        got = next(iter(runner.infer(feed).values()))
        t = runner.time_ms(feed, cfg.validate_.warmup, cfg.validate_.iterations)
    if got.shape != ref.shape:
        raise InputFileError(f"engine output shape {got.shape} differs from the reference's {ref.shape}",
                             hint="the engine was built from a different model")
    entry: dict[str, Any] = {"name": meta["name"], **compare(ref, got, ref.argmax(-1))}
    batch = str(len(next(iter(feed.values()))))
    entry["latency_ms"] = {batch: percentiles(t)}
    gates = gates_for(cfg.validate_, meta["precision"])
    gates["max_accuracy_drop"] = 1.0  # no labels: accuracy is agreement with the reference, already gated
    entry["failures"] = check_gates(entry, 1.0, gates, int(batch))
    entry["passed"] = not entry["failures"]
    return entry
