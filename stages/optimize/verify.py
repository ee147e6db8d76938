"""The safety net: does a rewritten graph still compute the same function?

Both graphs run in ONNX Runtime (CPU, its own optimizations off so we test *our* graph) on the same random
inputs, at two sizes of the dynamic axes (``verify_batch`` and 1: a shape baked in by mistake shows at one of
them); the candidate must pass the ONNX checker and match the original model's outputs within
``atol + rtol * max|reference|``. Comparing against the original (not the previous pass) keeps small per-pass
errors from accumulating. A model with random ops (RandomNormal...) gives other draws once a pass changes the
graph (ONNX Runtime seeds each session alike, so two runs of the same graph agree and prove nothing): then
only output shapes and types are compared.
"""
from __future__ import annotations

import logging
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from kiln.stages.optimize.config import OptimizeConfig
from kiln.stages.optimize.passes.util import RANDOM_OPS

log = logging.getLogger("kiln.optimize")
_INLINE_LIMIT = 1_800_000_000  # bytes: above this, hand ORT a file with external data (protobuf caps at 2 GB)


def short_reason(exc: BaseException | str, limit: int = 400) -> str:
    """The part of an error worth a log line: ORT's "[ONNXRuntimeError] : 1 : FAIL :" prefix dropped, one line,
    and when still too long its head and its tail (nested ORT errors put the actual type error last)."""
    text = " ".join(str(exc).split())
    text = re.sub(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ", "", text)
    if len(text) <= limit:
        return text
    head = limit // 3
    return f"{text[:head]} ... {text[-(limit - head - 5):]}"


@dataclass
class Verdict:
    ok: bool
    max_abs_err: float
    reason: str = ""


def random_inputs(model: onnx.ModelProto, cfg: OptimizeConfig, batch: int | None = None) -> dict[str, np.ndarray]:
    """One random array per real graph input; symbolic axes get ``verify_batch`` (a symbolic first axis ``batch``
    when given), integers lie in [0, int_high]."""
    rng = np.random.default_rng(cfg.seed)
    inits = {i.name for i in model.graph.initializer}
    feed: dict[str, np.ndarray] = {}
    for inp in model.graph.input:
        if inp.name in inits:
            continue
        tt = inp.type.tensor_type
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type))
        shape = [d.dim_value if d.HasField("dim_value") else batch if i == 0 and batch else cfg.verify_batch
                 for i, d in enumerate(tt.shape.dim)]
        if dtype == np.bool_:
            feed[inp.name] = rng.random(shape) < 0.5
        elif np.issubdtype(dtype, np.integer):
            feed[inp.name] = rng.integers(0, cfg.int_high + 1, size=shape).astype(dtype)
        else:
            feed[inp.name] = rng.standard_normal(shape).astype(dtype)
    return feed


def run_ort(model: onnx.ModelProto, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.log_severity_level = 3
    names = [o.name for o in model.graph.output]
    if _byte_size(model) < _INLINE_LIMIT:
        sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        return dict(zip(names, sess.run(None, feed)))
    with tempfile.TemporaryDirectory(prefix="kiln-verify-") as tmp:
        path = Path(tmp) / "model.onnx"
        onnx.save_model(model, str(path), save_as_external_data=True, location="model.onnx.data")
        sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        return dict(zip(names, sess.run(None, feed)))


def _byte_size(model: onnx.ModelProto) -> int:
    try:
        return model.ByteSize()
    except ValueError:
        return 1 << 62


class Verifier:
    """Holds the original model's outputs on fixed random inputs; ``check`` compares a candidate to them."""

    def __init__(self, model: onnx.ModelProto, cfg: OptimizeConfig) -> None:
        self.cfg = cfg
        self.feeds = [random_inputs(model, cfg)]
        self.references = [run_ort(model, self.feeds[0])]  # must run: else the caller reports why
        try:  # batch 1 as well, where the model takes it (a dynamic axis that must stay >= 2 is not a batch)
            one = random_inputs(model, cfg, batch=1)
            if any(one[k].shape != v.shape for k, v in self.feeds[0].items()):  # else the same check twice
                self.references.append(run_ort(model, one))
                self.feeds.append(one)
        except Exception as exc:
            log.info("safety net: the input model does not run at batch 1 (%s); checking at %d only",
                     str(exc).splitlines()[0][:120], cfg.verify_batch)
        self.check_graph = _passes_checker(model)
        if not self.check_graph:
            log.warning("the input model fails the ONNX checker; passes are verified by running them only")
        # Dropout is deterministic at inference (and eliminate_noop removes it); the others draw on every run.
        self.random = any(n.op_type in RANDOM_OPS - {"Dropout"} for n in model.graph.node)
        if self.random:
            log.warning("the model has random ops: the safety net can compare only output shapes and types")

    def check(self, candidate: onnx.ModelProto) -> Verdict:
        if self.check_graph and _byte_size(candidate) < _INLINE_LIMIT:
            try:
                onnx.checker.check_model(candidate)
            except onnx.checker.ValidationError as exc:
                return Verdict(False, float("inf"), f"not a valid ONNX graph: {short_reason(exc)}")
        atol, rtol = (float("inf"), float("inf")) if self.random else (self.cfg.atol, self.cfg.rtol)
        worst = 0.0
        for feed, reference in zip(self.feeds, self.references):
            try:
                got = run_ort(candidate, feed)
            except Exception as exc:  # ORT rejects the graph: the pass broke it
                return Verdict(False, float("inf"), f"ONNX Runtime cannot run it: {short_reason(exc)}")
            verdict = compare(reference, got, atol, rtol)
            if not verdict.ok:
                return verdict
            worst = max(worst, verdict.max_abs_err)
        return Verdict(True, worst)


def _passes_checker(model: onnx.ModelProto) -> bool:
    """Whether the checker can judge the passes: not when the input already fails it (then every pass would be
    rolled back for what it inherited), nor for models too big to check in memory."""
    if _byte_size(model) >= _INLINE_LIMIT:
        return False
    try:
        onnx.checker.check_model(model)
        return True
    except onnx.checker.ValidationError:
        return False


def _flat(outputs: dict[str, Any]) -> dict[str, np.ndarray]:
    """Outputs with sequence outputs (lists of arrays) spread out as ``name[i]`` plus their length."""
    flat: dict[str, np.ndarray] = {}
    for name, value in outputs.items():
        if isinstance(value, list):
            flat[f"{name}#len"] = np.array(len(value))
            flat |= {f"{name}[{i}]": np.asarray(v) for i, v in enumerate(value)}
        else:
            flat[name] = np.asarray(value)
    return flat


def compare(reference: dict[str, Any], got: dict[str, Any], atol: float, rtol: float) -> Verdict:
    """Does ``got`` match ``reference`` within ``atol + rtol * max|reference|`` per output? Infinite tolerances
    check shapes and types only (for random outputs)."""
    ref_flat, got_flat = _flat(reference), _flat(got)
    worst = 0.0
    for name, ref in ref_flat.items():
        out = got_flat.get(name)
        if out is None or out.shape != ref.shape or out.dtype != ref.dtype:
            what = "missing" if out is None else f"{out.dtype}{list(out.shape)} vs {ref.dtype}{list(ref.shape)}"
            return Verdict(False, float("inf"), f"output '{name}' {what}")
        if np.isinf(atol):
            continue
        if not np.issubdtype(ref.dtype, np.inexact):
            if not np.array_equal(out, ref):
                return Verdict(False, float("inf"), f"output '{name}' (integer) differs")
            continue
        if not np.array_equal(np.isnan(out), np.isnan(ref)):
            return Verdict(False, float("inf"), f"output '{name}' has NaNs in different places")
        ref64, out64 = ref.astype(np.float64), out.astype(np.float64)
        finite = np.isfinite(ref64)
        if not np.array_equal(out64[~finite], ref64[~finite], equal_nan=True):  # an inf must stay the same inf
            return Verdict(False, float("inf"), f"output '{name}' has infinities in different places")
        err = float(np.max(np.abs(out64[finite] - ref64[finite]), initial=0.0))
        scale = float(np.max(np.abs(ref64[finite]), initial=0.0))
        worst = max(worst, err)
        if err > atol + rtol * scale:
            return Verdict(False, err, f"output '{name}' max abs error {err:.3g} > {atol:g} + {rtol:g} * {scale:.3g}")
    return Verdict(True, worst)
