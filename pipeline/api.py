"""The Python API behind the CLI: run the pipeline (or some stages of it) and write the report."""

from __future__ import annotations

from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from kiln.core.artifacts import ensure_writable
from kiln.core.errors import ConfigError, KilnError, storage_error
from kiln.core.logs import warnings_said_once
from kiln.core.ownership import SCRATCH, scratch_root
from kiln.core.progress import Progress
from kiln.pipeline.config import KilnConfig, config_from_dict, load_config
from kiln.pipeline.report import build_report, write_report
from kiln.pipeline.runner import Runner, RunResult, StageRecord
from kiln.pipeline.stage_list import STAGE_NAMES, STAGES, stage_named
from kiln.pipeline.workdir_lock import LOCK_NAME, workdir_lock


def run_pipeline(
    config: KilnConfig | dict[str, Any] | str | Path,
    workdir: str | Path,
    *,
    force: Collection[str] | str | None = None,
    start: str | None = None,
    stop: str | None = None,
    only: Collection[str] | str | None = None,
    progress: Progress | None = None,
    on_stage: Callable[[StageRecord], Any] | None = None,
) -> tuple[RunResult, dict[str, Any]]:
    """Run stages in order with caching; ``only`` restricts to those stages (their inputs must exist).

    Args:
        config: the run config; a dict (validated as a config file's sections) or a config file's path also does.
        workdir: the run's folder (new, empty, or one an earlier run used).
        force: stages to rerun even when cached; a single name is one stage.
        start, stop: the first and last stage to run.
        only: the stages to run, alone; a single name is one stage.
        progress, on_stage: told as the stages run.
    """
    config = as_config(config)
    force, only = _stage_set(force), _stage_set(only)
    for name in [*(force or ()), start, stop, *(only or ())]:
        if name is not None:
            stage_named(name)  # raises ConfigError listing valid stage names
    if start is not None and stop is not None and STAGE_NAMES.index(start) > STAGE_NAMES.index(stop):
        raise ConfigError(
            f"--from {start} comes after --until {stop}: nothing would run",
            hint=f"stages run in the order {' -> '.join(STAGE_NAMES)}",
        )
    stages = [s for s in STAGES if only is None or s.name in only]
    workdir = Path(workdir)
    refuse_foreign_workdir(workdir)
    ensure_writable(workdir, "--workdir")
    # temporary files inside the workdir, removed after; a warning two stages say word for word, said once
    with workdir_lock(workdir), scratch_root(workdir), warnings_said_once():
        runner = Runner(config, workdir, stages, progress, on_stage, upstream=STAGES)
        result = runner.run(force=force, start=start, stop=stop)
        try:
            report = write_report(result, config, workdir)
        except OSError as exc:  # e.g. the disk filled up: say so with the run's own outcome, never a traceback
            report = build_report(result, config, workdir)
            result.error = _not_written(result.error, storage_error(exc, "writing report.json / report.md"))
    return result, report


def as_config(config: object) -> KilnConfig:
    """The run config from what the caller passed: a KilnConfig, a dict of sections or a config file's path."""
    if isinstance(config, KilnConfig):
        return config
    if isinstance(config, dict):
        return config_from_dict(config)
    if isinstance(config, (str, Path)):
        return load_config(config)
    raise ConfigError(
        f"run_pipeline takes a KilnConfig, a dict or a config file path, got {type(config).__name__}",
        hint="pass load_config('my.yaml'), config_from_dict({...}), a dict of config sections or a file path",
    )


def _stage_set(names: Collection[str] | str | None) -> set[str] | None:
    """Stage names as a set; a single string is one stage's name, not its letters."""
    if names is None:
        return None
    return {names} if isinstance(names, str) else set(names)


def refuse_foreign_workdir(workdir: Path) -> None:
    """A run replaces its stage folders and reports whole: only in a new or empty folder, or one a Kiln run made
    (its lock, report or a stage manifest shows it). Anything else (`-w ~/project`) holds files Kiln did not
    create, and a folder of the user's named `train` or `build` would be replaced."""
    if workdir.is_file():
        raise ConfigError(f"--workdir {workdir} is a file", hint="give a new or empty folder, or a Kiln workdir")
    if not workdir.is_dir():
        return
    entries = [p.name for p in workdir.iterdir() if not p.name.startswith(".kiln-write-test-") and p.name != SCRATCH]
    ours = {LOCK_NAME, "report.json", "report.md"} & set(entries) or any(
        (workdir / name / "manifest.json").is_file() for name in STAGE_NAMES
    )
    if entries and not ours:
        shown = ", ".join(sorted(entries)[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
        raise ConfigError(
            f"--workdir {workdir} already holds files Kiln did not write ({shown})",
            hint="give a new or empty folder for --workdir (or one an earlier `kiln run` used)",
        )


def _not_written(error: KilnError | None, why: KilnError) -> KilnError:
    """The run's own error (kept first, with its exit code) extended by why the report is missing."""
    if error is None:
        return why
    merged = type(error)(f"{error.message}; the report was not written either: {why.message}", hint=error.hint)
    return merged


__all__ = ["run_pipeline", "STAGE_NAMES"]
