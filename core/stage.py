"""What a stage is (a function of its config and upstream artifacts) and what it is handed when it runs."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from kiln.core.data import DatasetSplits
from kiln.core.errors import KilnError
from kiln.core.progress import Progress, SilentProgress

if TYPE_CHECKING:  # the config assembles every stage's section, so it sits above the stages; types only
    from kiln.pipeline.config import KilnConfig


@dataclass
class StageContext:
    """Everything a stage may use. A stage writes only into ``out`` (a staging folder made final atomically)."""

    name: str
    config: KilnConfig
    workdir: Path
    out: Path
    inputs: dict[str, Path]
    progress: Progress = field(default_factory=SilentProgress)
    log: logging.Logger = field(default_factory=lambda: logging.getLogger("kiln"))
    # Set by the runner only for a stage that declares the dataset among its inputs (``Stage.data``), so the
    # dataset's content is always in the key of a stage that reads it.
    load_dataset: Callable[[], DatasetSplits] | None = None
    _data: DatasetSplits | None = None

    @property
    def cache_dir(self) -> Path:
        """Long-lived caches shared across stages and runs (timing cache, calibration cache)."""
        p = self.workdir / "cache"
        p.mkdir(parents=True, exist_ok=True)
        return p

    def dataset(self) -> DatasetSplits:
        if self.load_dataset is None:
            raise KilnError(
                f"stage '{self.name}' reads the dataset without declaring it (Stage.data)",
                hint="this is a bug in Kiln's stage list; please report it",
            )
        if self._data is None:
            self._data = self.load_dataset()
        return self._data


StageFn = Callable[[StageContext], dict[str, Any]]


@dataclass(frozen=True)
class Stage:
    """A pipeline step.

    ``inputs``: upstream stages whose artifacts it reads. ``sections``: config it reads, as sections (``"data"``),
    top-level values (``"seed"``) or single keys (``"validate.batch_sizes"``); everything the result depends on.
    ``code``: modules whose source is hashed as the stage's code version. ``env``: the environment facts
    (library versions, device) that belong in its cache key. ``data``: fingerprints of user-supplied data it reads;
    only a stage that names ``"dataset"`` here can read the dataset (``StageContext.dataset``). ``report``: its
    section of report.md.
    """

    name: str
    run: StageFn
    inputs: tuple[str, ...]
    sections: tuple[str, ...]
    code: tuple[ModuleType, ...]
    env: Callable[[KilnConfig], dict[str, Any]]
    description: str = ""
    data: tuple[str, ...] = ()  # user-data fingerprints in its key (``kiln.pipeline.fingerprints``)
    # report.md section from the stage's summary (a list of Markdown lines; none when nothing to say)
    report: Callable[[dict[str, Any]], list[str]] | None = None
