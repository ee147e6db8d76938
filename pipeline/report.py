"""report.json (machine-readable) and report.md (for people), written into the workdir after every run."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from kiln.core.artifacts import write_json_atomic, write_text_atomic
from kiln.core.env import environment
from kiln.core.records import ValidationResult
from kiln.core.stage import Stage, Summary
from kiln.core.text import fmt
from kiln.pipeline.config import KilnConfig
from kiln.pipeline.fingerprints import FINGERPRINTS
from kiln.pipeline.runner import RunResult, cache_key, outputs_intact, read_manifest
from kiln.pipeline.stage_list import STAGE_NAMES, STAGES, stage_named
from kiln.stages.engines.registry import BACKENDS, backend_libraries
from kiln.stages.validate.declaration import REQUIRED, UNVALIDATED
from kiln.stages.validate.report import inputs_record
from kiln.stages.validate.report import report_section as validate_section

__all__ = [
    "build_report",
    "render_markdown",
    "write_report",
    "validation_of",
    "fmt",
    "result_line",
    "seconds_cell",
    "times_line",
]


def build_report(result: RunResult, config: KilnConfig, workdir: Path | None = None) -> dict[str, Any]:
    """This run's stages, plus (with ``workdir``) the stages it did not touch as their manifests left them, so a
    one-stage command (`kiln package`) does not shrink the report to that stage."""
    ran = {
        r.name: {
            "status": r.status,
            "seconds": round(r.seconds, 3),
            **({"error": r.error} if r.error else {}),
            **({"original_seconds": round(r.original_seconds, 3)} if r.original_seconds is not None else {}),
            "check_seconds": round(r.check_seconds, 3),
            "summary": r.summary.model_dump(mode="json") if r.summary is not None else {},
        }
        for r in result.records
    }
    stages: dict[str, Any] = {}
    for name in STAGE_NAMES:
        if name in ran:
            stages[name] = ran[name]
        elif workdir is not None and (m := read_manifest(workdir / name)) is not None:
            # stale too where a stage it reads is (a build kept from before the precision this run just made)
            upstream_stale = any(stages.get(up, {}).get("status") == "stale" for up in stage_named(name).inputs)
            status = "kept" if not upstream_stale and _current(name, m, config, workdir) else "stale"
            stages[name] = {
                "status": status,
                "seconds": 0.0,
                "original_seconds": round(m.get("seconds", 0.0), 3),
                "summary": m.get("summary", {}),
            }
    validation = stages.get("validate", {}).get("summary") or None
    if stages.get("validate", {}).get("status") == "stale":
        validation = None  # results of other settings or engines: not this configuration's verdict
    ok = result.ok and (validation or {}).get("passed") is not False
    report: dict[str, Any] = {
        "name": config.name,
        "ok": ok,
        "stages": stages,
        "environment": environment(*backend_libraries()),
    }
    report |= _times(result)
    if result.error is not None:
        report["error"] = str(result.error)
    if validation and _random_data(config):
        report["inputs"] = inputs_record(None)
    higher = config.section("validate").metric_higher_is_better  # the direction its metric gate took
    if validation and higher is not None:
        report["metric_higher_is_better"] = higher
    if validation:
        report["validation"] = {
            k: validation[k]
            for k in (
                "passed",
                "baseline",
                "baselines",
                "engines",
                "failures",
                "speed_vs_fp32",
                "dropped",
                "chosen",
                "choice_notes",
                "timing",
                "peaks",
                "batch_coupled",  # report.md says those outputs are served unbatched
                "one_class",  # the Result line says a pass on it rests on the class's share
            )
            if k in validation
        }
    return report


def _times(result: RunResult) -> dict[str, float]:
    """The run's wall time and, apart from the stages' own seconds, what deciding which were cached took (their
    keys: loading and hashing the user's data, reading the device's facts, checking their inputs' files)."""
    times = {"check_seconds": round(result.check_seconds, 3)}
    if result.wall_seconds is not None:
        times["wall_seconds"] = round(result.wall_seconds, 3)
    return times


def _random_data(config: KilnConfig) -> bool:
    """Does this run validate on random inputs (``model.onnx`` with no data and no PyTorch model)?"""
    return bool(config.model.onnx) and not config.data.name and "name" not in config.model.model_fields_set


def _current(name: str, manifest: dict[str, Any], config: KilnConfig, workdir: Path) -> bool:
    """Would this configuration reuse the stage's results (same settings, code and inputs, files intact)? User
    data is not re-read for this: a one-stage command must not load a dataset or run a reader it does not use."""
    no_data = {fingerprint: None for fingerprint in FINGERPRINTS}
    try:
        _, parts = cache_key(stage_named(name), config, workdir, no_data)
    except Exception:  # e.g. a user module that no longer imports: certainly not current
        return False
    recorded = {k: v for k, v in manifest.get("key_parts", {}).items() if k != "user_data"}
    return parts == recorded and outputs_intact(workdir / name, manifest)


def _typed(stage: Stage, summary: dict[str, Any] | None) -> Summary | None:
    """A summary from report.json as the stage's record; None where there is none, or one of another version."""
    if not summary:
        return None
    try:
        return stage.summary.model_validate(summary)
    except ValueError:
        return None


def validation_of(report: dict[str, Any]) -> ValidationResult | None:
    """The report's validation as the typed record (None when this configuration has no current validation)."""
    v = report.get("validation")
    return ValidationResult.parse(v, "report validation", hint="rerun `kiln run`") if v else None


def result_line(report: dict[str, Any]) -> str:
    """PASSED / FAILED, and which engines were built but could not be validated on this machine: a pass that
    covers only some engines must say so where the verdict is read, not only in a table cell. A run that ended well
    without a validation of this configuration (a one-stage command after a change, `--until build`) says what it
    did and that nothing validated it (:func:`_unvalidated`), not PASSED."""
    unvalidated = _unvalidated(report)
    if unvalidated is not None:
        return unvalidated
    verdict = "PASSED" if report["ok"] else "FAILED"
    if report.get("validation") and report.get("inputs", {}).get("kind") == "random":
        verdict += " on RANDOM inputs (no data: agreement on random arrays says little about real ones)"
    engines = (report.get("validation") or {}).get("engines", [])
    unchecked = [e for e in engines if e.get("status") != "validated"]
    if unchecked:
        devices = sorted({e.get("device", "?").upper() for e in unchecked})
        many = len(unchecked) > 1
        why = "; ".join(sorted({e["reason"] for e in unchecked if e.get("reason")}))
        why = f": {why}" if why else ", which this machine does not have"  # a GPU host without the backend's runtime
        verdict += (
            f", {len(unchecked)} engine{'s' if many else ''} built but not validated: "
            f"{', '.join(e['name'] for e in unchecked)} ({'they target' if many else 'it targets'} "
            f"{' / '.join(devices)}{why}; validate {'them' if many else 'it'} where "
            f"{'they' if many else 'it'} will run)"
        )
    missing = [*_missing_precisions(report, engines), *_unmade_graph_engines(report, engines)]
    return verdict + "".join(f"; {why}" for why in missing) + _one_class(report)


def _one_class(report: dict[str, Any]) -> str:
    """What qualifies the verdict where the reference answers one class at every held-out row or position
    (``one_class``): accuracy is then that class's share and top-1 agreement asks an engine only to keep it, which
    one answering a constant does, so a pass says little until a metric that ranks the rows gates it. Said where
    the verdict is read, not only in the log; empty where the reference answers more than one class."""
    v = report.get("validation") or {}
    if not v.get("one_class"):
        return ""
    metric = (v.get("baseline") or {}).get("metric_name")
    gate = (
        f"validate.metric ({metric}) is the gate that counts"
        if metric and not (v.get("baseline") or {}).get("metric_default")
        else "check that the model is trained, or gate by a ranking metric (validate.metric: a ROC AUC of the logit)"
    )
    return (
        f" — {'but' if report['ok'] else 'and'} the reference {v['one_class']}: its accuracy is that class's share "
        f"and top-1 agreement only asks an engine to keep it, which one answering a constant does; {gate}"
    )


def _unvalidated(report: dict[str, Any]) -> str | None:
    """The result line of a run that ended without error and without a current validation: the stages it did, and
    that validation is out of date (made with other settings or inputs: stale) or not made yet. None where the
    report has a validation, or the run failed, or it names no stages (a report of before their statuses)."""
    stages = report.get("stages") or {}
    if not report["ok"] or report.get("validation") or not stages:
        return None
    done = [n for n, s in stages.items() if s.get("status") in ("ran", "cached", "skipped")]
    did = f"{', '.join(done)} done; " if done else ""
    if stages.get("validate", {}).get("status") == "stale":
        return f"{did}validation out of date (made with other settings or inputs): run `kiln run` to validate again"
    return f"{did}not validated yet: run `kiln run` to validate the engines"


def _missing_precisions(report: dict[str, Any], engines: list[dict[str, Any]]) -> list[str]:
    """A precision the run asked for that no engine validated here has, with its reason: the precision stage's
    record of a variant that failed (all-zero calibration data), else the build's (an INT8 graph not made: too little
    of it ran in INT8 to pass the gates). A pass without it says so beside the verdict, on every run; one skipped
    only for want of its kernels on the device, and not in ``precision.required``, as the expected skip it is
    (:func:`_expected_skip`). One whose engines were built for another machine only is said by the build's skips
    of it here (:func:`_not_validated_here`): the verdict names those engines already."""
    if not engines:  # the run stopped before validation: its error says why
        return []
    stages = report.get("stages", {})
    precision = stages.get("precision", {}).get("summary") or {}
    failed: dict[str, str] = precision.get("failed") or {}
    asked = [*(precision.get("variants") or {}), *failed]
    skipped = (stages.get("build", {}).get("summary") or {}).get("skipped") or []
    built = {e.get("precision") for e in engines}
    validated = {e.get("precision") for e in engines if e.get("status") == "validated"}
    failures = (report.get("validation") or {}).get("failures") or []
    out = []
    for p in dict.fromkeys(p for p in asked if p not in validated):
        if p in built:  # built for another machine only
            if said := _not_validated_here(skipped, p, failures):
                out.append(said)
            continue
        if p not in failed and (expected := _expected_skip(skipped, p, failures)):
            out.append(expected)
            continue
        why = failed.get(p) or _skipped_reason(skipped, p)
        out.append(f"no {p} engine" + (f" ({why})" if why else ""))
    return out


# How the build's fix starts for an engine whose runtime has no kernels of its precision on its device (ONNX
# Runtime's CPU provider runs FP16 graphs in FP32): a skip the run's settings expect, no failure
NO_KERNELS_FIX = "(fix: none needed"


# A backend's plan that builds a precision on a GPU only (the torch backend's "FP16 on the GPU", "for CUDA GPUs")
GPU_ONLY = re.compile(r"on the GPU|for CUDA GPUs")


def _expected_skip(skipped: list[str], precision: str, failures: list[str]) -> str | None:
    """The result line's words for a precision no engine was built in only because no backend of the run has its
    kernels on the device (every skip of it the build's "none needed", or a backend's plan that builds it on a GPU
    only, :data:`GPU_ONLY`), where ``precision.required`` does not ask for it (no validation ``failures`` of it): a
    normal skip on a CPU, said as one. None: any other case."""
    mine = [line for line in skipped if _of(line, precision)]
    if not mine or not all(NO_KERNELS_FIX in line or GPU_ONLY.search(line) for line in mine):
        return None
    if any(f.startswith(REQUIRED) and f"no {precision} engine" in f for f in failures):
        return None
    names = [line.partition(": ")[0] for line in mine]
    if {_device(name, precision) for name in names} != {"cpu"}:  # a GPU has the kernels: a skip there is no norm
        return None
    return (
        f"{precision} skipped on CPU, as expected: no {precision} kernels there for {', '.join(names)}; a GPU "
        "backend builds them"
    )


def _device(name: str, precision: str) -> str | None:
    """The device of the engine ``name`` of ``precision`` by the registered backends' engine names; None: none."""
    for backend in BACKENDS.values():
        for device in backend.devices:
            if backend.engine_name(device, precision) == name:
                return device
    return None


def _unmade_graph_engines(report: dict[str, Any], engines: list[dict[str, Any]]) -> list[str]:
    """The engines not built because the graph they read was not made, where their precision has other engines
    (an INT8 Q/DQ graph short of the gates while ONNX Runtime CPU's own INT8 graph passed: no TensorRT INT8 engine),
    grouped by reason: :func:`_missing_precisions` says only precisions with no engine at all."""
    if not engines:
        return []
    stages = report.get("stages", {})
    variants = (stages.get("precision", {}).get("summary") or {}).get("variants") or {}
    skipped = (stages.get("build", {}).get("summary") or {}).get("skipped") or []
    built = {e.get("precision") for e in engines}
    unbuilt: dict[str, list[str]] = {}
    for line in skipped:
        name, _, why = line.partition(": ")
        precision = name.rpartition("-")[2]
        unmade = (variants.get(precision) or {}).get("unmade")
        if precision in built and unmade and why.startswith(unmade):
            unbuilt.setdefault(unmade, []).append(name)
    return [f"no {', '.join(names)} engine{'s' if len(names) > 1 else ''} ({why})" for why, names in unbuilt.items()]


def _not_validated_here(skipped: list[str], precision: str, failures: list[str]) -> str | None:
    """The result line's words for a precision whose engines were all built for another machine (a TensorRT INT8
    engine on a CPU host): the build's skips of its engines here, one clause each, where one is no expected skip
    (:func:`_expected_skip`: no kernels of it on the CPU) or ``precision.required`` asks for it. None: nothing to
    add to the verdict's "built but not validated"."""
    reasons = _skip_reasons(skipped, precision)
    required = any(f.startswith(REQUIRED) and f"{precision} engines {UNVALIDATED}" in f for f in failures)
    expected = all(NO_KERNELS_FIX in line or GPU_ONLY.search(line) for line in skipped if _of(line, precision))
    if not reasons or (expected and not required):
        return None
    clauses = [
        why.removeprefix("engine ") if why.startswith(f"engine {name} ") else f"{name}: {why}"
        for name, why in reasons.items()
    ]
    return f"no {precision} engine validated on this machine ({'; '.join(clauses)})"


def _of(line: str, precision: str) -> bool:
    """Whether the build's ``skipped`` line ("name: why") is of an engine of ``precision``."""
    return line.partition(": ")[0].endswith(f"-{precision}")


def _skip_reasons(skipped: list[str], precision: str) -> dict[str, str]:
    """The build's reasons for not building the engines of ``precision`` (its ``skipped`` lines read "name: why
    (fix: ...)"), without the fixes, by engine name."""
    reasons = {}
    for line in skipped:
        name, _, why = line.partition(": ")
        if _of(line, precision) and why:
            reasons[name] = " ".join(why.split(" (fix: ")[0].split())
    return reasons


def _skipped_reason(skipped: list[str], precision: str) -> str:
    """The build's reasons for not building the engines of ``precision`` (:func:`_skip_reasons`): one engine's
    alone, several each after its name (a CPU backend without FP16 kernels and a GPU one whose parser failed are two
    reasons); empty where it names none."""
    reasons = _skip_reasons(skipped, precision)
    if len(reasons) == 1:
        return next(iter(reasons.values()))
    return "; ".join(f"{name}: {why}" for name, why in reasons.items())


def seconds_cell(stage: dict[str, Any]) -> str:
    """A stage's own seconds in this run (none for a cached one: its check is counted apart, :func:`times_line`),
    with how long a cached stage took when it ran."""
    original = stage.get("original_seconds")
    if stage["status"] in ("cached", "kept", "stale") and original is not None:
        return f"{stage['seconds']:.2f} (ran in {original:.2f})"
    return f"{stage['seconds']:.2f}"


def times_line(report: dict[str, Any]) -> str:
    """The run's wall time and the part of it the stages' rows leave out: the cache checks (and the data loading
    the first of them does)."""
    return (
        f"Run: {report['wall_seconds']:.2f} s wall time, of which {report.get('check_seconds', 0.0):.2f} s deciding "
        "which stages are cached (their keys: loading and hashing the data, the device's facts, the inputs' files)"
    )


def render_markdown(report: dict[str, Any]) -> str:
    lines = [f"# Kiln report: {report['name']}", "", f"**Result: {result_line(report)}**", ""]
    random = report.get("validation") and report.get("inputs", {}).get("kind") == "random"
    if random:  # under the verdict it qualifies, not after the tables
        lines += [f"**Inputs: {report['inputs']['note']}** (give data.name for real ones).", ""]
    if "error" in report:
        lines += [f"> {report['error']}", ""]
    lines += ["## Stages", "", "| stage | status | seconds |", "|---|---|---|"]
    lines += [f"| {n} | {s['status']} | {seconds_cell(s)} |" for n, s in report["stages"].items()]
    if "wall_seconds" in report:
        lines += ["", times_line(report)]
    if any(s["status"] == "kept" for s in report["stages"].values()):
        lines += ["", "*kept*: not part of this command; its results are those already in the workdir."]
    if any(s["status"] == "stale" for s in report["stages"].values()):
        lines += [
            "",
            "*stale*: not part of this command, and made with other settings or inputs than this "
            "configuration's: `kiln run` redoes it.",
        ]
    validation = validation_of(report)
    if validation is not None:  # the verdict first, then each stage's own section in pipeline order
        lines += validate_section(validation, report.get("metric_higher_is_better"), random=bool(random))
    for stage in STAGES:
        summary = _typed(stage, report["stages"].get(stage.name, {}).get("summary"))
        if stage.report is not None and summary is not None and stage.name != "validate":
            lines += stage.report(summary)
    env = report["environment"]
    lines += [
        "",
        "## Environment",
        "",
        ", ".join(f"{k} {v}" for k, v in env["versions"].items()),
        f"python {env['python']}, GPU: {env.get('gpu', 'none')}, ONNX Runtime CPU INT8 kernels: "
        f"{env.get('cpu_int8_kernels', 'fast')}",
        "",
    ]
    return "\n".join(lines)


def write_report(result: RunResult, config: KilnConfig, workdir: Path) -> dict[str, Any]:
    report = build_report(result, config, workdir)
    write_json_atomic(workdir / "report.json", report, sort_keys=False)  # keep stages in pipeline order
    write_text_atomic(workdir / "report.md", render_markdown(report))
    return report
