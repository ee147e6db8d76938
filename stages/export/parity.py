"""Parity of the exported graph with PyTorch: ONNX Runtime against the model on the same rows, each output held to
``atol + rtol *`` the value its error is on; the batch check, which tells a graph that holds its traced batch from
one that is merely inexact; the error that says which it is and what to change; and the check of outputs that order
by value on inputs grown without ties. The size checks and the step probe are built on these. A graph that
quantizes (QuantizeLinear) is allowed one quantization step more at each output it feeds (:func:`quantization_steps`).
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx_graphsurgeon as gs
import torch
from torch import nn

from kiln.core.compare import masks_of, max_abs_err, value_ordered
from kiln.core.data import Feed, Inputs, as_feed, from_feed, rows, take
from kiln.core.errors import KilnError, ModelError
from kiln.core.labels import is_mask_name, is_padding_mask_name, without_padding
from kiln.core.onnx_io import load_onnx, ort_run, ort_session
from kiln.core.outputs import named_outputs
from kiln.core.shapes import Axes, resize
from kiln.core.text import short_reason
from kiln.stages.export.pinned_sizes import BATCH_FIXED_HINT, FIXED_SIZE_HINT, batch_pinned_at
from kiln.stages.export.torch_export import error_reason, fallback_failed

log = logging.getLogger("kiln.export")

# Rows the export's parity check runs: it compares the same arithmetic in two runtimes, which a few rows show as
# well as many; accuracy over the data is validation's job.
PARITY_ROWS = 8


def parity(
    model: nn.Module,
    onnx_path: Path,
    x: Inputs,
    session: Any = None,
    at: str = "",
    ref: dict[str, np.ndarray] | None = None,
    refused: str = "",
) -> dict[str, Any]:
    """ONNX Runtime against PyTorch on ``x``: the largest abs error over every output, and per output, with the
    value each error is on (``scale``) and the quantization step each float output may differ by (``step``:
    :func:`quantization_steps`). ``session``: one already open on ``onnx_path``; ``at``: the sizes ``x`` has, for
    the messages; ``ref``: PyTorch's outputs on ``x``, where already computed; ``refused``: why the dynamo exporter
    failed, where the graph is the TorchScript exporter's (for the error on NaN)."""
    if ref is None:
        ref = torch_outputs(model, x)
    sess = session if session is not None else ort_session(onnx_path)
    _same_outputs(list(ref), [o.name for o in sess.get_outputs()], "at " + (at or f"batch {rows(x)}"), rows(x))
    feed = as_feed(x, [i.name for i in sess.get_inputs()])
    got = ort_run(sess, feed)
    # positions an attention mask marks as padding are no one's answer (kiln.core.labels.without_padding): the mask
    # on each output's own axis, by the graph's axis names (an encoder's mask is not a decoder's)
    names = lambda values: {v.name: {i: d for i, d in enumerate(v.shape) if isinstance(d, str)} for v in values}  # noqa: E731
    axes, out_axes = names(sess.get_inputs()), names(sess.get_outputs())
    ref = without_padding(feed, ref, axes, out_axes)
    answered = without_padding(feed, dict(zip(ref, got)), axes, out_axes)
    # outputs whose length the values decide (an axis 0 no input has: NMS's detections) in one order of their
    # values: ONNX Runtime's TopK orders tied scores apart from torch.topk, and Kiln's widened inputs tie them
    given = {d for dims in axes.values() for d in dims.values()}
    by_value = [o.name for o in sess.get_outputs() if o.shape and isinstance(o.shape[0], str)]
    by_value = [n for n in by_value if out_axes[n][0] not in given]
    ref, answered = value_ordered(ref, answered, by_value)
    got = [answered[n] for n in ref]
    for (name, r), g in zip(ref.items(), got):
        if g.shape != r.shape:
            raise ShapeMismatch(
                f"exported model's output '{name}' has shape {g.shape}{' at ' + at if at else ''}, PyTorch's {r.shape}",
                hint=FIXED_SIZE_HINT if at else "check the model's outputs for sizes computed outside torch",
            )
        _refuse_non_finite(name, r, g, at, onnx_path, refused)
    errs = {name: max_abs_err(r, g) for (name, r), g in zip(ref.items(), got)}
    scale = {name: _scale_at_worst(r, g) for (name, r), g in zip(ref.items(), got)}
    steps = quantization_steps(onnx_path)
    step = {name: steps[name] for name, r in ref.items() if name in steps and r.dtype.kind == "f"}
    return {
        "max_abs_err": max(errs.values()),
        "per_output": errs,
        "scale": scale,
        "step": step,
        "samples": rows(x),
        "by_value": by_value,
    }


def _scale_at_worst(ref: np.ndarray, got: np.ndarray) -> float:
    """The magnitude of an output's value where the graph's answer is furthest from it (a mask's fill and values
    that are not finite left out: :func:`kiln.core.compare.masks_of`), the size float rounding scales with there:
    the error must be explained by the value it is on, so a lone large value (a -1e9 fill, an outlier) widens the
    tolerance of no other, and a small channel beside a large one is held to its own size. 0 for an integer
    output, compared exactly."""
    if ref.dtype.kind != "f" or ref.size == 0:
        return 0.0
    r, g = np.asarray(ref, dtype=np.float64), np.asarray(got, dtype=np.float64)
    keep = np.isfinite(r) & np.isfinite(g) & ~np.isin(r, masks_of(ref).values)
    if not keep.any():
        return 0.0
    err = np.full(r.shape, -1.0)
    err[keep] = np.abs(g[keep] - r[keep])  # the kept values only: an infinity in both would be NaN, said as a warning
    return float(np.abs(r.flat[int(np.argmax(err))]))


def within_parity(
    errs: Mapping[str, float],
    scale: Mapping[str, float],
    atol: float,
    rtol: float,
    step: Mapping[str, float] | None = None,
) -> bool:
    """Whether every output's error (``errs``) is within ``atol + rtol *`` the value it is on (``scale``:
    :func:`_scale_at_worst`), plus its quantization step (``step``: :func:`quantization_steps`): float rounding
    grows with the values a graph computes, so each is held to its size."""
    return all(err <= _tolerance(name, scale, step or {}, atol, rtol) for name, err in errs.items())


def _tolerance(name: str, scale: Mapping[str, float], step: Mapping[str, float], atol: float, rtol: float) -> float:
    return atol + rtol * scale.get(name, 0.0) + step.get(name, 0.0)


def parity_passes(check: Mapping[str, Any], atol: float, rtol: float) -> bool:
    """Whether a :func:`parity` result is within ``atol`` and ``rtol`` (:func:`within_parity`)."""
    return within_parity(check["per_output"], check["scale"], atol, rtol, check.get("step"))


def quantization_steps(path: Path) -> dict[str, float]:
    """Graph output -> the step of the quantization nearest it: the largest scale of the QuantizeLinear nodes that
    feed it with no other QuantizeLinear between (a constant scale; per channel, the largest). PyTorch's fake
    quantization rounds ``x * (1 / scale)`` where ONNX's QuantizeLinear rounds ``x / scale``, so a value on a
    rounding edge lands one step apart in the two runtimes, at any of these nodes: at an output they quantize, that
    is one step of the output's own grid; past them, one step of the values the rest of the graph computes from, which
    the model itself knows to no finer step. An error of that much is the model's own resolution, not another
    function. Outputs no QuantizeLinear feeds (and graphs without one) are not listed."""
    stat = Path(path).stat()
    return dict(_steps_of(str(path), stat.st_mtime_ns, stat.st_size))


@functools.lru_cache(maxsize=8)
def _steps_of(path: str, mtime_ns: int, size: int) -> dict[str, float]:
    """:func:`quantization_steps` of the file at ``path`` as it is at ``mtime_ns`` and ``size``: read once per
    export, however many parity checks run on it."""
    model = load_onnx(path, load_external_data=False)
    if not any(n.op_type == "QuantizeLinear" for n in model.graph.node):
        return {}
    steps = {}
    for out in gs.import_onnx(model).outputs:
        nearest = [n for n in _upstream(out, _is_quantize) if _is_quantize(n)]
        scales = [_constant(n.inputs[1]) for n in nearest if len(n.inputs) > 1]
        known = [float(np.abs(s).max()) for s in scales if s is not None and s.size]
        if known:
            steps[out.name] = max(known)
    return steps


def _is_quantize(node: gs.Node) -> bool:
    return node.op == "QuantizeLinear"


def _upstream(tensor: gs.Tensor, stop: Callable[[gs.Node], bool] = lambda node: False) -> list[gs.Node]:
    """The nodes on the paths to ``tensor``, each once, walking past none that ``stop`` accepts."""
    seen: set[int] = set()
    found: list[gs.Node] = []
    stack = [tensor]
    while stack:
        for node in stack.pop().inputs:
            if id(node) not in seen:
                seen.add(id(node))
                found.append(node)
                stack.extend([] if stop(node) else node.inputs)
    return found


def _constant(tensor: gs.Tensor) -> np.ndarray | None:
    """The value of an initializer or of a Constant node's output; None for a computed tensor, or one whose data
    lies in a file not loaded."""
    producer = tensor.inputs[0] if tensor.inputs else None
    value = producer.attrs.get("value") if producer is not None and producer.op == "Constant" else tensor
    try:
        return np.asarray(value.values) if isinstance(value, gs.Constant) else None
    except Exception:  # noqa: BLE001 - external data left unread (the file is read without it)
        return None


def require_parity(check: Mapping[str, Any], atol: float, rtol: float, where: str, advice: str = "") -> None:
    """:func:`parity_error` where a :func:`parity` result is not within ``export.parity_atol`` and
    ``export.parity_rtol`` (:func:`parity_passes`)."""
    if not parity_passes(check, atol, rtol):
        raise parity_error(check, atol, where, advice, rtol)


def _same_outputs(names: list[str], exported: list[str], at: str, batch: int) -> None:
    """The model returns the outputs the graph was exported with (``names``: PyTorch's at ``at``, ``batch`` rows).
    An output that is None on some calls and a tensor on others (it depends on the batch) has no place in a graph:
    the export left it out, or kept it, as the example it traced had it. Nor has a list with one item per sample
    (:func:`_per_sample_list`)."""
    _refuse_per_sample_list(names, exported, at, batch)
    now = [f"'{n}' a tensor" for n in names if n not in exported] + [f"'{n}' None" for n in exported if n not in names]
    if now:
        raise ModelError(
            f"the model returns output {', '.join(now)} {at}, but not on the example the graph was exported with: "
            "a None output is left out of the graph, so it must be None on every call",
            hint="return each output as a tensor on every call, or as None on every call (an absent loss)",
        )


# A list item in a flattened output's name (kiln.core.outputs.flatten_outputs): ``output_<i>`` at the top, ``.<i>``
# inside a container
_LIST_ITEM = re.compile(r"(?:^output_|\.)(\d+)(?=\.|$)")


def _list_lengths(names: list[str]) -> dict[str, int]:
    """List (its path, ``*`` for its index: ``output_*``, ``detections.*``) -> how many items ``names`` hold of it."""
    items: dict[str, set[int]] = {}
    for name in names:
        for match in _LIST_ITEM.finditer(name):
            items.setdefault(name[: match.start(1)] + "*", set()).add(int(match.group(1)))
    return {path: len(found) for path, found in items.items()}


def _per_sample_list(names: list[str], exported: list[str], batch: int) -> tuple[str, int] | None:
    """(the list's path, its length in the graph) for an output list of ``batch`` items (``names``) whose length
    in the exported graph differs: one item per sample, as torchvision's detectors return one ``{boxes, scores,
    labels}`` dict per image. None: no such list."""
    then = _list_lengths(exported)
    for path, length in _list_lengths(names).items():
        if length == batch and then.get(path, length) != length:
            return path, then[path]
    return None


def _refuse_per_sample_list(names: list[str], exported: list[str], at: str, batch: int) -> None:
    """A ModelError for an output list whose length follows the batch (:func:`_per_sample_list`): a graph's outputs
    are a fixed set, so it holds as many items as the example it traced had samples."""
    found = _per_sample_list(names, exported, batch)
    if found is None:
        return
    path, traced = found
    raise ModelError(
        f"the model returns a list of outputs whose length follows the batch ({path.replace('*', '<i>')}: {batch} "
        f"items {at}, {traced} on the example the graph was exported with), which is not supported: a graph has a "
        "fixed number of outputs",
        hint="return flat tensors over the whole batch, each row with the index of the sample it belongs to: e.g. "
        "detections as boxes [K, 4], scores [K], labels [K] and an image index [K]",
    )


class ShapeMismatch(ModelError):
    """An output of the exported graph has another shape than PyTorch's: at a size other than the traced one, the
    sign of a size the export fixed (:func:`batch_parity` tells it from other parity errors)."""


def torch_outputs(model: nn.Module, x: Inputs) -> dict[str, np.ndarray]:
    with torch.no_grad():
        return {k: v.numpy() for k, v in named_outputs(model, x).items()}


def _refuse_non_finite(
    name: str, ref: np.ndarray, got: np.ndarray, at: str = "", path: Path | None = None, refused: str = ""
) -> None:
    """NaN or infinity in the graph's answer where PyTorch's is finite is its own error, named with the samples it
    hits: as an error size it would read as NaN, which no tolerance catches and no other cause explains. The fix
    follows the ops on the way to the output in the graph at ``path`` (:func:`_non_finite_hint`); ``refused``: why
    the dynamo exporter failed, where the graph is the TorchScript exporter's."""
    if got.dtype.kind != "f" or got.ndim == 0 or got.size == 0:
        return
    bad = ~np.isfinite(got) & np.isfinite(ref)
    hit = np.flatnonzero(bad.reshape(len(bad), -1).any(axis=1))
    if hit.size:
        message = (
            f"the exported graph answers {hit.size} of {len(bad)} samples with NaN or infinity in output '{name}'"
            f"{' at ' + at if at else ''} where PyTorch's are finite (sample {hit[0]} first)"
        )
        makers = _non_finite_makers(path, name) if path is not None else None
        if makers is None:  # a Softmax on the way (or the graph unread): the attention case
            raise ModelError(message, hint=ATTENTION_NAN_HINT)
        hint = _non_finite_hint(makers)
        if refused:  # the fallback's graph: what made the dynamo exporter fail is what to change
            fallback = fallback_failed(message, refused)
            raise ModelError(fallback.message, hint=f"{hint}; {fallback.hint}")
        find = "return intermediate values as extra outputs to find the first that is NaN, and write it with other ops"
        raise ModelError(message, hint=f"{hint}; {find}")


ATTENTION_NAN_HINT = (
    "find what those samples share: a row whose attention keys are all masked is finite in PyTorch's attention and "
    "NaN in the exported Softmax; keep one key unmasked per sample, or mask those rows' outputs after the model"
)

# Ops that make NaN or infinity from finite inputs, and where
_NON_FINITE_OPS = {
    "Sqrt": "Sqrt (NaN below 0)",
    "Log": "Log (NaN below 0, -inf at 0)",
    "Div": "Div (NaN at 0 / 0, infinity at x / 0)",
    "Reciprocal": "Reciprocal (infinity at 0)",
    "Asin": "Asin (NaN outside [-1, 1])",
    "Acos": "Acos (NaN outside [-1, 1])",
    "Acosh": "Acosh (NaN below 1)",
    "Atanh": "Atanh (NaN outside [-1, 1])",
}


def _non_finite_makers(path: Path, output: str) -> list[str] | None:
    """The ops on the way to graph output ``output`` that make NaN or infinity from finite inputs, in words (a Pow
    with a constant fractional exponent by its exponent: NaN of a negative base); None where a Softmax is on the way
    (a fully masked attention row), the output is not found or the graph cannot be read."""
    try:
        graph = gs.import_onnx(load_onnx(path, load_external_data=False))
    except Exception:  # noqa: BLE001 - the hint only: the error itself stands without it
        return None
    tensor = next((t for t in graph.outputs if t.name == output), None)
    nodes = _upstream(tensor) if tensor is not None else []
    if tensor is None or any(n.op == "Softmax" for n in nodes):
        return None
    found = [_pow_in_words(n) if n.op == "Pow" else _NON_FINITE_OPS.get(n.op) for n in nodes]
    return list(dict.fromkeys(f for f in found if f))


def _pow_in_words(node: gs.Node) -> str | None:
    """A Pow in words where it can make NaN: a fractional (or computed) exponent of a negative base; None for a
    constant whole exponent."""
    exponent = _constant(node.inputs[1]) if len(node.inputs) > 1 else None
    if exponent is None or exponent.size != 1:
        return "Pow (NaN of a negative base to a fractional exponent)"
    value = float(exponent.reshape(-1)[0])
    return None if value.is_integer() else f"Pow(x, {value:.8g}) (NaN for a negative x)"


def _non_finite_hint(makers: list[str]) -> str:
    """What in the graph turns finite inputs into NaN or infinity (:func:`_non_finite_makers`), in words."""
    if not makers:
        return (
            "no op on the way to that output makes NaN from finite inputs by itself (Sqrt, Log, Div, a fractional "
            "Pow): an overflow (Exp, a large MatMul) or an op the exporter writes wrongly may"
        )
    which = "it meets" if len(makers) == 1 else "one of them meets"
    return (
        f"on the way to that output the graph holds {', '.join(makers)}: {which} an input outside its domain where "
        "PyTorch's op does not, so the exporter wrote that op otherwise than PyTorch computes it (an abs or a clamp "
        "left out)"
    )


def batch_parity(
    model: nn.Module,
    path: Path,
    example: Inputs,
    x: Inputs,
    atol: float,
    session: Any = None,
    rtol: float = 0.0,
    refused: str = "",
) -> dict[str, Any]:
    """:func:`parity` on ``x``, whose batch differs from ``example``'s, the rows the graph was traced with (the first
    rows of ``x``). A graph that fails at ``x`` (ONNX Runtime refuses it, an output of another shape, or an error
    over the tolerance, ``atol + rtol *`` the value each output's error is on, where the traced rows come out otherwise
    within ``x`` than alone) but computes ``example`` within it holds the traced batch (Swin's
    ``B = int(windows.shape[0] / n)``): a ModelError says so, and where, instead of an ONNX Runtime traceback or
    advice to raise the tolerance. Otherwise the check at ``x``, held to the tolerance by the caller; the traced
    batch runs only when ``x`` fails, so a good graph costs one run. A graph ONNX Runtime cannot run at the traced
    batch either is said so; where it is the TorchScript exporter's (``refused``: why the dynamo exporter failed),
    with that reason and its fix (:func:`fallback_failed`)."""
    at = f"batch {rows(x)}"
    try:
        ref = torch_outputs(model, x)
    except Exception as exc:  # PyTorch itself: the model takes only some batch sizes
        raise ModelError(
            f"the model fails at {at} in PyTorch: {error_reason(exc)}",
            hint="make forward take any batch size: the export's batch axis is dynamic",
        ) from None
    check, why = _parity_or_why(model, path, x, session, ref, refused)
    if check is not None and (parity_passes(check, atol, rtol) or rows(x) == rows(example)):
        return check
    traced, traced_why = (
        _parity_or_why(model, path, example, session, refused=refused) if rows(x) != rows(example) else (None, why)
    )
    # over the tolerance at x only: the batch's doing if the graph gives the traced rows other values within x than
    # alone (a graph that is merely inexact, worst on rows past the traced ones, gives them the same values)
    moved = check is None or not within_parity(
        _rows_move(path, session, example, x), check["scale"], atol, rtol, check.get("step")
    )
    if traced is not None and parity_passes(traced, atol, rtol) and moved:
        line = batch_pinned_at(model, example)
        raise ModelError(
            f"the exported graph depends on the batch size it was traced at ({at}: {why}; batch {rows(example)}: "
            f"max abs error {traced['max_abs_err']:.3g}): forward computes a size as a Python int or float from a "
            f"tensor's shape (e.g. int(x.shape[0] / n)){' in ' + line if line else ''}",
            hint=f"compute {'the size in ' + line if line else 'sizes from the batch'} {BATCH_FIXED_HINT}",
        )
    if check is None:  # not the batch's doing: the traced batch fails too, or runs off the tolerance
        failure = (
            f"ONNX Runtime cannot run the exported graph, not even at batch {rows(example)}, the batch it was traced "
            f"at: {traced_why}"
            if traced is None
            else f"ONNX Runtime cannot run the exported graph at {at}: {why}"
        )
        if refused:
            raise fallback_failed(failure, refused)
        raise ModelError(
            failure, hint="the model may use an op ONNX Runtime runs differently from PyTorch; see the message above"
        )
    return check


def empty_mask_row(feed: Feed) -> tuple[Feed, list[str]]:
    """The first row of ``feed`` with every mask over positions all padding (an empty sequence), and the masks'
    names: a ``[batch, seq]`` input named like an attention mask (all 0) or a padding mask (all True or 1,
    :func:`kiln.core.labels.is_padding_mask_name`), or any other boolean one, taken as PyTorch's
    ``key_padding_mask`` (True marks padding). The held-out rows and Kiln's random masks rarely hold such a row,
    yet a client may send one."""
    row = {name: value[:1] for name, value in feed.items()}
    masks = [n for n, v in row.items() if v.ndim == 2 and v.size and (is_mask_name(n) or v.dtype == np.bool_)]
    for name in masks:
        padding = is_padding_mask_name(name) or not is_mask_name(name)
        row[name] = (np.ones_like if padding else np.zeros_like)(row[name])
    return row, masks


def warn_empty_masks(model: nn.Module, session: Any, x: Inputs) -> None:
    """Warn where a row whose masks are all padding (:func:`empty_mask_row`) gets NaN or infinity from the exported
    graph (its ONNX Runtime ``session``) and finite outputs from PyTorch: attention over no key is finite in
    PyTorch's kernels and NaN in the exported Softmax, so an engine answers an empty sequence with NaN, which no
    parity check on real rows shows. A warning, not an error: such a request may never come; asked once the graph's
    parity is accepted (:func:`require_parity`), as a graph refused needs no further advice. One forward of one row in
    each runtime; a model or graph that refuses the row says nothing here."""
    names = [i.name for i in session.get_inputs()]
    row, masks = empty_mask_row(as_feed(take(x, slice(0, 1)), names))
    if not masks:
        return
    try:
        ref = torch_outputs(model, from_feed(row, x))
        got = dict(zip(ref, ort_run(session, row)))
    except Exception:  # noqa: BLE001 - a probe only: a model that rejects an empty row is not this warning's matter
        return
    axes = lambda values: {v.name: {i: d for i, d in enumerate(v.shape) if isinstance(d, str)} for v in values}  # noqa: E731
    ins, outs = axes(session.get_inputs()), axes(session.get_outputs())
    ref, got = without_padding(row, ref, ins, outs), without_padding(row, got, ins, outs)  # per position: unread
    bad = [n for n, r in ref.items() if _non_finite_where_torch_finite(r, got[n])]
    if bad:
        log.warning(
            "input %s: a row that is all padding (an empty sequence) gets NaN or infinity from the exported graph in "
            "output %s where PyTorch's is finite, so the engines answer such a request with NaN; fix: guard the "
            "all-padding case in forward, e.g. unmask one position of an empty row or zero the pooled output of "
            "empty rows",
            ", ".join(f"'{m}'" for m in masks),
            ", ".join(f"'{n}'" for n in bad),
        )


def _non_finite_where_torch_finite(ref: np.ndarray, got: np.ndarray) -> bool:
    """Whether a float output of the graph (``got``) holds NaN or infinity where PyTorch's (``ref``) is finite."""
    if got.dtype.kind != "f" or got.shape != ref.shape:
        return False
    return bool((~np.isfinite(got) & np.isfinite(ref)).any())


def exported_session(path: Path, refused: str = "") -> Any:
    """An ONNX Runtime session on the exported graph at ``path``; where ONNX Runtime cannot load it and it is the
    TorchScript exporter's (``refused``: why the dynamo exporter failed), the error says that and its fix
    (:func:`fallback_failed`) rather than only suggesting another opset."""
    try:
        return ort_session(path)
    except ModelError as exc:
        if not refused:
            raise
        raise fallback_failed(exc.message, refused) from None


def _rows_move(path: Path, session: Any, example: Inputs, x: Inputs) -> dict[str, float]:
    """Output -> how far the graph's outputs for ``example``'s rows, the first of ``x``, differ between a run on
    ``x`` and a run on ``example`` alone (outputs whose rows are the samples): 0 for a graph that does not depend on
    its batch."""
    sess = session if session is not None else ort_session(path)
    names = [i.name for i in sess.get_inputs()]
    whole, alone = ort_run(sess, as_feed(x, names)), ort_run(sess, as_feed(example, names))
    n = rows(example)
    outputs = [o.name for o in sess.get_outputs()]
    same = [
        (o, w, a) for o, w, a in zip(outputs, whole, alone) if w.ndim and w.shape[1:] == a.shape[1:] and len(a) == n
    ]
    return {o: max_abs_err(w[:n], a) for o, w, a in same}


def _parity_or_why(
    model: nn.Module,
    path: Path,
    x: Inputs,
    session: Any,
    ref: dict[str, np.ndarray] | None = None,
    refused: str = "",
) -> tuple[dict[str, Any] | None, str]:
    """:func:`parity` and its error in words; or None and why the graph cannot compute ``x`` (ONNX Runtime's
    error, an output of another shape). Other errors of Kiln's (NaN where PyTorch is finite) pass through."""
    try:
        check = parity(model, path, x, session, ref=ref, refused=refused)
    except ShapeMismatch as exc:
        return None, exc.message
    except KilnError:
        raise
    except Exception as exc:  # ONNX Runtime's own error: a node that takes the traced batch only
        return None, "ONNX Runtime: " + short_reason(exc, 200)
    return check, f"max abs error {check['max_abs_err']:.3g}"


def integers_over(check: Mapping[str, Any], ref: Mapping[str, np.ndarray], atol: float, rtol: float) -> list[str]:
    """The integer outputs of a :func:`parity` result past the tolerance: indices (``torch.topk``'s, an argmax),
    which pick one of equal scores as each runtime orders them."""
    per, scale = check["per_output"], check["scale"]
    return [n for n, r in ref.items() if r.dtype.kind in "iub" and not within_parity({n: per[n]}, scale, atol, rtol)]


def computes_untied(
    model: nn.Module,
    path: Path,
    session: Any,
    like: Inputs,
    feed: Feed,
    axes: Axes,
    point: Mapping[str, int],
    atol: float,
    rtol: float,
) -> bool:
    """Whether the graph computes the model at ``point`` on ``feed``'s float inputs grown by repeating their own
    values, each copy shifted so no value repeats (:func:`kiln.core.shapes.resize`, as validation grows them), where
    the size check padded them with zeros: a constant region, on which a detector's scores tie. The copies are
    shifted up, then down: a score that falls as the input rises peaks in the data's own copy one way and in a later
    copy the other, where a graph that fixed the data's size is wrong; it passes only where both agree. False where
    both grow the inputs alike, or the model or the graph fails on them."""
    padded = resize(feed, axes, point)
    for sign in (1, -1):
        grown = resize(feed, axes, point, repeat_floats=True, step_sign=sign)
        if all(np.array_equal(grown[n], padded[n]) for n in grown):
            return False
        if not _computes_on(model, path, session, from_feed(grown, like), atol, rtol):
            return False
    return True


def _computes_on(model: nn.Module, path: Path, session: Any, inputs: Inputs, atol: float, rtol: float) -> bool:
    """Whether the graph's outputs on ``inputs`` are within the tolerance of PyTorch's; False where either fails."""
    try:
        return parity_passes(parity(model, path, inputs, session, ref=torch_outputs(model, inputs)), atol, rtol)
    except Exception:  # noqa: BLE001 - the model or the graph cannot take them: no evidence the graph is right
        return False


# An error this large a share of the value it is on is no float rounding: the graph computes another
# function (an op the exporter writes wrongly, as ``scatter_reduce(reduce="mean")``, for which ONNX has no reduction)
_WRONG_SHARE = 1e-3


def parity_error(check: dict[str, Any], atol: float, where: str, advice: str = "", rtol: float = 0.0) -> ModelError:
    """The export parity failure of a :func:`parity` result: the output furthest past its tolerance (``atol + rtol
    *`` the value its error is on), its error against that value, and a fix by that size. A small share is float
    rounding (fused or reordered arithmetic in ONNX Runtime), which a wider ``export.parity_rtol`` accepts; a large
    one is a graph that computes something else, which a wider tolerance would ship."""
    worst, err, top = _worst_output(check, atol, rtol)
    share = f", {err / top:.1%} of the value there, {top:.3g}" if top else ""
    said = f"output '{worst}'{share}" if worst else "all outputs"
    step = (check.get("step") or {}).get(worst or "", 0.0)
    if step:
        hint = (
            f"{advice}the graph quantizes (QuantizeLinear) in steps of {step:.3g} on the way to '{worst}': PyTorch's "
            "fake quantization multiplies by 1/scale where ONNX's divides by scale, so a value on a rounding edge "
            f"lands one step apart, which the check allows; this error is {err / step:.1f} steps: where rounding "
            f"apart adds up over several quantized layers, raise export.parity_atol (now {atol:g}) above {err:.3g}; "
            "else the graph computes something else than the model: return intermediate values as extra outputs to "
            "find the first that differs by more than a step"
        )
    elif not top or err / top > _WRONG_SHARE:
        hint = (
            f"{advice}the graph computes something else than the model there: an op the exporter writes wrongly "
            "(scatter_reduce with reduce='mean', which ONNX lacks), draws random numbers in eval mode or depends on "
            "the batch; return "
            "intermediate values as extra outputs to find the first that differs, and write it with other ops"
        )
    else:
        hint = (
            f"{advice}float rounding differs between the runtimes: raise export.parity_rtol (now {rtol:g}) above "
            f"the error's share of the value it is on, {err / top:.2g}, or export.parity_atol (now {atol:g})"
        )
    return ModelError(
        f"the exported graph differs from PyTorch ({where}): {over_tolerance(check, atol, rtol)} ({said})", hint=hint
    )


def _worst_output(check: Mapping[str, Any], atol: float, rtol: float) -> tuple[str | None, float, float]:
    """The output of a :func:`parity` result furthest past its tolerance (``atol + rtol *`` the value its error is
    on), its error and that value; no name, the largest error and 0 where it names no outputs."""
    per, scale, step = check.get("per_output") or {}, check.get("scale") or {}, check.get("step") or {}
    if not per:
        return None, check["max_abs_err"], 0.0
    worst = max(per, key=lambda name: per[name] / max(_tolerance(name, scale, step, atol, rtol), np.finfo(float).tiny))
    return worst, per[worst], scale.get(worst, 0.0)


def over_tolerance(check: Mapping[str, Any], atol: float, rtol: float) -> str:
    """``max abs error E > export.parity_atol A + export.parity_rtol R x S`` (``+ one quantization step Q`` where
    the output has one): the worst output's error against its tolerance (:func:`_worst_output`), in words."""
    worst, err, top = _worst_output(check, atol, rtol)
    step = (check.get("step") or {}).get(worst or "", 0.0)
    plus = f" + one quantization step {step:.3g}" if step else ""
    return f"max abs error {err:.3g} > export.parity_atol {atol:g} + export.parity_rtol {rtol:g} x {top:.3g}{plus}"
