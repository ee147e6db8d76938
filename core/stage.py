"""What a stage is (a function of the settings it declares and its upstream artifacts, returning a typed summary)
and what it is handed when it runs.

A stage declares the part of the run config it reads as a :class:`StageSettings` dataclass: one field per config
section (``train``), top-level value (``seed``) or single key (``require_speedup``, read from
``precision.require_speedup``). The runner fills it from the run config; the stage sees nothing else, and what it
sees is exactly what its cache key covers.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

from pydantic import BaseModel

from kiln.core.errors import KilnError
from kiln.core.ownership import refuse_link
from kiln.core.progress import Progress, SilentProgress
from kiln.core.records import Summary

if TYPE_CHECKING:
    from kiln.core.data import DatasetSplits

# what a stage that reads the dataset must declare: the dataset is made from them (the axis sizes only when it is
# random inputs of a model.onnx, :func:`kiln.models.model_io.on_random_inputs`)
DATASET_SOURCES = ("seed", "model", "data", "signature.dynamic_axes", "signature.shapes")
RANDOM_INPUT_SOURCES = ("signature.shapes",)


@dataclass(frozen=True)
class StageSettings:
    """Base of each stage's declared settings. Fields are filled from the run config key of the same name, or
    from what ``SOURCES`` gives for it: a dotted key (``"precision.require_speedup"``), or several keys of one
    section, which the field then holds alone (``("signature.batch_sizes", "signature.shapes")``: a view of the
    signature without its other keys, see :meth:`kiln.core.sections.Section.only`)."""

    SOURCES: ClassVar[dict[str, str | tuple[str, ...]]] = {}
    # Field -> a function of the settings whose value keys the stage's cache in place of the field's config keys:
    # what the stage makes of them, so a change the stage cannot see leaves it cached
    KEY_VIEWS: ClassVar[dict[str, Callable[[Any], Any]]] = {}

    @classmethod
    def sources(cls) -> dict[str, tuple[str, ...]]:
        """Field -> the run config keys it is read from (``("model",)``, ``("precision.require_speedup",)``)."""
        out = {}
        for f in fields(cls):
            src = cls.SOURCES.get(f.name, f.name)
            out[f.name] = (src,) if isinstance(src, str) else tuple(src)
        return out

    @classmethod
    def keys(cls) -> list[str]:
        """Every run config key the stage reads."""
        return [key for keys in cls.sources().values() for key in keys]

    def dump(self) -> dict[str, Any]:
        """The settings as a run config of the keys they come from (JSON; another process loads it as a config)."""
        out: dict[str, Any] = {}
        for name, keys in self.sources().items():
            value = getattr(self, name)
            for key in keys:
                *parents, leaf = key.split(".")
                node = out
                for part in parents:
                    node = node.setdefault(part, {})
                node[leaf] = _json(value if len(keys) == 1 else getattr(value, leaf))
        return out


def _json(value: Any) -> Any:
    return value.model_dump(mode="json", by_alias=True) if isinstance(value, BaseModel) else value


S = TypeVar("S", bound=StageSettings)


@dataclass
class StageContext(Generic[S]):
    """Everything a stage may use. A stage writes only into ``out`` (a staging folder made final atomically)."""

    name: str
    config: S
    workdir: Path
    out: Path
    inputs: dict[str, Path]
    progress: Progress = field(default_factory=SilentProgress)
    log: logging.Logger = field(default_factory=lambda: logging.getLogger("kiln"))
    # Set by the runner only for a stage that declares the dataset among its inputs (``Stage.data``), so the
    # dataset's content is always in the key of a stage that reads it.
    load_dataset: Callable[[], DatasetSplits] | None = None
    # What went into the stage's cache key (kiln.pipeline.runner.cache_key: its code, config, inputs, the user's code
    # and data hashes), set by the runner: a stage whose work outlives one run (the train stage's checkpoints) can
    # tell whether it is still the same. Empty outside the runner.
    key_parts: dict[str, Any] = field(default_factory=dict)
    # Set by the runner where the user forced the stage (``--force NAME``): it keeps nothing of its previous output
    # (the build stage's engines), whatever else changed.
    forced: bool = False
    _data: DatasetSplits | None = None

    @property
    def cache_dir(self) -> Path:
        """Long-lived caches shared across stages and runs (timing cache, calibration cache)."""
        p = self.workdir / "cache"
        refuse_link(p, "the workdir's cache folder")  # planted elsewhere: never written through
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


@dataclass(frozen=True)
class Stage:
    """A pipeline step, declared apart from the code that runs it.

    ``entry``: ``"module:function"`` of the code that runs it, imported only when the stage runs: deciding that a
    stage is cached (its key, its summary, its report section) loads none of the libraries it runs (torch, ONNX).
    ``inputs``: upstream stages whose artifacts it reads. ``settings``: the part of the run config it reads.
    ``summary``: the type of what it returns. ``code``: names of the modules whose source is hashed as the stage's
    code version (packages: every file under them), found without importing them. ``env``: the environment facts
    (library versions, device) that belong in its cache key. ``data``: fingerprints of user-supplied data it reads;
    only a stage that names ``"dataset"`` here can read the dataset (``StageContext.dataset``). ``random_inputs``:
    whether it may read the random inputs a run from ``model.onnx`` without data has (training has no PyTorch model
    to train then, and does not; its key then need not hold what sizes them). ``report``: its section of report.md.
    ``notes``: its output files for people only (a loss plot), which no later stage's key holds. ``checks``:
    ``"module:function"`` of quick checks of its settings (the user code they name imports and takes the call it
    will get), each given the settings: the runner runs them before an earlier stage does work, so a typo in a
    metric's import path fails before training, not after it.
    """

    name: str
    entry: str
    inputs: tuple[str, ...]
    settings: type[StageSettings]
    summary: type[Summary]
    code: tuple[str, ...]
    env: Callable[[Any], dict[str, Any]]
    description: str = ""
    data: tuple[str, ...] = ()  # user-data fingerprints in its key (``kiln.pipeline.fingerprints``)
    # report.md section from the stage's summary (a list of Markdown lines; none when nothing to say)
    report: Callable[[Any], list[str]] | None = None
    random_inputs: bool = True
    # files of its output for people (a plot, a profiler trace) that no later stage reads: left out of their keys
    notes: tuple[str, ...] = ()
    checks: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.entry.count(":") != 1 or not all(self.entry.split(":")):
            raise TypeError(f"stage {self.name}: entry must be 'module:function', not {self.entry!r}")
        declared = self.settings.keys()
        needed = [k for k in DATASET_SOURCES if self.random_inputs or k not in RANDOM_INPUT_SOURCES]
        missing = [k for k in needed if not any(k == d or k.startswith(d + ".") for d in declared)]
        if "dataset" in self.data and missing:
            raise TypeError(f"stage {self.name} reads the dataset: its settings must declare {tuple(needed)}")

    def function(self) -> Callable[[StageContext[Any]], Summary]:
        """The code that runs the stage (``entry``), imported here, on first use."""
        module, _, function = self.entry.partition(":")
        return getattr(importlib.import_module(module), function)

    def check(self, settings: StageSettings) -> None:
        """Run :attr:`checks` on ``settings``: each raises the user's error (a ConfigError) for what it finds."""
        for entry in self.checks:
            module, _, function = entry.partition(":")
            getattr(importlib.import_module(module), function)(settings)

    def run(self, ctx: StageContext[Any]) -> Summary:
        return self.function()(ctx)
