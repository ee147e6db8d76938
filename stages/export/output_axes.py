"""Which output axes follow a dynamic input axis, found by running the exported graph, and named in it.

torch.export traces one example: an output whose length follows a dynamic input axis through an op it does not
see through (an RNN's steps, a loop) is declared with the example's size (``[batch, 48, 192]``) although the graph
computes any size. Everything after the export reads the declared shapes (engine metadata, the Triton config, the
server), so a fixed size there breaks serving at every other length. Running the graph at two sizes of each named
axis shows which output axes follow it; they get the axis's name (or a name of their own when they change with it
but not equal to it). An output axis the exporter declared as an expression over the named axes (``16*frames``,
``frames + 1``, as torch.export writes a length an upsampler or a concatenation makes) keeps it where the probe
measures the sizes it gives: the name says how the length follows the input. No library answers this: shape
inference reads the same declarations.
"""

from __future__ import annotations

import ast
import logging
import operator
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from kiln.core.errors import ModelError
from kiln.core.onnx_io import infer_shapes, load_onnx, ort_run, ort_session, save_onnx
from kiln.core.text import first_line

log = logging.getLogger("kiln.export")

Axes = Mapping[str, Mapping[int, str]]  # input name -> {axis: name}


def resized(feed: dict[str, np.ndarray], axes: Axes, name: str, size: int) -> dict[str, np.ndarray]:
    """``feed`` with every input axis called ``name`` at ``size``: rows repeated or cut (real values stay real)."""
    out = dict(feed)
    for inp, dims in axes.items():
        for axis, label in dims.items():
            if label == name and inp in out:
                have = out[inp].shape[int(axis)]
                out[inp] = np.take(out[inp], np.arange(size) % have, axis=int(axis))
    return out


# The operators of an axis expression torch.export writes (sympy's printing of a size): nothing else is evaluated
_OPERATORS: dict[type[ast.AST], Callable[[int, int], int]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
}


def axis_expression(text: str, sizes: Mapping[str, int]) -> int | None:
    """The value of ``text``, an expression of axis names, integers, ``+ - * //`` and parentheses (``16*frames``,
    ``(((frames - 3)//2)) + 1``), with each name at its size in ``sizes``; None where it is anything else (an
    exporter's own symbol ``s0``, a function call) or divides by zero. Parsed, never run: the text comes from a
    file."""
    try:
        return _value(ast.parse(text.strip(), mode="eval").body, sizes)
    except (SyntaxError, ValueError, RecursionError, ZeroDivisionError):
        return None


def _value(node: ast.AST, sizes: Mapping[str, int]) -> int | None:
    """One node of :func:`axis_expression`'s tree, or None where it is not of its grammar."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.Name):
        return sizes.get(node.id)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = _value(node.operand, sizes)
        return None if inner is None else -inner
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _value(node.left, sizes), _value(node.right, sizes)
        return None if left is None or right is None else _OPERATORS[type(node.op)](left, right)
    return None


def _sizes_of(feed: dict[str, np.ndarray], axes: Axes) -> dict[str, int]:
    """Each named axis -> its size in ``feed`` (the first input that has it)."""
    sizes: dict[str, int] = {}
    for inp, dims in axes.items():
        for axis, label in dims.items():
            if inp in feed:
                sizes.setdefault(label, feed[inp].shape[int(axis)])
    return sizes


def _declared_fits(declared: Any, before: dict[str, int], name: str, other: int, measured: tuple[int, int]) -> bool:
    """Whether ``declared``, an output axis's dim_param, is an expression over the named axes that gives the sizes
    ``measured`` at ``before`` and with ``name`` at ``other``."""
    if not isinstance(declared, str) or not declared:
        return False
    after = axis_expression(declared, {**before, name: other})
    return after is not None and (axis_expression(declared, before), after) == measured


def probe(
    path: Path,
    feed: dict[str, np.ndarray],
    axes: Axes,
    session: Any = None,
    declared: Mapping[str, Sequence[Any]] | None = None,
) -> tuple[dict[str, dict[int, str]], dict[str, dict[int, set[str]]]]:
    """(output -> {axis: name} for each output axis whose size changes with a named input axis: its ``declared``
    expression over the named axes where that gives the sizes measured (``16*frames``), else the axis's name where
    it equals that axis's size at both sizes, else ``<output>_<axis>``; output -> {axis: the names whose change left
    it as it was}). ``declared``: output -> its dims as the graph declares them (default: as the session reads
    them)."""
    sess = session if session is not None else ort_session(path)
    names = [o.name for o in sess.get_outputs()]
    declared = declared if declared is not None else {o.name: o.shape for o in sess.get_outputs()}
    try:
        base = [o.shape for o in ort_run(sess, feed)]
    except Exception as exc:  # ONNX Runtime's own error on the data's rows: said, not a traceback
        raise ModelError(
            f"{path.name} does not run in ONNX Runtime on the data's first rows "
            f"({', '.join(f'{k} {list(v.shape)}' for k, v in feed.items())}): {first_line(exc)}",
            hint=f"make {path.name} run in onnxruntime.InferenceSession on rows of the data (the node named above), "
            "or give the PyTorch model (model.name) without model.onnx for Kiln to export",
        ) from None
    before = _sizes_of(feed, axes)
    found: dict[str, dict[int, str]] = {}
    stays: dict[str, dict[int, set[str]]] = {}
    for name in sorted({label for dims in axes.values() for label in dims.values()}):
        size = before[name]
        other = size // 2 if size >= 2 else 2
        try:
            shapes = [o.shape for o in ort_run(sess, resized(feed, axes, name, other))]
        except Exception as exc:  # noqa: BLE001 - a size the model refuses says nothing about its outputs
            log.info("output axes: the graph does not run with %s=%d (%s); not probed", name, other, exc)
            continue
        for out, a, b in zip(names, base, shapes):
            for i, (x, y) in enumerate(zip(a, b)):
                if x == y:
                    stays.setdefault(out, {}).setdefault(i, set()).add(name)
                elif i not in found.get(out, {}):
                    dims = list(declared.get(out) or [])
                    given = dims[i] if i < len(dims) else None
                    if not _declared_fits(given, before, name, other, (x, y)):
                        given = name if (x, y) == (size, other) else f"{out}_{i}"
                    found.setdefault(out, {})[i] = str(given)
    return found, stays


def name_output_axes(
    path: Path, feed: dict[str, np.ndarray], axes: Axes, session: Any = None
) -> dict[str, dict[int, str]]:
    """Declare, in the graph at ``path``, the output axes that follow a dynamic input axis but were exported with a
    fixed size or a symbol of the exporter's own: output -> {axis: name} of those declared (the graph is rewritten
    only if there are any). ``session``: one already open on ``path`` (the export's parity check has one)."""
    model = load_onnx(path, load_external_data=False)
    if _batch_only(model, axes):
        return {}
    found, stays = probe(path, feed, axes, session, _declared_dims(model))
    model = load_onnx(path)
    known = {label for dims in axes.values() for label in dims.values()}
    fixed: dict[str, dict[int, str]] = {}
    for out in model.graph.output:
        dims = out.type.tensor_type.shape.dim if out.type.HasField("tensor_type") else []
        for i, dim in enumerate(dims):
            name = found.get(out.name, {}).get(i)
            stayed = stays.get(out.name, {}).get(i, set())
            if name is not None and dim.dim_param != name and (dim.dim_param not in known or dim.dim_param in stayed):
                # a fixed size, or a symbol of the exporter's own (s0, unk__3), on an axis that follows one; or an
                # input axis's name on an axis that stays when it moves (the TorchScript exporter's batch on every
                # output's first axis, a time-major [T, B, C]'s steps included)
                pass
            elif name is None and dim.dim_param in stayed:
                name = f"{out.name}_{i}"  # declared as following an axis it does not follow (a CLIP's texts)
            else:
                continue
            dim.Clear()
            dim.dim_param = name
            fixed.setdefault(out.name, {})[i] = name
    if fixed:
        # Intermediate shapes recorded from the traced example hold the old sizes: inferred again from the inputs
        save_onnx(runnable_inferred(infer_shapes(model, strict=False), feed, path.name), path)
        log.info(
            "the export fixed output axes that follow a dynamic input axis; declared dynamic: %s",
            "; ".join(f"{o} axis {i} = {n}" for o, d in fixed.items() for i, n in d.items()),
        )
    return fixed


def runnable_inferred(inferred: onnx.ModelProto, feed: dict[str, np.ndarray] | None, shown: str) -> onnx.ModelProto:
    """``inferred`` (a graph with ONNX's inferred value_info), without that value_info where ONNX Runtime fails on it
    with ``feed`` but runs it without: ORT trusts recorded shapes, and ONNX infers some wrong (a SequenceAt of a
    SplitToSequence with keepdims=0, a rank too many), so a file that runs as it came would fail inside Kiln. Where
    both fail, or ``feed`` is None, ``inferred`` is kept: the stages that run it say why. Changed in place."""
    if feed is None or not inferred.graph.value_info or _runs(inferred, feed):
        return inferred
    recorded = list(inferred.graph.value_info)
    del inferred.graph.value_info[:]
    if not _runs(inferred, feed):
        inferred.graph.value_info.extend(recorded)
        return inferred
    log.info(
        "%s: kept without ONNX's inferred shapes of intermediate values, with which ONNX Runtime fails where it runs "
        "the graph without them",
        shown,
    )
    return inferred


def _runs(model: onnx.ModelProto | Path, feed: dict[str, np.ndarray]) -> bool:
    """Whether ONNX Runtime opens ``model`` and runs it on ``feed``."""
    try:
        ort_run(ort_session(model), feed)
    except Exception:  # noqa: BLE001 - any failure of ORT's is a no
        return False
    return True


def _declared_dims(model: onnx.ModelProto) -> dict[str, list[int | str]]:
    """Output -> its dims as the graph declares them: a dim_param, else a dim_value (0: unknown)."""
    return {
        o.name: [d.dim_param or d.dim_value for d in o.type.tensor_type.shape.dim]
        for o in model.graph.output
        if o.type.HasField("tensor_type")
    }


def _batch_only(model: onnx.ModelProto, axes: Axes) -> bool:
    """Nothing to probe: the batch is the only dynamic axis (one name, on the first axis of each input that has
    it: ``batch`` in Kiln's export, the file's own in a taken graph), and every output declares its first axis
    dynamic (the exporters name the batch on their own; a probe of a big model costs an ONNX Runtime session and
    two runs)."""
    labels = {label for dims in axes.values() for label in dims.values()}
    if len(labels) > 1 or any(int(axis) != 0 for dims in axes.values() for axis in dims):
        return False
    dims = [o.type.tensor_type.shape.dim for o in model.graph.output if o.type.HasField("tensor_type")]
    return all(d and d[0].dim_param for d in dims)
