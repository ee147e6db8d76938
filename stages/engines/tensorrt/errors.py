"""TensorRT's log routed to Python logging, and parser errors turned into BuildErrors that name the node.

The parser reports which ONNX node failed (name, op, description); we add a hint for the failures users hit
most. Nothing falls back silently: a node TensorRT cannot import fails the build with that node named.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import logging
import os
import re
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

from kiln.core.errors import BuildError

log = logging.getLogger("kiln.build")  # the stage's own logger: its warnings are said once a run

# (substring of the op or message, hint); the first match wins.
PARSER_HINTS: list[tuple[str, str]] = [
    (
        "type UInt8",
        "TensorRT takes uint8 only into a cast: convert the input to float first thing in forward "
        "(x.float() before permute/reshape), or feed float32; the onnxruntime backend runs the graph as it is",
    ),
    ("build-time constant", "run the optimize stage (fold_constants) so shape/axes inputs become constants"),
    (
        "DequantizeLinear",
        "TensorRT takes INT8/FP8 Q/DQ on activations and weights only; keep biases FP32 "
        "(onnxruntime quantize_static extra_options QuantizeBias=False) and use symmetric scales",
    ),
    (
        "QuantizeLinear",
        "TensorRT needs symmetric quantization (zero point 0): onnxruntime.quantization's "
        "ActivationSymmetric/WeightSymmetric; a QAT model's qconfig with qscheme=torch.per_tensor_symmetric (or "
        "per_channel_symmetric) and dtype=torch.qint8",
    ),
    (
        "No importer registered",
        "TensorRT has no importer for this op: rewrite it in the optimize stage, export "
        "with another opset, or use the onnxruntime backend for this model",
    ),
    ("opset", "export with another opset (export.opset: 17 or 18)"),
]
DEFAULT_HINT = "try the optimize stage's passes or another export.opset; the onnxruntime backend still builds"
# A scatter that sums (or takes the max) into its data: how a hand-written graph neural network aggregates messages
# (index_add_, scatter_add_, scatter_reduce). TensorRT imports only plain (overwriting) scatters, and no graph
# rewrite or opset turns a reduction into one.
SCATTER_OPS = ("ScatterND", "ScatterElements")
SCATTER_HINT = (
    "this TensorRT supports no scatter with a reduction (index_add_, scatter_add_, scatter_reduce): aggregate with "
    "a matmul by a dense or sparse adjacency matrix instead, or serve the onnxruntime backend's engine, which runs it"
)
# A parser that imports an op through a plugin its TensorRT build lacks (TensorRT-RTX's NonZero): "NonZero plugin
# creator version 1 was not found in plugin registry", or onnx-tensorrt's "Plugin not found, are the plugin name,
# version, and namespace correct?". No graph pass or opset removes an op the model computes with.
PLUGIN_MISSING = re.compile(r"(?:(\w+) plugin creator version \S+ was not found in plugin registry|Plugin not found)")
# How a PyTorch model computes without the op, where Kiln knows one
WITHOUT_OP = {
    "NonZero": "a dense or masked computation instead of torch.nonzero, boolean-mask indexing or one-argument "
    "torch.where; a mixture of experts: every expert on every token, weighted by the router's mask",
}


def plugin_hint(op: str, name: str) -> str:
    """The fix for an ``op`` node that TensorRT's parser imports as a plugin (``name``, where the message gives it)
    that this TensorRT build lacks: the model computed without the op, or another backend."""
    what = op or "the op"
    plugin = f"the {name} plugin" if name and name != op else "a plugin"
    how = f" ({WITHOUT_OP[op]})" if op in WITHOUT_OP else ""
    return (
        f"TensorRT's ONNX parser imports {what} as {plugin} this TensorRT build lacks: compute the model without "
        f"{what}{how}, or use the onnxruntime backend, which runs it"
    )


def KilnTrtLogger(trt: ModuleType) -> Any:  # noqa: N802 - a factory standing in for a class
    """An ``ILogger`` for this TensorRT module that logs through ``logging`` and keeps recent errors."""
    return _logger_class(trt)()


@functools.cache
def _logger_class(trt: ModuleType) -> type:
    """One class per TensorRT module (tensorrt, tensorrt_rtx), not one per logger: a class is cyclic garbage."""

    class _Logger(trt.ILogger):
        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self.errors: list[str] = []

        def log(self, severity: Any, msg: str) -> None:
            if severity in (trt.ILogger.INTERNAL_ERROR, trt.ILogger.ERROR):
                self.errors.append(msg)
                log.debug("%s", msg)  # surfaced in the BuildError; the CLI shows no raw library log
            elif severity == trt.ILogger.WARNING:
                log.info("%s", msg)
            else:
                log.debug("%s", msg)

        def last_errors(self, n: int = 3) -> str:
            useful = [e for e in self.errors if "cudaError 35" not in e and "CUDA driver" not in e] or self.errors
            return " | ".join(one_line(e) for e in useful[-n:]) or "(no error message from TensorRT)"

    return _Logger


_gc_lock = threading.RLock()
_gc_pauses = 0
_gc_was_enabled = True
_gc_holds = 0  # open gc_pause_held blocks
_gc_hold_taken = False  # whether they hold a pause (taken by the first build inside them)


@contextmanager
def gc_paused_for_tensorrt() -> Iterator[None]:
    """Keep Python's cyclic garbage collector out of TensorRT's logger callbacks.

    TensorRT calls the logger while holding its own mutex. If the collector runs inside that callback (any
    allocation can start it) and frees an unreachable builder from an earlier build (one kept in a reference
    cycle, e.g. by a traceback), the builder's destructor takes the same mutex and the process hangs for good:
    seen with TensorRT-RTX 1.7 in ``trt.Builder(logger)`` (a second builder, whose creation logs a warning).
    So the collector is off while any TensorRT build or load runs in this process (a count, since builds
    may run in threads), and garbage is collected when none is running, when no TensorRT lock can be held.
    Reference counting frees everything that is not in a cycle as usual. Inside :func:`gc_pause_held`, the first
    pause lasts until that block ends, so its later builds start without a collection of their own."""
    global _gc_hold_taken
    with _gc_lock:
        _start_pause()
        if _gc_holds and not _gc_hold_taken:
            _start_pause()  # the block's own pause, ended when the block ends
            _gc_hold_taken = True
    try:
        yield
    finally:
        _end_pause()


@contextmanager
def gc_pause_held() -> Iterator[None]:
    """Hold the collector's pause from the first TensorRT build in the block to the block's end.

    A full collection is slow in a process that has loaded torch (it visits every tracked object); a stage that
    builds several engines one after another pays it once, not once a build. The collector stays off between those
    builds too (other work in the block runs without cyclic collection until it ends), so no collection can start
    inside a later build's logger callback; garbage is collected when the first build starts, as
    :func:`gc_paused_for_tensorrt` does. A block that builds no TensorRT engine collects nothing."""
    global _gc_holds, _gc_hold_taken
    with _gc_lock:
        _gc_holds += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_holds -= 1
            release = _gc_holds == 0 and _gc_hold_taken
            if release:
                _gc_hold_taken = False
                _end_pause()


def _start_pause() -> None:
    """Count one more pause; the first collects the garbage and turns the collector off."""
    global _gc_pauses, _gc_was_enabled
    with _gc_lock:
        if _gc_pauses == 0:
            _gc_was_enabled = gc.isenabled()
            gc.collect()
            gc.disable()
        _gc_pauses += 1


def _end_pause() -> None:
    """Count one pause less; the last turns the collector back on if it was on when the first began."""
    global _gc_pauses
    with _gc_lock:
        _gc_pauses -= 1
        if _gc_pauses == 0 and _gc_was_enabled:
            gc.enable()


_stdout_lock = threading.Lock()
_stdout_redirects = 0
_saved_stdout: int | None = None


@contextmanager
def native_stdout_to_stderr() -> Iterator[None]:
    """Send what native code writes to file descriptor 1 to descriptor 2 while the block runs.

    TensorRT-RTX prints some warnings of its own with C's stdio rather than through the logger (``WARNING: in op
    ..., operand ... requires precision-lose casting``), which would mix log lines into a command's results on
    stdout. Python's and C's buffers are flushed before descriptor 1 moves and again before it comes back, so each
    line lands where it was written for. A count, like :func:`gc_paused_for_tensorrt`: builds in several threads
    redirect once and restore once, when the last ends."""
    global _stdout_redirects, _saved_stdout
    with _stdout_lock:
        if _stdout_redirects == 0:
            _flush_stdout()
            _saved_stdout = os.dup(1)
            os.dup2(2, 1)
        _stdout_redirects += 1
    try:
        yield
    finally:
        with _stdout_lock:
            _stdout_redirects -= 1
            if _stdout_redirects == 0 and _saved_stdout is not None:
                _flush_stdout()
                os.dup2(_saved_stdout, 1)
                os.close(_saved_stdout)
                _saved_stdout = None


def _flush_stdout() -> None:
    """Flush Python's ``sys.stdout`` and every C stdio stream (``fflush(NULL)``), where libc can be reached."""
    sys.stdout.flush()
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):  # no C library to reach (not a POSIX build): Python's own buffer is all
        pass


def parse_onnx(trt: ModuleType, network: Any, logger: Any, onnx_path: Path) -> Any:
    parser = trt.OnnxParser(network, logger)
    # parse_from_file resolves external-data files relative to the model, which parse(bytes) cannot.
    if parser.parse_from_file(str(onnx_path)):
        return parser
    errors = [parser.get_error(i) for i in range(parser.num_errors)]
    raise parser_error(errors, onnx_path)


def parser_error(errors: list[Any], onnx_path: Path) -> BuildError:
    if not errors:
        return BuildError(f"TensorRT's ONNX parser rejected {onnx_path.name} without saying why", hint=DEFAULT_HINT)
    first = errors[0]
    desc = _call(first, "desc")
    where, op = _where(first, onnx_path)
    hint = parser_hint(op, desc)
    more = f" (+{len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return BuildError(
        f"TensorRT's ONNX parser failed at {where} in {onnx_path.name}: {one_line(desc)}{more}", hint=hint
    )


# TensorRT's messages end in where its source raised them: "[checkMacros.cpp::catchCudaError::272]"
_SOURCE_MARK = re.compile(r"\[\w+\.(?:cpp|cu|h)::[^\]]*\]?")


def one_line(text: str, limit: int = 300) -> str:
    """A TensorRT message as one line of at most ``limit`` characters, cut at a word with "...": an error line
    holds no line break, nor the source location TensorRT appends (cut mid-name, it reads as garbage)."""
    flat = " ".join(_SOURCE_MARK.sub(" ", text).split())
    if len(flat) <= limit:
        return flat
    return flat[:limit].rsplit(" ", 1)[0] + " ..."


def parser_hint(op: str, desc: str) -> str:
    """The fix for the parser's failure at an ``op`` node saying ``desc``: a scatter with a reduction has its own
    (:data:`SCATTER_HINT`), as has an op whose plugin this TensorRT lacks (:func:`plugin_hint`), else the first of
    :data:`PARSER_HINTS` the op or message names, else the default."""
    if op in SCATTER_OPS and "reduction" in desc.lower():
        return SCATTER_HINT
    if missing := PLUGIN_MISSING.search(desc):
        return plugin_hint(op, missing.group(1) or "")
    text = f"{op} {desc}"
    return next((h for key, h in PARSER_HINTS if key in text), DEFAULT_HINT)


def _where(error: Any, onnx_path: Path) -> tuple[str, str]:
    """The failing node as the message names it, and its op. An error the parser raises inside an op's importer
    before it knows the node (a ScatterElements reduction it lacks) carries node index -1 and no name; its importer
    (``importScatterElements``) still names the op, and the graph's nodes of that op are the candidates."""
    node, op = _call(error, "node_name"), _call(error, "node_operator")
    if node or op:
        return f"node '{node}' (op {op})", op
    func = _call(error, "func")
    op = func.removeprefix("import") if func.startswith("import") and len(func) > len("import") else ""
    names = _nodes_of(onnx_path, op) if op else []
    if names:
        others = f", or one of {len(names) - 1} more of that op" if len(names) > 1 else ""
        return f"node '{names[0]}' (op {op}{others})", op
    index = _call(error, "node")
    return (f"node #{index}" if index.isdigit() else f"an op it does not name{f' ({op})' if op else ''}"), op


def _nodes_of(onnx_path: Path, op: str) -> list[str]:
    """Names of the graph's nodes (subgraphs included) of type ``op``; empty when the file cannot be read."""
    import onnx

    try:
        model = onnx.load(str(onnx_path), load_external_data=False)
    except Exception:  # the parser read it; a second reader failing must not hide the parser's own error
        return []
    found: list[str] = []

    def walk(graph: Any) -> None:
        for n in graph.node:
            if n.op_type == op:
                found.append(n.name or n.output[0])
            for attr in n.attribute:
                for sub in [attr.g] if attr.HasField("g") else list(attr.graphs):
                    walk(sub)

    walk(model.graph)
    return found


def _call(obj: Any, name: str) -> str:
    fn = getattr(obj, name, None)
    try:
        return str(fn()) if callable(fn) else ""
    except Exception:  # older parsers lack some accessors; the message must still be built
        return ""
