"""Small text helpers shared by error messages and reports."""

from __future__ import annotations

import re
from typing import Any

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def first_line(exc: BaseException, limit: int = 300) -> str:
    """The first line of an exception's message (colour codes stripped), cut at ``limit`` characters: library
    errors are often pages long, and the first line names the problem."""
    text = _ANSI.sub("", str(exc)).strip()
    return (text.splitlines() or [type(exc).__name__])[0][:limit]


def compiler_reason(exc: BaseException, limit: int = 300) -> str:
    """:func:`first_line`, and where the message goes on to quote a compiler's output (Inductor's
    ``CppCompileError: C++ compile error`` says no more on its first line), the output's first ``error`` line."""
    head = first_line(exc, limit)
    lines = _ANSI.sub("", str(exc)).strip().splitlines()[1:]
    cause = next((line.strip() for line in lines if "error" in line.lower() and line.strip() != head), None)
    return f"{head} ({cause[:limit]})" if cause else head


def short_reason(exc: BaseException | str, limit: int = 400) -> str:
    """The part of an error worth a log line: ORT's "[ONNXRuntimeError] : 1 : FAIL :" prefix and the C++ places it
    quotes (:func:`drop_cpp_places`) dropped, one line, and when still too long its head and its tail (nested ORT
    errors put the actual type error last)."""
    text = drop_cpp_places(" ".join(str(exc).split()))
    text = _ORT_PREFIX.sub("", text)
    if len(text) <= limit:
        return text
    head = limit // 3
    return f"{text[:head]} ... {text[-(limit - head - 5) :]}"


def ort_reason(exc: BaseException | str, limit: int = 300) -> str:
    """:func:`first_line` of an ONNX Runtime error without its ``[ONNXRuntimeError] : 1 : FAIL :`` prefix and the
    C++ places it quotes (:func:`drop_cpp_places`): a kernel's file, line and signature come before its reason and
    often fill the limit (``.../gather_elements.cc:150 void onnxruntime::core_impl(const Tensor*, ...) [with Tin =
    long int]``), cutting off what failed (``GatherElements op: Out of range value in index tensor``)."""
    text = drop_cpp_places(_ORT_PREFIX.sub("", _ANSI.sub("", str(exc)).strip()))
    fallback = type(exc).__name__ if isinstance(exc, BaseException) else ""
    return (text.splitlines() or [fallback])[0][:limit]


_ORT_PREFIX = re.compile(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ")
# A C++ source place as ONNX Runtime's messages quote it, "/onnxruntime_src/.../reshape_helper.h:91 ", and the
# signature of the function there that may follow it
_CPP_PLACE = re.compile(r"(?<!\S)\S+\.(?:cc|cpp|cxx|c|h|hpp|cu|cuh):\d+ ")
_CPP_NAME = re.compile(r"[\w:<>,*&~ ]*\w(?:<[^()]*>)?")


def drop_cpp_places(text: str) -> str:
    """``text`` without the C++ places ONNX Runtime quotes in its errors: each source ``file:line`` and the function
    signature after it (``onnxruntime::ReshapeHelper::ReshapeHelper(const onnxruntime::TensorShape&, ...)``, with
    its ``const`` and ``[with T = float]``), which say where in ONNX Runtime's code, not what, failed."""
    out: list[str] = []
    start = 0
    for place in _CPP_PLACE.finditer(text):
        if place.start() < start:
            continue
        out.append(text[start : place.start()])
        start = _signature_end(text, place.end())
    return "".join(out) + text[start:]


def _signature_end(text: str, at: int) -> int:
    """Where the C++ function signature that starts at ``at`` (a return type and qualified name, its parameters in
    brackets, ``const``, ``[with ...]``) ends, with the space after it; ``at`` where none starts there."""
    name = _CPP_NAME.match(text, at)
    if name is None or "::" not in name.group() or not text.startswith("(", name.end()):
        return at
    depth, end = 0, name.end()
    for end in range(name.end(), len(text)):
        depth += {"(": 1, ")": -1}.get(text[end], 0)
        if depth == 0:
            break
    else:
        return at  # unbalanced: no signature to drop
    rest = re.match(r"\)(?: const)?(?: \[with [^\]]*\])? ?", text[end:])
    return end + (rest.end() if rest else 1)


def root_cause(exc: BaseException) -> BaseException:
    """The innermost ``__cause__``: wrappers (the dynamo exporter, ORT's Python layer) hide the real error."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return exc


def fmt(value: Any, spec: str = ".4f") -> str:
    """A number for a report table, ``-`` when absent."""
    return "-" if value is None else format(value, spec)


# Output names that say "features, not class scores" (Hugging Face's ModelOutput keys: last_hidden_state,
# pooler_output, image_embeds, ...): the argmax of a hidden vector is no class, and its top-1 agreement would fail
# INT8 and FP16 engines that agree with the model everywhere that matters (cosine, error). Here, torch-free, so
# that report.md is written in a run that loads no torch.
FEATURE_NAMES = re.compile(r"hidden_state|embed|pooler|feature", re.IGNORECASE)
