"""Error text for log lines and `error:` lines: one line that names the problem."""

from __future__ import annotations

from kiln.core.text import compiler_reason


class CppCompileError(Exception):
    """Shaped like Inductor's: a first line that says nothing, the command, then the compiler's output."""


def test_a_compiler_error_names_the_compilers_own_reason() -> None:
    exc = CppCompileError(
        "C++ compile error\n\nCommand:\ng++ a.hpp -o b.i\n\nOutput:\n"
        "cc1plus: fatal error: opening output file b.i: No such file or directory\ncompilation terminated.\n"
    )
    assert compiler_reason(exc) == (
        "C++ compile error (cc1plus: fatal error: opening output file b.i: No such file or directory)"
    )


def test_a_one_line_error_stays_as_it_is() -> None:
    assert compiler_reason(ValueError("shape mismatch: 3 vs 4")) == "shape mismatch: 3 vs 4"
    assert compiler_reason(ValueError("bad input\nsee the docs")) == "bad input"
