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
    """The part of an error worth a log line: ORT's "[ONNXRuntimeError] : 1 : FAIL :" prefix dropped, one line,
    and when still too long its head and its tail (nested ORT errors put the actual type error last)."""
    text = " ".join(str(exc).split())
    text = re.sub(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ", "", text)
    if len(text) <= limit:
        return text
    head = limit // 3
    return f"{text[:head]} ... {text[-(limit - head - 5) :]}"


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
