"""Building each precision variant of an FP32 graph: FP16 mixed precision and INT8 Q/DQ, each through the
accuracy-driven fallback. Callable without the pipeline (the benchmark and tests use it directly)."""

from __future__ import annotations

import functools
import logging
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from kiln.calibration.config import CalibrationConfig
from kiln.calibration.data import Batch
from kiln.calibration.quantize import (
    PER_CHANNEL_OPSET,
    dynamic_nodes,
    excluded_nodes,
    first_last_compute,
    folds_to_weight,
    ort_cpu_scheme,
    per_channel_graph,
    quantizable_op_types,
    quantize_fp8,
    quantize_int8,
    quantize_int8_dynamic,
    unbounded_nodes,
)
from kiln.calibration.ranges import Ranges, calibrate
from kiln.calibration.trt_table import write_trt_table
from kiln.core.errors import InputError, ModelError
from kiln.core.onnx_io import infer_shapes, save_onnx
from kiln.stages.optimize.api import optimize_record
from kiln.stages.precision.audit import (
    COMPUTE,
    FP32_HINT,
    INTEGER,
    LOW,
    MIN_SHARE,
    Audit,
    audit_graph,
    compute_precisions,
    flops_by_op,
)
from kiln.stages.precision.compare import Samples
from kiln.stages.precision.config import FallbackConfig, FP16Config
from kiln.stages.precision.emulate import emulate_fp16
from kiln.stages.precision.fallback import FallbackResult, Label, run_fallback
from kiln.stages.precision.fp16 import convert_fp16, name_nodes
from kiln.stages.precision.fp16_select import INDEX_OPS, PERIODIC_OPS, phase_nodes, select_fp32_nodes
from kiln.stages.precision.gate import GateCheck

log = logging.getLogger("kiln.precision")


@dataclass
class Source:
    """The FP32 graph (named, shape-inferred) saved at ``path``, its input name and calibration batches."""

    model: onnx.ModelProto
    path: Path
    input_name: str
    batches: list[Batch]
    cache_dir: Path | None
    logits: int | None = 0  # index of the class-logit output (top-1 agreement); None: the model has none
    # Where top-1 agreement counts on the held-out samples the fallback compares: their labelled positions, for
    # labels per position (kiln.core.labels; a tagger's padding has none); None: every row and position
    labelled: np.ndarray | None = None

    @classmethod
    def prepare(
        cls,
        model: onnx.ModelProto,
        path: Path,
        batches: list[Batch],
        cache_dir: Path | None,
        logits: int | None = 0,
        labelled: np.ndarray | None = None,
    ) -> Source:
        model = name_nodes(infer_shapes(model))
        save_onnx(model, path)
        return cls(model, path, model.graph.input[0].name, batches, cache_dir, logits, labelled)

    @functools.cached_property
    def flops(self) -> dict[str, int] | None:
        """FLOPs per sample by op type (:func:`~kiln.stages.precision.audit.flops_by_op`): which ONNX Runtime CPU
        INT8 scheme the graph gets (:func:`~kiln.calibration.quantize.ort_cpu_scheme`)."""
        return flops_by_op(self.model)

    def ranges(self, method: str, ccfg: CalibrationConfig) -> Ranges:
        return calibrate(
            self.path,
            self.batches,
            self.input_name,
            method,
            cache_dir=self.cache_dir,
            symmetric=ccfg.symmetric_activations,
            percentile=ccfg.percentile,
        )


class NotMade(ModelError):
    """A variant that no fallback round got through the gates its engines face, or that its quantization cannot
    reach: an outcome of the graph, not a failure of its build, so beside variants that go on it is a warning (a
    run passes without it unless precision.required names it)."""


QDQ = ("QuantizeLinear", "DequantizeLinear")
HALF = (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)


@dataclass(frozen=True)
class Carried:
    """The low precision a graph brings with it before Kiln converts it: a QAT or fake-quant model's own Q/DQ pairs
    or integer ops, or float16 weights. ``low``: the precision it computes in by the audit's label (at least
    :data:`MIN_SHARE` of its FLOPs, the rule the build judges an engine's label by); None where only a part of it is
    low. ``found``: what shows it in the graph, as a user looks it up; ``share``: its FLOPs by precision;
    ``quantized``: Q/DQ nodes or integer ops are among it; ``half``: its float16 weights."""

    low: str | None
    found: str
    share: dict[str, float]
    quantized: bool
    half: int

    @property
    def said(self) -> str:
        """What the graph carries, in words: whose quantization, what was found and how much of it computes low."""
        shares = [f"{v:.0%} of its FLOPs in {p}" for p, v in self.share.items() if p != "fp32"]
        what = f"{self.found}; {', '.join(shares)}" if shares else self.found
        if self.low is None:
            return f"the graph is {'quantized' if self.quantized else 'in float16'} in part already ({what})"
        if self.quantized:
            return f"the model carries its own quantization ({what})"
        return f"the model computes in {self.low} already ({what})"

    def left_out(self, wanted: Collection[str]) -> dict[str, NotMade]:
        """The variants of ``wanted`` not made from this graph, each with why and the fix: beside ``low`` (made as
        the graph is), every other one; where only a part is low, every one but FP32, which computes as it did."""
        kept = {self.low} if self.low else {"fp32"}
        return {
            p: NotMade(f"{p} not made: {self.said}; {self._why(p)}", hint=self._fix()) for p in wanted if p not in kept
        }

    def _why(self, precision: str) -> str:
        """Why ``precision`` is not made from this graph."""
        if self.low and precision in ("fp32", "fp16"):
            return f"an {precision} variant would be that {self.low} graph labelled {precision}"
        if precision == "fp16":
            if self.half:
                return "onnxconverter-common refuses to convert a graph already in float16"
            return "FP16 conversion cannot convert its Q/DQ nodes, whose scales stay float32"
        if self.quantized:
            return f"{precision.upper()} quantization would add Q/DQ pairs of its own beside these, quantizing twice"
        return f"{precision.upper()} quantization takes float32 tensors: its float16 weights make an invalid graph"

    def _fix(self) -> str:
        """The fix for a variant not made: the model without its own low precision, from which Kiln makes every
        variant (one fix for all of them, said once)."""
        if self.low is None:
            return FP32_HINT
        own = "quantization (no prepare_qat, no torch.fake_quantize_* in forward)" if self.quantized else "float16"
        return (
            f"none needed for its {self.low} engines, whose variant is the graph as exported; for engines of other "
            f"precisions give Kiln the model without its own {own}: Kiln makes every variant from the FP32 model"
        )

    def refuse_without_low(self, wanted: Collection[str]) -> None:
        """Refuse a run whose ``wanted`` variants (precision.variants) leave out the precision the graph computes in:
        every variant it could make would be that graph mislabelled."""
        if self.low is None or self.low in wanted:
            return
        own = "fake-quant (prepare_qat, torch.fake_quantize_*)" if self.quantized else "float16"
        raise ModelError(
            f"{self.said}: the graph is already {self.low}, and precision.variants ({', '.join(wanted)}) has no "
            f"{self.low}",
            hint=f"add {self.low} to precision.variants (its {self.low} variant is the graph as exported), or train "
            f"the model without {own} for {'/'.join(p for p in wanted if p != self.low)} variants",
        )

    def as_given(self, src: Source, out: Path) -> dict[str, Any]:
        """The ``low`` variant: the graph as exported (nodes named, shapes inferred) at ``out``, neither calibrated nor
        converted again; its note says so in the report."""
        save_onnx(src.model, out)
        note = f"{self.said}: the graph as exported, neither calibrated nor converted again"
        carried = {"found": self.found, "share": self.share}
        return {
            "path": f"{out.parent.name}/{out.name}",
            "kept_fp32": [],
            "reasons": {},
            "graph": note,
            "carried": carried,
        }


def carried_precision(model: onnx.ModelProto) -> Carried | None:
    """What low precision ``model`` carries (:class:`Carried`), read as the precision audit reads engines (Q/DQ
    nodes, integer ops, float16 tensors, and the share of the FLOPs each precision computes); None: it computes in
    FP32 alone, as an export of an FP32 model does. Audited only where some Q/DQ node, integer op or float16 tensor
    is there."""
    graphs = [model.graph, *(g for _, g in _bodies(model.graph))]
    ops = Counter(n.op_type for g in graphs for n in g.node)
    half = sum(t.data_type in HALF for g in graphs for t in g.initializer)
    integer = {op: ops[op] for op in sorted(INTEGER) if ops[op]}
    quantized = bool(ops[QDQ[0]] or ops[QDQ[1]] or integer)
    to_half = any(n.op_type == "Cast" and _cast_to(n) in HALF for g in graphs for n in g.node)
    if not (quantized or half or to_half):
        return None
    audit = audit_graph(model, run=False)
    if audit.label() == "fp32" and any(audit.uncounted[p] for p in LOW):  # nodes sized only by a run may be low
        audit = audit_graph(model)
    if not (quantized or half or any(audit.nodes[p] for p in LOW)):
        return None
    low = audit.label()
    found = _found(ops, integer, half, audit)
    return Carried(None if low == "fp32" else low, found, audit.share(), quantized, half)


def _found(ops: Counter[str], integer: dict[str, int], half: int, audit: Audit) -> str:
    """What makes a graph low, as a user finds it: its Q/DQ nodes (in pairs where they pair), integer ops, float16
    weights, else its compute nodes on float16 tensors."""
    q, dq = ops[QDQ[0]], ops[QDQ[1]]
    parts = [f"{q} Q/DQ pair{'s' if q > 1 else ''}"] if q and q == dq else []
    if q != dq:
        parts.append(" and ".join(f"{n} {op}" for op, n in zip(QDQ, (q, dq)) if n) + " nodes")
    parts += [f"{n} {op}" for op, n in integer.items()]
    if half:
        parts.append(f"{half} float16 weight{'s' if half > 1 else ''}")
    return ", ".join(parts) or f"{audit.nodes['fp16']} compute nodes on float16 tensors"


def _cast_to(node: onnx.NodeProto) -> int | None:
    return next((a.i for a in node.attribute if a.name == "to"), None)


def _bodies(graph: onnx.GraphProto) -> Iterator[tuple[onnx.NodeProto, onnx.GraphProto]]:
    """Each Loop, Scan and If body in ``graph`` (nested ones too), with the node that owns it."""
    for node in graph.node:
        for attr in node.attribute:
            for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
                yield node, sub
                yield from _bodies(sub)


def unreached(model: onnx.ModelProto, ops: Collection[str], precision: str) -> dict[str, str]:
    """The compute nodes of op types ``ops`` inside Loop, Scan and If bodies, named ``<owner>/<node>``, each with why
    it stays float: ONNX Runtime's quantizers, as Kiln calls them (static Q/DQ and dynamic alike), quantize the main
    graph only. Raises :class:`NotMade` where those nodes are all the graph's compute of those op types: no
    ``precision`` variant would compute any of it in ``precision``."""
    compute = set(ops) & COMPUTE
    inside = {
        f"{owner.name or owner.op_type}/{n.name or f'{n.op_type}_{i}'}": (n.op_type, owner.op_type)
        for owner, body in _bodies(model.graph)
        for i, n in enumerate(body.node)
        if n.op_type in compute
    }
    if not inside:
        return {}
    owners = sorted({owner for _, owner in inside.values()})
    bodies = f"a {owners[0]} body" if len(owners) == 1 else f"{' and '.join(owners)} bodies"
    reach = f"which {precision.upper()} quantization does not reach"
    if not any(n.op_type in compute for n in model.graph.node):
        counts = Counter(op for op, _ in inside.values())
        raise NotMade(
            f"{precision} not made: its compute nodes ({', '.join(f'{op} x{n}' for op, n in counts.most_common())}) "
            f"are inside {bodies}, {reach}",
            hint=f"leave {precision} out of precision.variants",
        )
    return {name: f"inside a {owner} body, {reach}: computes in float" for name, (_, owner) in inside.items()}


def _float_nodes(model: onnx.ModelProto) -> set[str]:
    return {n.name for n in model.graph.node if n.op_type not in INDEX_OPS}


def as_check(src: Source, x_val: Samples | GateCheck) -> GateCheck:
    """The check variants are judged by: a pipeline run's (validation's held-out data and gates), or one on the
    samples given (one shape, default gates)."""
    return x_val if isinstance(x_val, GateCheck) else GateCheck.on_samples(src.model, x_val, src.logits)


def build_fp16(
    src: Source,
    out: Path,
    cfg: FP16Config,
    fallback: FallbackConfig,
    x_val: Samples | GateCheck,
    ccfg: CalibrationConfig,
) -> dict[str, Any]:
    """FP16 graph at ``out``: sensitive and out-of-range nodes FP32, then fallback until the gates hold."""
    amax, unchecked = _fp16_amax(src, cfg, ccfg)
    base = select_fp32_nodes(src.model, cfg, amax)
    info: dict[str, Any] = {}
    unconvertible: dict[str, str] = {}  # nodes the converter cannot make FP16: FP32 in every round after

    with tempfile.TemporaryDirectory(prefix="kiln-fp16-") as tmp:

        def build(extra: set[str]) -> Path:
            model, stats = convert_fp16(src.model, set(base) | set(unconvertible) | extra, cfg)
            unconvertible.update(stats.pop("unconvertible", {}))
            info.update(stats)
            save_onnx(model, out)
            # Accuracy is judged on the FP16 emulation: ORT's CPU provider would hide FP16 rounding (emulate.py).
            emulated = Path(tmp) / "emulated.onnx"
            save_onnx(emulate_fp16(src.model, set(base) | set(unconvertible) | extra), emulated)
            return emulated

        res = run_fallback(build, as_check(src, x_val), "fp16", fallback, _float_nodes(src.model) - set(base), "fp16")
    extra = {**info, "unconvertible": sorted(unconvertible), **({"range_check": unchecked} if unchecked else {})}
    return _entry(out, base | unconvertible | res.kept, res, extra)


def _fp16_amax(src: Source, cfg: FP16Config, ccfg: CalibrationConfig) -> tuple[dict[str, float], str | None]:
    """The calibrated magnitudes the FP16 range check keeps out-of-FP16-range tensors' nodes in FP32 by, and why
    the check was skipped (None: it ran or is off). FP16 needs no scales: calibration data that gives no usable
    ranges (:func:`kiln.calibration.ranges.check_ranges`) is the INT8 variant's failure to report, and FP16 goes on
    without the check, its fallback still keeping in FP32 the nodes whose overflow misses the gates."""
    if not (cfg.range_check and src.batches):
        return {}, None
    try:
        return src.ranges("minmax", ccfg).amax(), None
    except InputError as exc:
        log.warning("fp16: range check skipped, the calibration data gives no ranges: %s", exc.message)
        return {}, f"skipped: {exc.message}"


def build_int8(
    src: Source,
    out: Path,
    ccfg: CalibrationConfig,
    fallback: FallbackConfig,
    x_val: Samples | GateCheck,
    qdq_read: bool = True,
) -> dict[str, Any]:
    """INT8 Q/DQ graph at ``out`` from cached calibration ranges, plus the TensorRT 10 calibration table. A graph
    older than per-channel Q/DQ is quantized from a raised copy (:func:`per_channel_graph`), judged against the
    FP32 graph as it came. Compute nodes inside Loop, Scan and If bodies stay float (:func:`unreached`, listed under
    ``unreached``); a graph with all of them there is no INT8 variant. ``qdq_read``: some engine loads the Q/DQ
    graph (TensorRT, ONNX Runtime CUDA); False where ONNX Runtime CPU engines alone load INT8 graphs, whose own
    graph is then searched first (:func:`_cpu_first`)."""
    inside = unreached(src.model, quantizable_op_types(ccfg), "int8")
    raised, ccfg = per_channel_graph(src.model, ccfg)
    if raised is None:
        entry = _build_int8(src, out, ccfg, fallback, as_check(src, x_val), qdq_read)
    else:
        with tempfile.TemporaryDirectory(prefix="kiln-int8-") as tmp:
            copy = Source.prepare(
                raised, Path(tmp) / "model.onnx", src.batches, src.cache_dir, src.logits, src.labelled
            )
            entry = _build_int8(copy, out, ccfg, fallback, as_check(src, x_val), qdq_read)
        entry["calibration"]["opset"] = PER_CHANNEL_OPSET
    return {**entry, "unreached": inside} if inside else entry


def _build_int8(
    src: Source, out: Path, ccfg: CalibrationConfig, fallback: FallbackConfig, check: GateCheck, qdq_read: bool = True
) -> dict[str, Any]:
    ranges = src.ranges(ccfg.method, ccfg)
    base = _kept_before_fallback(src.model, ccfg, ranges)
    info: dict[str, Any] = {}

    def build(extra: set[str]) -> Path:
        info.update(quantize_int8(src.path, out, ranges, ccfg, extra | set(base)))
        return out

    ops = set(quantizable_op_types(ccfg))
    candidates = {n.name for n in src.model.graph.node if n.op_type in ops} - set(base)
    cpu_candidates = candidates | (dynamic_nodes(src.model, ccfg, src.flops) - set(base))  # its LSTMs, where dynamic
    ort_out = out.with_name("model.ort_cpu.onnx")
    with_cpu = ccfg.ort_cpu_graph and ccfg.activation_type == "int8"
    ort: dict[str, Any] | None = None
    searched = True
    if with_cpu and not qdq_read:
        res, ort, searched = _cpu_first(build, src, out, ccfg, fallback, check, base, candidates, cpu_candidates)
    else:
        res = _in_precision(run_fallback(build, check, "int8", fallback, candidates, "int8"), out, "int8")
    entry = _entry(
        out,
        base | res.kept,
        res,
        {
            "calibration": {
                "method": ranges.method,
                "cache_key": ranges.key,
                "cache_hit": ranges.cache_hit,
                "batches": len(src.batches),
                "qdq_nodes": info.get("qdq_nodes"),
                "reduce_range": info.get("reduce_range"),
                "per_channel": ccfg.per_channel,
            }
        },
    )
    if not searched:
        entry["fallback"]["not_searched"] = NOT_SEARCHED
    if with_cpu:
        # from the nodes the Q/DQ graph kept in float where it passed; from the base alone where it did not (its
        # fallback may have kept every node, and this graph, of another scheme, may need none of them)
        inherited = {n: f"kept in the Q/DQ graph ({why})" for n, why in res.kept.items()} if res.passed else {}
        if ort is None:
            ort = ort_cpu_graph(src, ort_out, ccfg, fallback, check, base, inherited, cpu_candidates)
        if quantized_nothing(ort["fallback"]):
            _no_ort_cpu_graph(entry, ort_out, ort)
        else:
            entry["ort_cpu"] = ort
            _say_unfolded(src.model, ort_out, ort)
            entry["backend_paths"] = {"onnxruntime-cpu": f"{out.parent.name}/{ort_out.name}"}
    if ccfg.trt_table:
        table = write_trt_table(ranges.amax(), out.parent / "calibration.cache")
        entry["trt_calibration_table"] = table.name
    return entry


# why the Q/DQ graph is checked once, not searched, where ONNX Runtime CPU engines alone load INT8 graphs
NOT_SEARCHED = "not searched: no engine of this run reads the Q/DQ graph (ONNX Runtime CPU engines load their own)"


def _cpu_first(
    build: Callable[[set[str]], Path],
    src: Source,
    out: Path,
    ccfg: CalibrationConfig,
    fallback: FallbackConfig,
    check: GateCheck,
    base: dict[str, str],
    candidates: set[str],
    cpu_candidates: set[str],
) -> tuple[FallbackResult, dict[str, Any], bool]:
    """Where ONNX Runtime CPU engines alone load INT8 graphs: the Q/DQ graph checked once (round 0), then the ONNX
    Runtime CPU graph through its own fallback from the configuration's nodes (``base``). The Q/DQ graph is
    searched only where that graph misses its gates, quantizes nothing or leaves under :data:`MIN_SHARE` of its
    FLOPs in int8 (at the check's sizes), for its engines then load the Q/DQ graph; else a Q/DQ graph that missed
    at round 0 is recorded as not searched (:data:`NOT_SEARCHED`): a search whose graph no engine of the run reads
    costs as many rounds as the one that matters. Returns the Q/DQ graph's result, the ONNX Runtime CPU graph's
    record and whether the Q/DQ graph was searched."""
    ort_out = out.with_name("model.ort_cpu.onnx")
    once = fallback.model_copy(update={"max_rounds": 0})
    res = _in_precision(run_fallback(build, check, "int8", once, candidates, "int8"), out, "int8")
    ort = ort_cpu_graph(src, ort_out, ccfg, fallback, check, base, {}, cpu_candidates)
    if res.passed:
        return res, ort, True
    if ort["fallback"]["passed"] and _int8_share(ort_out, _sample_sizes(src.model, check.samples)) >= MIN_SHARE:
        return res, ort, False  # the stage says it, as the variant's unmade Q/DQ graph
    log.info("int8: ONNX Runtime CPU's own graph is not made: searching the Q/DQ graph, which its engines then load")
    return _in_precision(run_fallback(build, check, "int8", fallback, candidates, "int8"), out, "int8"), ort, True


def _no_ort_cpu_graph(entry: dict[str, Any], path: Path, ort: dict[str, Any]) -> None:
    """No ONNX Runtime CPU graph where its calibration quantized no compute node (a dynamic scheme on a graph whose
    MatMuls take no stored weight, which the quantizer warned of): it is not a variant that failed its gates, and
    ONNX Runtime CPU engines load the Q/DQ graph, as where no such graph is asked for."""
    path.unlink(missing_ok=True)
    Path(f"{path}.data").unlink(missing_ok=True)
    scheme = f"{ort['scheme']} " if ort.get("scheme") else ""
    entry["ort_cpu_unmade"] = (
        f"int8 (onnxruntime-cpu graph) not made: its {scheme}calibration quantized no compute node, so there is no "
        "int8 graph of its own"
    )


ORT_CPU = "int8 onnxruntime-cpu"
INHERITED = "inherited from the Q/DQ graph"


def ort_cpu_graph(
    src: Source,
    out: Path,
    ccfg: CalibrationConfig,
    fallback: FallbackConfig,
    check: GateCheck,
    base: dict[str, str],
    inherited: dict[str, str],
    candidates: set[str],
) -> dict[str, Any]:
    """The ONNX Runtime CPU graph at ``out`` (:func:`ort_cpu_with_fallback`), started from the nodes the Q/DQ graph
    kept in float (``inherited``) beside the configuration's (``base``). Where it passes at once with them, nothing
    says it needs them (its scheme is another), while they may leave too little of it in int8 for the precision
    audit (:data:`MIN_SHARE`): then one more fallback from ``base`` alone, and of the two the passing graph with
    the larger share of its FLOPs in int8 is kept (``starts`` records both). A graph over the audit's share is
    kept as it is: another fallback would cost more than the few nodes it might bring back."""
    first = ort_cpu_with_fallback(src, out, ccfg, fallback, check, base, candidates, inherited)
    if not _passed_as_started(first, inherited):
        return first
    sizes = _sample_sizes(src.model, check.samples)
    with_them = _int8_share(out, sizes)
    if with_them >= MIN_SHARE:
        return first
    shares: dict[str, float | None] = {"with": with_them}
    log.info(
        "%s: passed with the %d nodes %s in float (%.0f%% of its FLOPs in int8); tried without them too",
        ORT_CPU,
        len(inherited),
        INHERITED,
        100 * with_them,
    )
    with tempfile.TemporaryDirectory(prefix="kiln-int8-") as tmp:
        alone_out = Path(tmp) / out.name
        label = f"{ORT_CPU} (without the Q/DQ graph's nodes)"
        alone = ort_cpu_with_fallback(src, alone_out, ccfg, fallback, check, base, candidates, label=label)
        shares["without"] = _int8_share(alone_out, sizes) if alone["fallback"]["passed"] else None
        chosen = "without" if _more_int8(alone, shares["without"], first, shares["with"]) else "with"
        if chosen == "without":
            shutil.copyfile(alone_out, out)
    _log_start(first, alone, shares, chosen)
    starts = {k: _start_record(r, shares[k]) for k, r in (("with", first), ("without", alone))}
    return {
        **(alone if chosen == "without" else first),
        "starts": {"inherited": sorted(inherited), **starts, "kept": chosen},
    }


def _more_int8(graph: dict[str, Any], share: float | None, than: dict[str, Any], than_share: float | None) -> bool:
    """Whether a passing graph (``share`` not None) runs more of its FLOPs in int8 than the other, or as much with
    fewer nodes in float."""
    if share is None or than_share is None:
        return than_share is None and share is not None
    return (share, -len(graph["kept_fp32"])) > (than_share, -len(than["kept_fp32"]))


def _passed_as_started(ort: dict[str, Any], inherited: dict[str, str]) -> bool:
    """Whether the graph passed in its first round with ``inherited`` nodes in float: untested without them."""
    rounds = ort["fallback"]["rounds"]
    return bool(inherited) and ort["fallback"]["passed"] and len(rounds) == 1 and not rounds[0]["failures"]


def _log_start(first: dict[str, Any], alone: dict[str, Any], shares: dict[str, float | None], chosen: str) -> None:
    with_them = f"{shares['with']:.0%} of its FLOPs in int8 with them"
    if chosen == "without":
        log.info(
            "%s: kept without the Q/DQ graph's nodes: %d nodes kept FP32, %s of its FLOPs in int8 (%s)",
            ORT_CPU,
            len(alone["kept_fp32"]),
            f"{shares['without']:.0%}",
            with_them,
        )
        return
    why = (
        f"it misses the gates ({'; '.join(alone['fallback']['failures'])})"
        if shares["without"] is None
        else f"{shares['without']:.0%} of its FLOPs in int8, {with_them}"
    )
    log.info(
        "%s: kept with the nodes %s (%d nodes kept FP32); without them %s",
        ORT_CPU,
        INHERITED,
        len(first["kept_fp32"]),
        why,
    )


def _start_record(ort: dict[str, Any], share: float | None) -> dict[str, Any]:
    fallback = ort["fallback"]
    return {
        "passed": fallback["passed"],
        "int8_share": share,
        "kept_fp32": len(ort["kept_fp32"]),
        "failures": fallback["failures"],
    }


def _sample_sizes(model: onnx.ModelProto, feed: Samples) -> dict[str, int]:
    """The size of each named axis but the first (the batch) of the graph's inputs in ``feed``: where a graph's
    share of FLOPs in int8 is counted (the check's own samples)."""
    arrays = feed if isinstance(feed, dict) else {model.graph.input[0].name: feed}
    sizes: dict[str, int] = {}
    for inp in model.graph.input:
        x = arrays.get(inp.name)
        for axis, dim in enumerate(inp.type.tensor_type.shape.dim):
            if axis and dim.dim_param and x is not None and axis < np.ndim(x):
                sizes[dim.dim_param] = int(np.shape(x)[axis])
    return sizes


def _int8_share(path: Path, sizes: dict[str, int]) -> float:
    return audit_graph(path, sizes).share().get("int8", 0.0)


def ort_cpu_with_fallback(
    src: Source,
    out: Path,
    ccfg: CalibrationConfig,
    fallback: FallbackConfig,
    check: GateCheck | Samples,
    kept: dict[str, str],
    candidates: set[str],
    inherited: dict[str, str] | None = None,
    label: str = ORT_CPU,
) -> dict[str, Any]:
    """The ONNX Runtime CPU graph through a fallback of its own: its scheme (uint8 static, or dynamic ranges
    measured per batch) loses accuracy where the symmetric Q/DQ graph does not, and it is what ORT CPU engines
    run, so passing on the Q/DQ graph says nothing about it. Starts with ``kept`` (node -> why) and the nodes the
    Q/DQ graph kept (``inherited``, its round lines count them) in float: ``reasons`` lists them beside those its
    own fallback adds, one per node of ``kept_fp32`` (the report counts the one and lists the other)."""
    info: dict[str, Any] = {}
    start = kept | (inherited or {})

    def build(extra: set[str]) -> Path:
        info.update(build_ort_cpu_int8(src, out, ccfg, set(start) | extra))
        return out

    named = Label(label, inherited, INHERITED) if inherited else label
    res = run_fallback(build, as_check(src, check), "int8", fallback, candidates - set(start), named)
    _in_precision(res, out, "int8", held=bool(inherited))
    return {
        **info,
        "kept_fp32": sorted(start | res.kept),
        "reasons": dict(sorted((start | res.kept).items())),
        "vs_fp32": _vs_fp32(res),
        "fallback": _fallback_record(res),
    }


def _say_unfolded(model: onnx.ModelProto, path: Path, ort: dict[str, Any]) -> None:
    """Warn where ONNX Runtime CPU's dynamically quantized graph at ``path`` (``ort``: its record) left MatMul/Gemm
    layers in float that reach their weights through other nodes (a Transpose of a stored weight, as an
    un-optimized export has it): dynamic quantization takes stored weights only, so these stay float until
    constant folding (``kiln optimize``) makes them stored, and the graph may fall short of the precision audit for
    them. What it says to do depends on whether the graph was optimized (:func:`_unfolded_cause`). Layers the
    fallback kept in float are left out; where no layer was quantized, the quantizer said why already
    (:func:`kiln.calibration.quantize.quantize_int8_dynamic`)."""
    if ort.get("scheme") != "dynamic" or not ort.get("integer_matmuls"):
        return
    graph = onnx.load(str(path), load_external_data=False).graph
    stored = {t.name for t in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}
    kept = set(ort.get("kept_fp32") or [])
    layers = [n for n in graph.node if n.op_type in ("MatMul", "Gemm") and n.name not in kept and len(n.input) > 1]
    left = [n.name for n in layers if n.input[1] not in stored and folds_to_weight(n.input[1], producer, stored)]
    if left:
        log.warning(
            "%s: %d of its %d MatMul/Gemm layers left in float (%s) reach their weights through other nodes (a "
            "Transpose of a stored weight, as an un-optimized export has it), which dynamic quantization does not "
            "quantize: %s",
            ORT_CPU,
            len(left),
            sum(n.op_type in ("MatMul", "Gemm") for n in model.graph.node),
            ", ".join(left[:4]) + (", ..." if len(left) > 4 else ""),
            _unfolded_cause(model),
        )


def _unfolded_cause(model: onnx.ModelProto) -> str:
    """Why ``model``'s weights still go through other nodes, by the record the optimizer left in it
    (:func:`~kiln.stages.optimize.api.optimize_record`): never optimized, optimized with passes rolled back (the
    optimize stage of a ``kiln run`` among them), optimized without fold_constants, or folded to its size limit."""
    record = optimize_record(model)
    if record is None:
        return "`kiln optimize` the graph first, which folds them into stored weights"
    undone = record["rolled_back"]
    if undone:
        return (
            f"the optimizer, which would fold them into stored weights, rolled back {', '.join(undone)} on this graph "
            "(it changed the outputs: the optimize stage's log and report, or `kiln optimize`'s, say how)"
        )
    if "fold_constants" not in record["passes"]:
        return "add fold_constants, which folds them into stored weights, to optimize.passes"
    return "fold_constants left them unfolded: a weight over its size_threshold stays (optimize.passes)"


def build_ort_cpu_int8(src: Source, out: Path, ccfg: CalibrationConfig, keep_float: set[str]) -> dict[str, Any]:
    """The INT8 graph ONNX Runtime CPU engines load instead of the symmetric Q/DQ one: its scheme and what
    was quantized. Same float-kept nodes. Static: uint8 activations, which need a calibration of their own
    (the cached ranges hold scales computed for one encoding)."""
    scheme = ort_cpu_scheme(src.model, ccfg, src.flops)
    if scheme == "dynamic":
        info = quantize_int8_dynamic(src.path, out, ccfg, keep_float)
        kept = ("integer_matmuls", "integer_lstms", "reduce_range")
        return {"scheme": scheme, **{k: info[k] for k in kept}}
    ort_cfg = ccfg.model_copy(update={"activation_type": "uint8", "symmetric_activations": False})
    info = quantize_int8(src.path, out, src.ranges(ccfg.method, ort_cfg), ort_cfg, keep_float)
    return {"scheme": scheme, "qdq_nodes": info["qdq_nodes"], "reduce_range": info["reduce_range"]}


def _kept_before_fallback(model: onnx.ModelProto, ccfg: CalibrationConfig, ranges: Ranges) -> dict[str, str]:
    """Nodes a quantized variant keeps in float from the start, each with its reason: those the configuration
    excludes, and those that write or read a tensor calibration found not finite."""
    kept = {n: _exclusion_reason(model, n, ccfg) for n in excluded_nodes(model, ccfg)}
    return unbounded_nodes(model, ranges) | _phase_kept(model, ccfg) | kept


def _phase_kept(model: onnx.ModelProto, ccfg: CalibrationConfig) -> dict[str, str]:
    """The nodes calibration would quantize that compute the argument of a Sin/Cos/Tan from positions, timesteps and
    frequencies (a rotary embedding's ``inv_freq @ positions``, :func:`~.fp16_select.phase_nodes`), kept in float:
    INT8 steps such a phase by 1/127 of its largest value, a step that grows with the sequence (positions up to 1000:
    8 rad), and the periodic op turns it into an error of the same size."""
    periodic = {n.name for n in model.graph.node if n.op_type in PERIODIC_OPS}
    if not periodic:
        return {}
    ops = set(quantizable_op_types(ccfg))
    types = {n.name: n.op_type for n in model.graph.node}
    why = "computes the phase of a Sin/Cos: INT8 would step it by 1/127 of its largest value, an error Sin/Cos keep"
    return {name: why for name in phase_nodes(model, periodic) if types.get(name) in ops}


def _exclusion_reason(model: onnx.ModelProto, name: str, ccfg: CalibrationConfig) -> str:
    if name in ccfg.exclude_nodes:
        return "listed in calibration.exclude_nodes"
    op = next((n.op_type for n in model.graph.node if n.name == name), "?")
    if op in ccfg.exclude_op_types:
        return f"{op} in calibration.exclude_op_types"
    if name in first_last_compute(model) and ccfg.exclude_first_last:
        return "first/last compute layer (calibration.exclude_first_last)"
    return "writes a graph output (calibration.keep_output_layers)"


def build_fp8(
    src: Source, out: Path, ccfg: CalibrationConfig, fallback: FallbackConfig, x_val: Samples | GateCheck
) -> dict[str, Any]:
    """FP8 (E4M3) Q/DQ graph at ``out`` for TensorRT, max-calibrated (:func:`kiln.calibration.quantize.quantize_fp8`),
    judged and fallen back like INT8's, compute nodes inside control-flow bodies as INT8's (:func:`unreached`)."""
    inside = unreached(src.model, quantizable_op_types(ccfg), "fp8")
    ranges = src.ranges("minmax", ccfg)  # max calibration: each activation's scale from its largest magnitude
    base = _kept_before_fallback(src.model, ccfg, ranges)
    info: dict[str, Any] = {}

    def build(extra: set[str]) -> Path:
        info.update(quantize_fp8(src.path, out, ranges, ccfg, extra | set(base)))
        return out

    ops = set(quantizable_op_types(ccfg))
    candidates = {n.name for n in src.model.graph.node if n.op_type in ops} - set(base)
    res = _in_precision(run_fallback(build, as_check(src, x_val), "fp8", fallback, candidates, "fp8"), out, "fp8")
    calibration = {"method": "minmax", "cache_key": ranges.key, "cache_hit": ranges.cache_hit}
    calibration |= {"batches": len(src.batches), "qdq_nodes": info.get("qdq_nodes"), "opset": info.get("opset")}
    return _entry(out, base | res.kept, res, {"calibration": calibration, **({"unreached": inside} if inside else {})})


# the failure of a graph in which calibration quantized no compute node: no fallback round kept one in float
QUANTIZED_NOTHING = "calibration quantized no compute node"


def _in_precision(res: FallbackResult, path: Path, precision: str, held: bool = False) -> FallbackResult:
    """A passing graph with no compute node left in ``precision`` is no variant of it: marked as failing. Where no
    node was kept in float beyond the start (``held``: nodes of another graph's fallback held from the start), the
    round-0 graph had none in ``precision`` either: calibration quantized nothing, which no gate decided."""
    if res.passed and not compute_precisions(path)[precision]:
        missed = "; ".join(res.rounds[0]["failures"]) if res.rounds and res.rounds[0]["failures"] else ""
        res.passed = False
        if not res.kept and not held:
            res.failures.append(f"{QUANTIZED_NOTHING} to {precision}, so there is no {precision} graph to check")
            return res
        res.failures.append(
            f"no compute node is left in {precision} once the gates pass" + (f" (round 0: {missed})" if missed else "")
        )
    return res


def quantized_nothing(record: dict[str, Any]) -> bool:
    """Whether a graph's fallback record (:func:`_fallback_record`) failed for :data:`QUANTIZED_NOTHING` alone."""
    return not record["passed"] and any(f.startswith(QUANTIZED_NOTHING) for f in record["failures"])


def _entry(out: Path, kept: dict[str, str], res: FallbackResult, extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "path": f"{out.parent.name}/{out.name}",
        "kept_fp32": sorted(kept),
        "reasons": dict(sorted(kept.items())),
        "vs_fp32": _vs_fp32(res),
        "fallback": _fallback_record(res),
        **extra,
    }


def _vs_fp32(res: FallbackResult) -> dict[str, Any]:
    keys = (
        "top1_agreement",
        "agreement",
        "top1_ties",
        "cosine",
        "sample_cosine",
        "max_abs_err",
        "rel_err",
        "accuracy",
        "metric",
        "samples",
    )
    return {k: res.metrics.get(k) for k in keys}


def _fallback_record(res: FallbackResult) -> dict[str, Any]:
    return {
        "passed": res.passed,
        "rounds": res.rounds,
        "nodes": sorted(res.kept),
        "failures": res.failures,
        "tried": res.tried,
        **({"timing": res.timing} if res.timing else {}),
        **({} if res.enabled else {"enabled": False}),
    }
