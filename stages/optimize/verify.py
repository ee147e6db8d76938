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
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

from kiln.core.compare import within_tolerance
from kiln.core.inputs import AxisSizes
from kiln.core.inputs import random_inputs as make_inputs
from kiln.core.onnx_io import (
    STUB_LOCATION,
    index_ranges,
    io_specs,
    light_model,
    model_bytes,
    ort_session,
    random_nodes,
    session_options,
)
from kiln.core.records import IntRange, by_column, whole_range
from kiln.core.shapes import two_sizes
from kiln.core.text import short_reason
from kiln.stages.optimize.config import OptimizeConfig

log = logging.getLogger("kiln.optimize")
# the size of a dynamic axis the data gave none for, where the model takes it: long enough to reach what a length of
# 2 or 3 does not (relative-position buckets, a sliding window), small enough to cost nothing
UNSEEN_SIZE = 16
_CHECK_LIMIT = 1_800_000_000  # bytes: the checker needs the model in memory, as one protobuf (capped at 2 GB)


@dataclass
class Verdict:
    ok: bool
    max_abs_err: float
    reason: str = ""


DataSizes = Mapping[str, Mapping[int, list[int]]]  # input name -> axis -> [smallest, largest] size in the data
IntRanges = Mapping[str, IntRange]  # integer input name -> [smallest, largest] value in the data (or per column)


def random_inputs(
    model: onnx.ModelProto,
    cfg: OptimizeConfig,
    batch: int | None = None,
    dynamic: int | AxisSizes | None = None,
    int_ranges: IntRanges | None = None,
) -> dict[str, np.ndarray]:
    """One random array per real graph input; symbolic axes get ``verify_batch`` (a symbolic first axis ``batch``,
    other symbolic axes ``dynamic``, when given), integers lie in the data's range of the input (``int_ranges``,
    where the export recorded it), else over the rows of the table the input indexes (an embedding's vocabulary,
    :func:`kiln.core.onnx_io.index_ranges`: an ONNX file from elsewhere has no recorded data), else in
    [0, int_high]; column by column where either has a range per column (:func:`drawn_ranges`); integer masks
    without a range in 0/1 (:func:`masks_as_bits`)."""
    specs, _ = io_specs(model)
    drawn = drawn_ranges(model, int_ranges)
    feed = make_inputs(
        specs,
        batch or cfg.verify_batch,
        dynamic=dynamic or cfg.verify_batch,
        int_high=cfg.int_high,
        seed=cfg.seed,
        int_ranges=drawn,
    )
    return masks_as_bits(feed, drawn, cfg.seed)


def masks_as_bits(feed: dict[str, np.ndarray], drawn: Mapping[str, IntRange], seed: int) -> dict[str, np.ndarray]:
    """``feed`` with each integer input named like a mask (``attention_mask``, ``global_attention_mask``) that has
    no range of its own (``drawn``: the data's or a table's) drawn as 0/1, with the first position of every row 1.
    A mask of other values is no input the model ever gets, and a graph may divide by what it counts (Longformer's
    global tokens): ONNX Runtime then dies of a native division by zero (SIGFPE), which no Python code can catch."""
    rng = np.random.default_rng(seed + 1)
    out = dict(feed)
    for name, values in feed.items():
        if values.dtype.kind in "iu" and "mask" in name.lower() and name not in drawn and values.ndim:
            bits = rng.integers(0, 2, values.shape).astype(values.dtype)
            bits[..., 0] = 1  # no row all masked out
            out[name] = bits
    return out


def drawn_ranges(model: onnx.ModelProto, int_ranges: IntRanges | None) -> dict[str, IntRange]:
    """The range the net draws each integer input from, where it has one (the others take [0, int_high]): the
    data's (``int_ranges``) within the rows of the tables the input indexes (:func:`kiln.core.onnx_io.index_ranges`),
    column by column where either has a range per column, so that an export that recorded one range for a packed
    input (an older ``int_ranges.json``: the widest table's) draws no column past its own table."""
    tables = index_ranges(model)
    return {**tables, **{name: _within(seen, tables.get(name)) for name, seen in (int_ranges or {}).items()}}


def _within(seen: IntRange, table: IntRange | None) -> IntRange:
    """The data's range ``seen`` cut to the index range ``table`` (down to -rows, as ONNX counts from the end),
    per column where either is."""
    if table is None:
        return seen
    n = next((len(r) for r in (table, seen) if by_column(r, len(r))), 0)
    if not n:
        return _clamp(whole_range(seen), whole_range(table))
    tables = by_column(table, n) or [whole_range(table)] * n
    return [_clamp(s, t) for s, t in zip(by_column(seen, n) or [whole_range(seen)] * n, tables)]


def _clamp(seen: list[int], table: list[int]) -> list[int]:
    """``seen`` within ``[-rows, rows - 1]`` of ``table``; the table's own where they do not meet."""
    low, high = max(seen[0], -(table[1] + 1)), min(seen[1], table[1])
    return [low, high] if low <= high else list(table)


def axis_sizes(
    model: onnx.ModelProto, default: int, data: DataSizes | None, largest: bool
) -> dict[str, dict[int, int]]:
    """A size for every dynamic axis besides batch of every input: the data's largest (or smallest; half the
    largest where the data has one size, as validation's default shapes) where the export recorded it, else
    ``default``. The data's sizes are ones the model is known to take (a convolution over audio needs more than
    ``verify_batch`` samples; a position table takes at most its length), and two sizes show a length baked in."""
    specs, _ = io_specs(model)
    out: dict[str, dict[int, int]] = {}
    for spec in specs:
        for axis, dim in enumerate(spec.shape):
            if axis and not (isinstance(dim, int) and dim >= 1):
                seen = (data or {}).get(spec.name, {}).get(axis)
                sizes = two_sizes(min(seen), max(seen)) if seen else [default]
                out.setdefault(spec.name, {})[axis] = sizes[-1] if largest else sizes[0]
    return out


def _checkable(model: onnx.ModelProto) -> bytes | None:
    """``model`` as the checker reads it, serialized: its big initializers declared as graph inputs of their type
    and shape (the checker judges the graph, not the weights; ONNX Runtime runs those), those already listed as
    inputs (an export with ``keep_initializers_as_inputs=True``) left as they are: the checker refuses a name listed
    twice. None for a model whose graph alone is still too big to check in memory."""
    light, _ = light_model(model)
    stubs = [t for t in light.graph.initializer if _is_stub(t)]
    if stubs:
        kept = [t for t in light.graph.initializer if not _is_stub(t)]
        del light.graph.initializer[:]
        light.graph.initializer.extend(kept)
        listed = {i.name for i in light.graph.input}
        light.graph.input.extend(
            onnx.helper.make_tensor_value_info(t.name, t.data_type, t.dims) for t in stubs if t.name not in listed
        )
    return light.SerializeToString() if model_bytes(light) < _CHECK_LIMIT else None


def _is_stub(tensor: onnx.TensorProto) -> bool:
    return any(e.key == "location" and e.value == STUB_LOCATION for e in tensor.external_data)


def _session(model: onnx.ModelProto) -> Any:
    """ONNX Runtime with its own graph optimizations off: they must not hide what a pass did."""
    return ort_session(model, options=session_options(optimization="none"))


@contextmanager
def _unrecorded(model: onnx.ModelProto, on: bool) -> Iterator[onnx.ModelProto]:
    """``model`` without its recorded value_info while the block runs (``on``), put back after: ONNX Runtime trusts
    recorded shapes, and some that ONNX infers are wrong where the graph runs without them."""
    kept = list(model.graph.value_info) if on else []
    if on:
        del model.graph.value_info[:]
    try:
        yield model
    finally:
        model.graph.value_info.extend(kept)


def _run(sess: Any, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feed)))


def run_ort(model: onnx.ModelProto, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The model as written, on one feed."""
    return _run(_session(model), feed)


class Verifier:
    """Holds the original model's outputs on fixed random inputs; ``check`` compares a candidate to them."""

    def __init__(
        self,
        model: onnx.ModelProto,
        cfg: OptimizeConfig,
        data_sizes: DataSizes | None = None,
        int_ranges: IntRanges | None = None,
        unrecorded: bool = False,
    ) -> None:
        """``data_sizes``: the sizes the export saw on each dynamic axis besides batch (``dynamic_sizes.json``);
        ``int_ranges``: the values it saw in each integer input (``int_ranges.json``); ``unrecorded``: ONNX Runtime
        runs the model and every candidate without their recorded value_info (where it fails on ONNX's inferred
        shapes but runs the graph without them)."""
        self.cfg, self.unrecorded = cfg, unrecorded
        with _unrecorded(model, unrecorded):
            sess = _session(model)  # one session for both references
        first, reference = self._first_feed(model, sess, data_sizes, int_ranges)
        self.feeds, self.references = [first], [reference]
        # batch 1 as well, where the model takes it (a dynamic axis that must stay >= 2 is not a batch), with every
        # other dynamic axis (a sequence) at a second size too: a length baked in by mistake shows at one of them
        second = self._second_feed(model, sess, data_sizes, int_ranges)
        if second is not None and any(second[0][k].shape != v.shape for k, v in self.feeds[0].items()):
            self.feeds.append(second[0])  # else the same check twice
            self.references.append(second[1])
        self.check_graph = _passes_checker(_checkable(model))
        if not self.check_graph:
            log.warning("the input model fails the ONNX checker; passes are verified by running them only")
        # a Dropout only where its training_mode is set: at inference it is a no-op that eliminate_noop removes
        self.random = bool(random_nodes(model))
        if self.random:
            log.warning("the model has random ops: the safety net can compare only output shapes and types")

    def _first_feed(
        self, model: onnx.ModelProto, sess: Any, data_sizes: DataSizes | None, int_ranges: IntRanges | None
    ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """A ``verify_batch`` feed and its outputs: dynamic axes the data gave no size for at :data:`UNSEEN_SIZE`
        where the model runs it (a sequence of 2 leaves untouched what only longer ones reach: a relative-position
        bucket past the first few, a window), else at ``verify_batch``. The last try must run: else the caller
        reports why."""
        cfg = self.cfg
        tries = [
            axis_sizes(model, size, data_sizes, True) for size in (max(UNSEEN_SIZE, cfg.verify_batch), cfg.verify_batch)
        ]
        if tries[0] == tries[1]:
            tries = tries[1:]
        for sizes in tries[:-1]:
            feed = random_inputs(model, cfg, dynamic=sizes, int_ranges=int_ranges)
            try:
                return feed, _run(sess, feed)
            except Exception:  # ORT's own error type: a size the model does not take (a position table of 8)
                pass
        feed = random_inputs(model, cfg, dynamic=tries[-1], int_ranges=int_ranges)
        return feed, _run(sess, feed)

    def _second_feed(
        self, model: onnx.ModelProto, sess: Any, data_sizes: DataSizes | None, int_ranges: IntRanges | None
    ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]] | None:
        """A batch-1 feed the input model runs, and its outputs: the other dynamic axes at their second size
        (:func:`axis_sizes`), else, where the model does not take that size (a convolution stack that needs 32
        pixels or more), at the first feed's sizes; None (said) where it does not run at batch 1 at all."""
        cfg, tried = self.cfg, []
        for largest in (False, True):
            sizes = axis_sizes(model, cfg.verify_batch + 1, data_sizes, largest)
            try:
                one = random_inputs(model, cfg, batch=1, dynamic=sizes, int_ranges=int_ranges)
                return one, _run(sess, one)
            except Exception as exc:
                at = ", ".join(f"{n}[{a}]={v}" for n, axes in sizes.items() for a, v in axes.items())
                tried.append(f"batch 1{' with ' + at if at else ''}: {short_reason(exc, 120)}")
                if not sizes:
                    break
        log.info(
            "safety net: the input model does not run at %s; checking at batch %d only",
            "; nor at ".join(tried),
            cfg.verify_batch,
        )
        return None

    def check(self, candidate: onnx.ModelProto) -> Verdict:
        """Whether ``candidate`` passes the checker and matches the original model on every feed (one ONNX
        Runtime session runs all the feeds; neither the checker nor ORT gets a serialized copy of the weights)."""
        data = _checkable(candidate) if self.check_graph else None
        if data is not None:
            try:
                onnx.checker.check_model(data)
            except onnx.checker.ValidationError as exc:
                return Verdict(False, float("inf"), f"not a valid ONNX graph: {short_reason(exc)}")
        atol, rtol = (float("inf"), float("inf")) if self.random else (self.cfg.atol, self.cfg.rtol)
        try:
            with _unrecorded(candidate, self.unrecorded):
                sess = _session(candidate)
            outputs = [_run(sess, feed) for feed in self.feeds]
        except Exception as exc:  # ORT rejects the graph: the pass broke it
            return Verdict(False, float("inf"), f"ONNX Runtime cannot run it: {short_reason(exc)}")
        worst = 0.0
        for reference, got in zip(self.references, outputs):
            verdict = compare(reference, got, atol, rtol)
            if not verdict.ok:
                return verdict
            worst = max(worst, verdict.max_abs_err)
        return Verdict(True, worst)


def _passes_checker(data: bytes | None) -> bool:
    """Whether the checker can judge the passes: not when the input already fails it (then every pass would be
    rolled back for what it inherited), nor for graphs too big to check in memory (``data`` None)."""
    if data is None:
        return False
    try:
        onnx.checker.check_model(data)
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
    """Does ``got`` match ``reference`` within ``atol + rtol * max|reference|`` per output (the comparator's
    :func:`~kiln.core.compare.within_tolerance`)? Infinite tolerances check shapes and types only (random outputs)."""
    ref_flat, got_flat = _flat(reference), _flat(got)
    worst = 0.0
    for name, ref in ref_flat.items():
        out = got_flat.get(name)
        if out is None:
            return Verdict(False, float("inf"), f"output '{name}' missing")
        if np.isinf(atol):
            if out.shape != ref.shape or out.dtype != ref.dtype:
                return Verdict(
                    False, float("inf"), f"output '{name}' {out.dtype}{list(out.shape)} vs {ref.dtype}{list(ref.shape)}"
                )
            continue
        ok, err, why = within_tolerance(ref, out, atol, rtol)
        if not ok:
            return Verdict(False, err, f"output '{name}' {why}")
        worst = max(worst, err)
    return Verdict(True, worst)
