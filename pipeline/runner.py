"""Runs stages in order, skipping those whose cache key matches what is already in the workdir.

A stage's key hashes its code, its config sections, its inputs' content hashes and the environment it
depends on. Outputs go to ``<workdir>/<stage>/`` through a staging folder renamed into place, with a
``manifest.json``; an interrupted run leaves finished stages intact, so the next run resumes after them.
"""

from __future__ import annotations

import json
import logging
import sys
import time
import uuid
from collections.abc import Callable, Collection, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any

from kiln.core import interrupt
from kiln.core.artifacts import (
    MANIFEST,
    atomic_dir,
    clean_stale_staging,
    hash_json,
    hash_source,
    hash_tree,
    read_manifest,
    write_json_atomic,
)
from kiln.core.env import environment, keep_facts_in
from kiln.core.errors import GateFailure, KilnError, disk_full, storage_error
from kiln.core.ownership import SCRATCH, is_leftover
from kiln.core.progress import Progress, SilentProgress
from kiln.core.records import NONE_VALIDATED
from kiln.core.stage import Stage, StageContext, StageSettings, Summary
from kiln.core.threads import cpu_threads_for_load
from kiln.models.registry import resolve_callable
from kiln.pipeline.config import KilnConfig
from kiln.pipeline.fingerprints import FINGERPRINTS, SLOW_CALL_S, dataset_fingerprint, slow_call_hint
from kiln.pipeline.manifests import handed_on, out_of_date
from kiln.pipeline.user_code import code_version, defined_unrun, import_root
from kiln.stages.engines.declaration import BuildSummary
from kiln.stages.engines.registry import backend_libraries
from kiln.stages.validate.declaration import NOT_BUILT, REQUIRED, UNVALIDATED
from kiln.stages.validate.measured import NO_FINITE_FIX, unmeasured

log = logging.getLogger("kiln")


@dataclass
class StageRecord:
    name: str
    status: str  # ran | cached | skipped | failed | not-run
    seconds: float = 0.0  # what the stage's own work took (none for a cached one; a failed one: until it failed)
    key: str | None = None
    summary: Summary | None = None  # the stage's typed summary (a cached stage's, read back)
    error: str | None = None
    original_seconds: float | None = None  # for a cached stage: how long it took when it ran
    changed: list[str] = field(default_factory=list)  # for a stage run again: the parts of its key that changed
    # deciding whether it is cached: its key (the first one loads and hashes the user's data), its inputs' files
    check_seconds: float = 0.0


@dataclass
class RunResult:
    workdir: Path
    records: list[StageRecord]
    error: KilnError | None = None
    wall_seconds: float | None = None  # the stages of the run, checks included (not starting Python or the report)

    @property
    def check_seconds(self) -> float:
        """What the run spent deciding which stages are cached (their keys, the data they hash), beside their work."""
        return sum(r.check_seconds for r in self.records)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def report_path(self) -> Path:
        """The run's ``report.json`` (``report.md`` beside it; the packaged engines under ``package/engines``)."""
        return self.workdir / "report.json"


def gate_hint(failures: list[str], status: str, backends: Collection[str] = (), skipped: Sequence[str] = ()) -> str:
    """The fix line for failed validation gates: relaxing a gate helps only where a number missed it; engines
    this machine cannot run are validated where they run. ``backends``: the run's ``build.backends``, where a
    backend this machine runs is already one (then the build's ``skipped`` lines say why it built none of the
    precisions missing here: :func:`skipped_here`)."""
    if all(f.startswith(NONE_VALIDATED) or f.startswith(REQUIRED) and UNVALIDATED in f for f in failures):
        there = "validate the engines on a machine that runs them (`kiln validate` there)"
        if "onnxruntime" not in backends:
            return f"{there}, or add a backend this machine runs (build.backends: [onnxruntime])"
        here = skipped_here(failures, skipped)
        return f"{there}; not built here: {here}" if here else there
    if all(f.startswith(REQUIRED) and NOT_BUILT in f for f in failures):  # no gate missed: none to relax
        return (
            "the result line says why none was built: a precision this device has no kernels for (FP16 on a CPU) is "
            "built on a GPU (build.backends, each backend's devices); a variant that missed its gates, by relaxing "
            "validate.gates.per_precision only if its numbers are acceptable; or take it out of precision.required"
        )
    if all(f.startswith(REQUIRED) for f in failures):
        return (
            "the result line and report.md say why no such engine was made; relax its "
            "validate.gates.per_precision only if its numbers are acceptable, or take it out of precision.required"
        )
    if unmeasured(failures) and len(unmeasured(failures)) == len(failures):
        return NO_FINITE_FIX  # no gate or precision changes an output that is no number in PyTorch too
    cached = " (latency from an earlier run: `--force validate` measures again)" if status == "cached" else ""
    return f"see report.md; relax validate.gates only if the numbers are acceptable{cached}"


def skipped_here(failures: list[str], skipped: Sequence[str]) -> str:
    """The build's ``skipped`` lines ("name: why (fix: ...)") of the precisions ``failures`` find no engine of on
    this machine (every precision where none could be validated), one clause each: the engine and its fix (its
    reason where it has none)."""
    lacking = {
        f.removeprefix(REQUIRED).partition(" ")[0] for f in failures if f.startswith(REQUIRED) and UNVALIDATED in f
    }
    every = any(f.startswith(NONE_VALIDATED) for f in failures)
    clauses = []
    for line in skipped:
        name, _, why = line.partition(": ")
        if every or name.rpartition("-")[2] in lacking:
            reason, _, fix = why.partition(" (fix: ")
            clauses.append(f"{name}: {fix.removesuffix(')') if fix else reason}")
    return "; ".join(clauses)


def outputs_intact(stage_dir: Path, manifest: dict[str, Any], verified: dict[Path, str] | None = None) -> bool:
    """Every recorded output exists with its recorded size and sha256, and nothing else was added: flipped bytes
    in a model or engine are caught, not only truncation. Hashing is the cost (see the README's figure), so
    ``verified`` (stage folder -> the manifest's output hash) memoizes one run's checks: each folder is read
    once per run although the stage and every downstream stage ask."""
    outputs = manifest.get("outputs")
    if not isinstance(outputs, dict):
        return False
    stamp = hash_json(outputs)
    if verified is not None and verified.get(stage_dir) == stamp:
        return True
    sizes = manifest.get("sizes", {})
    try:
        if any(not (stage_dir / rel).is_file() or (stage_dir / rel).stat().st_size != n for rel, n in sizes.items()):
            return False  # cheap first: a missing or truncated file needs no hashing
        intact = hash_tree(stage_dir, exclude=(MANIFEST,)) == outputs
    except OSError:
        return False  # unreadable (permissions, a folder where a file was): not to be trusted
    if intact and verified is not None:
        verified[stage_dir] = stamp
    return intact


# names no user keeps in a stage folder: manifests of Kiln's at any depth (hash_tree leaves them out too), and what
# a file browser or NFS leaves behind (.nfs* while a deleted file is still open)
NOT_USER_FILES = {MANIFEST, ".DS_Store", "Thumbs.db", "desktop.ini"}


def foreign_files(stage_dir: Path, manifest: dict[str, Any]) -> list[str]:
    """Files in a stage folder that its manifest does not list and Kiln did not leave there (its temporary names,
    its scratch space, Python's ``__pycache__`` of a packaged app, :data:`NOT_USER_FILES`): a user's own, which a
    rerun of the stage, that replaces the whole folder, would delete."""
    known = set(manifest.get("outputs", {}))
    found = []
    for p in sorted(stage_dir.rglob("*")):
        rel = p.relative_to(stage_dir)
        if (p.is_dir() and not p.is_symlink()) or rel.as_posix() in known:
            continue
        if is_leftover(p.name) or p.name in NOT_USER_FILES or p.name.startswith(".nfs"):
            continue
        if "__pycache__" in rel.parts or SCRATCH in rel.parts:
            continue
        found.append(rel.as_posix())
    return found


def refuse_foreign(stage: str, stage_dir: Path, manifest: dict[str, Any] | None) -> None:
    """Stop before a run of ``stage`` would delete files a user put in its folder: files its manifest does not
    list, or any file in a folder with no manifest at all (the stage never finished there: Kiln writes a stage's
    folder whole, its manifest inside, so whatever is in such a folder is someone else's)."""
    if not stage_dir.is_dir():
        return
    if manifest is None and not (stage_dir / MANIFEST).exists():
        found = foreign_files(stage_dir, {"outputs": {}})
    elif manifest and manifest["outputs"]:
        found = foreign_files(stage_dir, manifest)
    else:  # a damaged manifest, or one that lists no output, knows nothing of the folder: no verdict
        found = []
    if found:
        more = f" and {len(found) - 1} more" if len(found) > 1 else ""
        unlisted = manifest is None  # no manifest: Kiln's own files of an earlier run whose manifest was deleted?
        listed = f"its manifest does not list {'them' if more else 'it'}"
        why = "the folder has no manifest.json" if unlisted else listed
        raise KilnError(
            f"{stage_dir / found[0]}{more} {'are not files' if more else 'is not a file'} Kiln wrote ({why}), and "
            f"running stage '{stage}' replaces {stage_dir} whole",
            hint=f"move your files out of {stage_dir} (keep them beside the stage folders, in the workdir), then "
            "run again" + ("; if they are all Kiln's, delete the folder" if unlisted else ""),
        )


def config_at(config: KilnConfig, dotted: str) -> Any:
    """A config section (``"build"``), top-level value (``"seed"``) or one key (``"precision.require_speedup"``)."""
    head, *rest = dotted.split(".")
    value: Any = config.section(head)
    for part in rest:
        value = getattr(value, part)
    return value


def config_value(config: KilnConfig, dotted: str) -> Any:
    """:func:`config_at` as JSON."""
    value = config_at(config, dotted)
    if not hasattr(value, "model_dump"):
        return value
    return value.model_dump(mode="json", exclude=set(getattr(value, "UNKEYED", ())))


def settings_for(stage: Stage, config: KilnConfig) -> StageSettings:
    """The part of ``config`` the stage declares (``Stage.settings``): all the stage may read."""
    values = {}
    for name, keys in stage.settings.sources().items():
        if len(keys) == 1:
            values[name] = config_at(config, keys[0])
        else:  # several keys of one section: a view of it holding those keys only
            values[name] = config_at(config, keys[0].rpartition(".")[0]).only(*(k.rpartition(".")[2] for k in keys))
    return stage.settings(**values)


def load_dataset(config: KilnConfig) -> Any:
    """The run's dataset, as every stage that reads it loads it."""
    from kiln.models.model_io import dataset_for  # torch: only when a stage runs

    return dataset_for(config.model, config.data, config.signature, config.seed)


def cache_key(
    stage: Stage,
    config: KilnConfig,
    workdir: Path,
    fingerprints: dict[str, str | None] | None = None,
    dataset: Callable[[], Any] | None = None,
    timings: dict[str, float] | None = None,
) -> tuple[str, dict[str, Any]]:
    """The stage's key and what went into it. ``fingerprints`` memoizes user-data hashes across one run's stages;
    ``dataset``: the run's dataset, loaded once a run (the user data hashed is then the data the stages read);
    ``timings``: given, gets how long the call of the user's data function to hash it took (``"data"``)."""
    inputs = {}
    for up in stage.inputs:
        m = read_manifest(workdir / up)
        inputs[up] = handed_on(m) if m else None
    parts = {"code": hash_source(*stage.code), "inputs": inputs, "env": stage.env(settings_for(stage, config))}
    parts |= user_parts(stage, config)  # the config part, and the user's code
    memo = {} if fingerprints is None else fingerprints
    for name in stage.data:
        if name not in memo:
            fingerprint = FINGERPRINTS[name]
            if name == "dataset" and dataset is not None:
                fingerprint = partial(dataset_fingerprint, load=dataset, timings=timings)
            memo[name] = fingerprint(config, workdir)
    data = {name: memo[name] for name in stage.data if memo[name] is not None}
    if data:
        parts["user_data"] = data
    return hash_json(parts), as_recorded(parts)


def as_recorded(parts: dict[str, Any]) -> dict[str, Any]:
    """Key parts as the manifest keeps them (JSON: an axis 1 becomes "1"), so that what_changed compares like with
    like."""
    return json.loads(json.dumps(parts, default=str))


# Config keys that may name the user's own code by import path (``package.module:function``), each with the name
# its errors give it
USER_CODE_KEYS = {
    "model.name": "model",
    "data.name": "data",
    "calibration.reader": "calibration",
    "train.loss": "train.loss",
    "validate.metric": "validate.metric",
}


def check_user_code(config: KilnConfig, sections: Collection[str]) -> None:
    """Each function the config names by import path (:data:`USER_CODE_KEYS`) for stages whose settings cover its
    key, looked for in its module's source (nothing imported); where the source lacks it, the module is imported to
    confirm, which names the mistake (a ConfigError: a misspelt function); where the source cannot tell (``import
    *``), the stages' own checks find out. A run does this before its first cache key, which may call the user's
    data function (seconds): a typo then fails as fast in a workdir of earlier runs as in a new one."""
    for key, label in USER_CODE_KEYS.items():
        if not any(key == s or key.startswith(s + ".") for s in sections):
            continue
        ref = config_at(config, key)
        if isinstance(ref, str) and ":" in ref and defined_unrun(*ref.split(":", 1)) is False:
            resolve_callable(ref, {}, label)  # imported only where the source says it is missing: to confirm


def user_parts(stage: Stage, config: KilnConfig, code: bool = True) -> dict[str, Any]:
    """The parts of ``stage``'s key the user sets: its config sections and their code (``user_code``; ``code``
    False: not hashed), as the manifest keeps them. Read without the data or any upstream output: what tells
    whether a stage's folder is what this config would make of the same inputs."""
    user = user_code(config, tuple(stage.settings.keys())) if code else {}
    return {"config": config_parts(stage, config)} | ({"user_code": user} if user else {})


def config_parts(stage: Stage, config: KilnConfig) -> dict[str, Any]:
    """The config part of ``stage``'s key: each run config key its settings read, as JSON. A field the settings
    key by what the stage makes of it (``KEY_VIEWS``: field -> function of the settings; the precision stage's
    gates as each variant is held to them) is keyed as that, under the section its keys share, in place of its
    keys: a change the view does not see leaves the stage cached."""
    views = stage.settings.KEY_VIEWS
    settings = settings_for(stage, config) if views else None
    out: dict[str, Any] = {}
    for name, keys in stage.settings.sources().items():
        if name in views:
            out[keys[0] if len(keys) == 1 else keys[0].rpartition(".")[0]] = views[name](settings)
        else:
            out |= {k: config_value(config, k) for k in keys}
    return out


def user_code(config: KilnConfig, sections: tuple[str, ...]) -> dict[str, str]:
    """Source hashes of the user's own code named by import path (:data:`USER_CODE_KEYS`: the model, the data, a
    calibration reader, a loss, a metric), for the stages whose settings cover the key that names it: editing that
    code must invalidate the cache just as editing Kiln's does. A stage that runs imports that code itself, and
    a mistake in it is that stage's error."""
    out = {}
    for key, label in USER_CODE_KEYS.items():
        if not any(key == s or key.startswith(s + ".") for s in sections):
            continue
        ref = config_at(config, key)
        if isinstance(ref, str) and ref.partition(":")[0] == "__main__" and _fileless_main():
            out[ref] = _unversioned(key, ref)
        elif isinstance(ref, str) and ":" in ref:
            version = _source_version(ref, label)
            if version:
                out[ref] = version
    return out


# This run's stand-in versions of code that has no file to hash (see _unversioned), cleared as each run starts
_UNVERSIONED: dict[str, str] = {}


def _fileless_main() -> bool:
    """Is ``__main__`` a notebook or ``python -c``, with no source file?"""
    main = sys.modules.get("__main__")
    return main is not None and not getattr(main, "__file__", None)


def _unversioned(key: str, ref: str) -> str:
    """A version for ``ref`` in a ``__main__`` without a file, which no earlier run's matches (code that cannot be
    hashed must not reuse what older code made); the run warns of it once."""
    if ref not in _UNVERSIONED:
        log.warning(
            "%s '%s' is defined in __main__ (a notebook or python -c), which has no file to version: the stages "
            "that use it rerun on every call; put it in a module file to have them cached",
            key,
            ref,
        )
        _UNVERSIONED[ref] = f"unversioned-{uuid.uuid4().hex}"
    return _UNVERSIONED[ref]


def code_roots(refs: dict[str, str]) -> list[str]:
    """The folders the user's code named by ``refs`` (``pkg.mod:fn``) is imported from (not installed code)."""
    return sorted({root for ref in refs if (root := import_root(ref.partition(":")[0])) is not None})


def _source_version(ref: str, label: str) -> str | None:
    """:func:`code_version` of the module ``ref`` names, found without running it (a cached stage loads none of the
    user's code, nor the libraries it imports); where it cannot be found so, it is imported, which names the
    problem (a clean ConfigError) or finds it after all (a module made on import)."""
    module = ref.partition(":")[0]
    try:
        version = code_version(module)
    except Exception:  # a parent package that fails to import: the import below says how
        version = None
    if version is None:
        resolve_callable(ref, {}, label)
        version = code_version(sys.modules[module])
    return version


def what_changed(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Which parts of a stage's key differ, as dotted names (``config.train``, ``user_data.dataset``): a rerun
    nobody expected (unseeded randomness in a user's data, say) then says why."""
    out = []
    for part in sorted(set(old) | set(new)):
        a, b = old.get(part), new.get(part)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            out += [f"{part}.{k}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        else:
            out.append(part)
    return out


def code_said_by_module(changed: list[str], old: dict[str, Any], new: dict[str, Any], config: KilnConfig) -> list[str]:
    """:func:`what_changed`'s names (of key parts ``old`` -> ``new``) with the user's edited code said as what its
    hash covers: the module named and the local modules it imports (an edit anywhere in them changes the hash of
    every function the config takes from it), not those functions as if each had changed. Code named in one of the
    two runs only stays as it is."""
    before, after = old.get("user_code") or {}, new.get("user_code") or {}
    edited = [ref for ref in before if ref in after and before[ref] != after[ref]]
    modules: dict[str, list[str]] = {}
    for ref in edited:
        modules.setdefault(ref.partition(":")[0], []).append(ref)
    said = {
        module: f"module {module} (the module of {_uses(refs, config)}, or a local module it imports)"
        for module, refs in modules.items()
    }
    out = []
    for part in changed:
        ref = part.removeprefix("user_code.") if part.startswith("user_code.") else None
        if ref not in edited:
            out.append(part)
        elif line := said.pop(ref.partition(":")[0], None):  # once a module, where its first function was
            out.append(line)
    return out


def _uses(refs: list[str], config: KilnConfig) -> str:
    """``model 'm:build' and data 'm:load'``: what the config takes ``refs`` as (:data:`USER_CODE_KEYS`)."""
    named = [(label, ref) for key, label in USER_CODE_KEYS.items() if (ref := config_at(config, key)) in refs]
    return " and ".join(f"{label} '{ref}'" for label, ref in named or [("code", r) for r in refs])


class Runner:
    def __init__(
        self,
        config: KilnConfig,
        workdir: Path,
        stages: list[Stage],
        progress: Progress | None = None,
        on_event: Any = None,
        upstream: list[Stage] | None = None,
    ) -> None:
        """``upstream``: every stage whose folder the run's stages may read (the whole pipeline where only some
        stages run), for the check that each is what this config makes; by default ``stages``."""
        self.config, self.workdir, self.stages = config, Path(workdir), stages
        self.upstream = {s.name: s for s in upstream or stages}
        self.progress = progress or SilentProgress()
        self.on_event = on_event or (lambda record: None)

    def run(self, force: set[str] | None = None, start: str | None = None, stop: str | None = None) -> RunResult:
        """``force``: rerun these stages; ``start``: rerun from this stage on; ``stop``: end after this stage."""
        began = time.perf_counter()
        _UNVERSIONED.clear()  # code with no file gets a new version each run
        self.workdir.mkdir(parents=True, exist_ok=True)
        clean_stale_staging(self.workdir)
        keep_facts_in(self.workdir / "cache")  # the device's facts, read back while this boot lasts (kiln.core.env)
        names = [s.name for s in self.stages]
        force = set(force or ())
        if start is not None:
            force |= set(names[names.index(start) :])
        records: list[StageRecord] = []
        error: KilnError | None = None
        self._fingerprints: dict[str, str | None] = {}  # user data is hashed once per run
        self._timings: dict[str, float] = {}  # how long calling the user's data function to hash it took
        self._dataset: list[Any] = []  # and loaded once: every stage reads the same splits
        self._verified: dict[Path, str] = {}  # stage outputs are hashed once per run (outputs_intact)
        self._threads_said = False
        self._current: set[str] = set()  # stages this run ran or found cached: current (see _refuse_out_of_date)
        last_reader = max((i for i, s in enumerate(self.stages) if "dataset" in s.data), default=-1)
        self._ahead = self.stages[: names.index(stop) + 1 if stop is not None else None]  # this run's stages
        self._checked = self._code_checked = False
        for i, stage in enumerate(self.stages):
            if error is not None:
                records.append(StageRecord(stage.name, "not-run"))
                continue
            interrupt.check()  # a Ctrl-C that a finalizer swallowed during the last stage stops the run here
            started = time.perf_counter()
            try:
                record = self._run_one(stage, stage.name in force)
            except KilnError as exc:  # one that quotes a full disk says the disk (export failed: ... errno 28)
                error = disk_full(exc, self._place(stage)) or exc
                record = StageRecord(stage.name, "failed", error=str(error))
            except OSError as exc:  # disk full, read-only, permissions: a clear message, finished stages kept
                log.debug("stage %s: OS error", stage.name, exc_info=True)
                error = disk_full(exc, self._place(stage)) or storage_error(exc, f"running stage '{stage.name}'")
                record = StageRecord(stage.name, "failed", error=str(error))
            except MemoryError:
                log.debug("stage %s: out of memory", stage.name, exc_info=True)
                error = KilnError(
                    f"stage '{stage.name}' ran out of memory",
                    hint="lower signature.batch_sizes, train.batch_size or the model's size",
                )
                record = StageRecord(stage.name, "failed", error=str(error))
            except Exception as exc:  # a library's own error for a full disk (torch.save's RuntimeError); else a bug
                full = disk_full(exc, self._place(stage))
                if full is None:
                    raise
                log.debug("stage %s: disk full", stage.name, exc_info=True)
                error, record = full, StageRecord(stage.name, "failed", error=str(full))
            if record.status == "failed":
                record.seconds = time.perf_counter() - started  # how long it ran before it failed
            records.append(record)
            if i >= last_reader:  # no later stage reads the data: its memory goes back
                self._dataset.clear()
            if record.status in ("ran", "skipped", "cached"):
                self._current.add(stage.name)
            self.on_event(record)
            failures = record.summary.gate_failures() if record.summary is not None else None
            if record.status != "failed" and failures and error is None:
                error = GateFailure(
                    f"validation gates failed: {'; '.join(failures)}{self._kept_after(i)}",
                    hint=gate_hint(failures, record.status, self.config.build.backends, self._build_skips(records)),
                )
            if stop is not None and stage.name == stop:
                break
        self._say_slow_data(records)
        return RunResult(self.workdir, records, error, wall_seconds=time.perf_counter() - began)

    def _build_skips(self, records: list[StageRecord]) -> list[str]:
        """The engines the build stage did not build, each with why (:class:`BuildSummary`'s ``skipped``): this
        run's build, else the one in the workdir (a one-stage ``kiln validate``)."""
        summary = next((r.summary for r in records if r.name == "build" and r.summary is not None), None)
        if isinstance(summary, BuildSummary):
            return summary.skipped
        manifest = read_manifest(self.workdir / "build") or {}
        return list((manifest.get("summary") or {}).get("skipped") or [])

    def _check_ahead(self, stage: Stage) -> None:
        """Before the first stage of the run that does work, the quick checks (:attr:`Stage.checks`) of it and the
        stages after it in this run: a mistake in a later stage's settings fails now, not after minutes of
        training. A run whose stages are all cached runs none (nor imports the code they name)."""
        if self._checked:
            return
        self._checked = True
        for later in self._ahead[self._ahead.index(stage) :]:
            later.check(settings_for(later, self.config))

    def _check_code(self) -> None:
        """Once a run, before its first cache key: :func:`check_user_code` for the stages of this run."""
        if not self._code_checked:
            self._code_checked = True
            check_user_code(self.config, [k for s in self._ahead for k in s.settings.keys()])

    def _say_slow_data(self, records: list[StageRecord]) -> None:
        """Say that calling the user's data function only to hash it was slow: at warning level where it was most
        of deciding which stages are cached and no stage that reads the data ran (then the call was all the run did
        with it, which ``data.skip_unchanged`` skips); else only with -v."""
        took = self._timings.get("data")
        if took is None or took < SLOW_CALL_S:
            return
        readers = {s.name for s in self.stages if "dataset" in s.data}
        wasted = not any(r.status == "ran" and r.name in readers for r in records)
        most = took >= 0.5 * sum(r.check_seconds for r in records)
        if wasted and most:
            log.warning("%s", slow_call_hint("data", "data function", took, " of checking which stages are cached"))
        else:
            log.info("%s", slow_call_hint("data", "data function", took))

    def _kept_after(self, i: int) -> str:
        """Said after failed gates: the folders of the stages after the ``i``-th that an earlier run finished and
        this one does not redo (a package of engines that passed then), so that nobody takes them for this run's."""
        kept = [s.name for s in self.stages[i + 1 :] if (self.workdir / s.name / MANIFEST).is_file()]
        if not kept:
            return ""
        return f" ({', '.join(f'{k}/' for k in kept)} still from an earlier run that passed, not redone)"

    def _refuse_out_of_date(self, stage: Stage) -> None:
        """Stop before ``stage`` reads an upstream stage's folder that is from before the current outputs of the
        stages that one was made from (:func:`out_of_date`): after `kiln train` and `kiln export`, `kiln validate`
        would otherwise compare engines built from the old export with the new model and blame the engines.
        Upstream stages this run already ran or found cached are current by their keys (which hash their inputs'
        outputs), so a whole `kiln run` never stops here: it redoes such stages itself."""
        for up in stage.inputs:
            if up in self._current:
                continue
            stale = out_of_date(self.workdir, up)
            if not stale:
                continue
            first, since = stale[0]
            near, changed = stale[-1]
            made = f"{_names(changed)} {'were' if len(changed) > 1 else 'was'} made anew since {near} ran"
            why = made if near == up else f"it was made from {near}'s output, and {made}"
            raise KilnError(
                f"{up} is out of date: {why} (stage '{stage.name}' reads it)",
                hint=f"run `kiln run` (or `kiln run --from {first}`) with the same config, --set values and "
                f"--workdir to redo what follows {_names(since)}",
            )
        said: set[str] = set()
        for up in stage.inputs:
            if up not in self._current:
                said |= self._refuse_other_settings(stage, up)
        for up in sorted(self._ancestors(stage) - set(stage.inputs) - set(self._current)):
            said |= self._refuse_other_settings(stage, up, code=False, said=said)

    def _ancestors(self, stage: Stage) -> set[str]:
        """The stages whose folders ``stage``'s inputs were made from, transitively (precision for validate, which
        reads build's engines): settings of theirs that differ from this command's shaped what ``stage`` reads."""
        found: set[str] = set()
        todo = [up for up in stage.inputs if up in self.upstream]
        while todo:
            up = todo.pop()
            for further in self.upstream[up].inputs:
                if further in self.upstream and further not in found:
                    found.add(further)
                    todo.append(further)
        return found

    def _refuse_other_settings(
        self, stage: Stage, up: str, code: bool = True, said: set[str] | None = None
    ) -> set[str]:
        """Stop before ``stage`` reads ``up``'s folder where that was made for another model (its config section:
        `kiln export` with other model.params would build another model and load weights trained for the old one);
        warn where other settings of ``up`` differ (`kiln train --set train.epochs=4`, then `kiln export` without
        it: the export reads the 4-epoch weights, which this config would not make), and where the user's code
        changed since: its hash covers the model's whole module and what it imports, so an edited data function or
        comment changes it as an edited model does, and only the user can tell which. Kiln's own code and the data
        are not compared here: a rerun of the stage compares them. ``code``: the user's code too (for the stages
        ``stage`` reads directly; the ones further up share it, and would say it again); ``said``: keys a stage
        nearer ``stage`` was warned of already. Returns the keys it warned of."""
        declared = self.upstream.get(up)
        old = (read_manifest(self.workdir / up) or {}).get("key_parts")
        if declared is None or not isinstance(old, dict):
            return set()
        now = as_recorded(user_parts(declared, self.config, code))  # further up: the code is said nearer already
        changed = what_changed({k: old.get(k) for k in now}, now)
        if code and "user_code" in old and "user_code" not in now:
            changed.append("user_code")
        changed = [c for c in changed if c not in (said or set())]
        if not changed:
            return set()
        listed = ", ".join(c.removeprefix("config.") for c in changed)
        if "config.model" in changed:
            raise KilnError(
                f"{up} is out of date: the model changed since it ran ({listed}), and stage '{stage.name}' reads "
                f"its output",
                hint=f"run `kiln run` (or `kiln {up}`, then the stages after it) with this config and --workdir",
            )
        code = [c.removeprefix("user_code.") for c in changed if c.startswith("user_code")]
        if code:
            log.warning(
                "%s ran before your code changed (%s), and stage '%s' reads its output: if the model changed, "
                "`kiln %s` (or `kiln run`) redoes it; else ignore this",
                up,
                ", ".join(code),
                stage.name,
                up,
            )
        if len(code) < len(changed):
            log.warning(
                "%s was made with other settings than this command's (%s differ), and stage '%s' reads its output: "
                "`kiln run` with this config redoes it; the same --set values as `kiln %s` had keep it",
                up,
                ", ".join(c.removeprefix("config.") for c in changed if not c.startswith("user_code")),
                stage.name,
                up,
            )
        return set(changed)

    def _load_dataset(self) -> Any:
        """The run's dataset, loaded on first use and kept for the run: the user's data function is called once a
        run, so that every stage (and the hash in their keys) sees the same splits, seeded or not."""
        if not self._dataset:
            self._dataset.append(load_dataset(self.config))
        return self._dataset[0]

    def _place(self, stage: Stage) -> str:
        """Where a stage writes, as its errors name it (not the staging folder's temporary name)."""
        return f"{self.workdir / stage.name} (running stage '{stage.name}')"

    def _run_one(self, stage: Stage, forced: bool) -> StageRecord:
        final = self.workdir / stage.name
        t_check = time.perf_counter()
        self._refuse_out_of_date(stage)  # before the key: that may call the user's data function (seconds)
        self._check_code()  # so may a typo in a function's path: said before that call too
        key, parts = cache_key(stage, self.config, self.workdir, self._fingerprints, self._load_dataset, self._timings)
        missing = [
            up
            for up in stage.inputs
            if parts["inputs"][up] is None
            or not outputs_intact(self.workdir / up, read_manifest(self.workdir / up) or {}, self._verified)
        ]
        if missing:
            ran = any((self.workdir / up).exists() for up in missing)
            state = "which is missing or damaged (files deleted or changed since it ran)" if ran else "not yet made"
            raise KilnError(
                f"stage '{stage.name}' needs the output of {missing}, {state}",
                hint=f"run `kiln run --from {missing[0]}` with this command's config and --workdir",
            )
        old = read_manifest(final)
        cached = _summary(stage, old)
        if not forced and cached and old and old.get("key") == key and outputs_intact(final, old, self._verified):
            log.info("%s: cached (key %s)", stage.name, key[:12])
            # no work: the check is its own time; the original run's time stays in the manifest
            return StageRecord(
                stage.name,
                "cached",
                0.0,
                key,
                cached,
                original_seconds=old.get("seconds"),
                check_seconds=time.perf_counter() - t_check,
            )
        changed = what_changed(old.get("key_parts", {}), parts) if old and not forced else []
        changed = code_said_by_module(changed, old.get("key_parts", {}) if old else {}, parts, self.config)
        why = f" (changed since the last run: {', '.join(changed)})" if changed else ""
        if old and not forced and old.get("key") == key:
            why = " (its files were changed or damaged since it ran: rebuilding)"
            log.warning("%s: cached outputs do not match their recorded sha256", stage.name)
        refuse_foreign(stage.name, final, old)
        self._check_ahead(stage)
        log.info("%s: running%s", stage.name, why)
        t0 = time.perf_counter()
        check_seconds = t0 - t_check
        with atomic_dir(final) as out:
            ctx = StageContext(
                stage.name,
                settings_for(stage, self.config),
                self.workdir,
                out,
                {up: self.workdir / up for up in stage.inputs},
                self.progress,
                load_dataset=self._load_dataset if "dataset" in stage.data else None,
                key_parts=parts,
                forced=forced,
            )
            run = stage.function()
            # PyTorch gets the cores a busy machine leaves idle (said once a run), in a stage whose code loads it
            torch = sys.modules.get("torch")
            before = torch.get_num_threads() if torch is not None else 0
            threads = cpu_threads_for_load(say=not self._threads_said) if torch is not None else nullcontext()
            with threads as count:
                self._threads_said |= count is not None and count < before  # lowered: said at info
                summary = run(ctx)
            seconds = time.perf_counter() - t0
            status = summary.status
            outputs = hash_tree(out, exclude=(MANIFEST,))
            write_json_atomic(
                out / MANIFEST,
                {
                    "stage": stage.name,
                    "key": key,
                    "key_parts": parts,
                    # where the user's code was imported from: what `kiln loadtest` imports the data function from
                    "code_roots": code_roots(parts.get("user_code", {})),
                    "status": status,
                    "outputs": outputs,
                    "notes": [n for n in stage.notes if n in outputs],
                    "sizes": {rel: (out / rel).stat().st_size for rel in outputs},
                    "summary": summary.model_dump(mode="json"),
                    "seconds": seconds,
                    "finished": datetime.now(timezone.utc).isoformat(timespec="microseconds"),
                    "environment": environment(*backend_libraries()),
                },
            )
            self._verified[final] = hash_json(outputs)  # just written and hashed: no need to read it again
        return StageRecord(stage.name, status, seconds, key, summary, changed=changed, check_seconds=check_seconds)


def _names(stages: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return stages[0] if len(stages) == 1 else f"{', '.join(stages[:-1])} and {stages[-1]}"


def _summary(stage: Stage, manifest: dict[str, Any] | None) -> Summary | None:
    """A manifest's summary as the stage's typed record; None when it is missing or not that record (a manifest
    of another Kiln version: the stage is redone, not half understood)."""
    if not manifest or not isinstance(manifest.get("summary"), dict):
        return None
    try:
        return stage.summary.model_validate(manifest["summary"])
    except ValueError:
        return None
