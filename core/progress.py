"""Progress reporting that library code can call without knowing about terminals.

Stages call ``ctx.progress.task("training", total=epochs)`` and ``advance()``; the CLI plugs in rich bars,
tests and ``--quiet`` get the silent default.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol


class Task(Protocol):
    def advance(self, n: float = 1, note: str | None = None) -> None: ...


class Progress(Protocol):
    def task(self, description: str, total: float | None = None) -> contextmanager[Task]: ...  # type: ignore[valid-type]


class _SilentTask:
    def advance(self, n: float = 1, note: str | None = None) -> None:
        pass


class SilentProgress:
    @contextmanager
    def task(self, description: str, total: float | None = None) -> Iterator[Task]:
        yield _SilentTask()


class RichProgress:
    """rich progress bars, one per task, removed when the task ends."""

    def __init__(self, console: object) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            TextColumn,
            TimeElapsedColumn,
        )
        from rich.progress import Progress as _P

        self._progress = _P(
            TextColumn("  [progress.description]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[note]}"),
            console=console,
            transient=True,
        )

    @contextmanager
    def task(self, description: str, total: float | None = None) -> Iterator[Task]:
        progress = self._progress
        with progress:
            tid = progress.add_task(description, total=total, note="")

            class _T:
                def advance(self, n: float = 1, note: str | None = None) -> None:
                    progress.update(tid, advance=n, **({"note": note} if note is not None else {}))

            try:
                yield _T()
            finally:
                progress.remove_task(tid)
