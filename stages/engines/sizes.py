"""What ``kiln build FILE`` records of the sizes its engine takes: each named dynamic axis's range and the steps
between its ends, found by running the graph in ONNX Runtime on the CPU at those sizes (the pipeline's export stage
finds them on the PyTorch model), so an engine refuses a size its graph cannot take with Kiln's error instead of the
backend's; nothing where nothing was checked."""

from __future__ import annotations

import itertools
import logging
import math
import random
import re
from collections.abc import Callable
from pathlib import Path

from kiln.core.errors import ConfigError, KilnError
from kiln.core.inputs import random_inputs
from kiln.core.onnx_io import index_ranges, io_specs, load_onnx, metadata_value, ort_session, session_options
from kiln.core.records import EngineMetadata, TensorSpec, Variants, steps_text, takes_size
from kiln.core.shapes import axis_names, refuse_unknown_axes, shapes_flag
from kiln.core.steps import LISTED_PERIOD, aligned_period, listed_steps, sparse_steps
from kiln.core.text import ort_reason
from kiln.stages.engines.backend import SIDECAR
from kiln.stages.export.declaration import GRAPH_STEPS_KEY, MAX_PERIOD, SIZE_PROBES, parse_graph_steps

log = logging.getLogger("kiln.build")

RANGE_PROBES = 128  # sizes tried from a range's failing end inwards, for a range to suggest
STEP_RUNS = 48  # graph runs a search for an axis's steps spends at most (a U-Net at an image's sizes: seconds each)
CORNER_AXES = 4  # other axes set at every combination of their ends, to tell an end that never runs


def checked_ranges(
    graphs: list[Path], sizes: dict[str, list[int]], from_variant: bool = False
) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """The range ``[smallest, largest]`` of ``sizes`` for each dynamic axis besides batch of the graph, and the
    steps (``[period, *residues]``, as :func:`kiln.stages.export.size_steps.size_pattern` gives them) it takes between
    them, found by running the first of ``graphs`` ONNX Runtime opens on the CPU: what ``kiln build FILE`` records,
    so that an engine refuses a size its graph cannot take with Kiln's error instead of the backend's. An axis is
    moved alone, else with the axes that must agree with it (:meth:`SizeProbe.partners`); an end that fails however
    the others are set is an error naming the size. Axes it cannot check (no sizes, no graph runs here, or axes that
    must agree in a way it cannot pair) get no range, with a warning naming them; for axes given no sizes that
    warning waits for the build (:func:`record_checked`), since a backend that needs them (TensorRT's profiles)
    refuses the graph rather than take any size. ``from_variant``: the sizes are those ``kiln precision``
    recorded. Steps the file's export wrote into its metadata (:data:`GRAPH_STEPS_KEY`: sizes where its graph runs
    but does not compute the model) are recorded too, merged with the probe's: a size must be on both; for axes
    given no range they are recorded alone, so the engine still refuses sizes off them."""
    specs = io_specs(load_onnx(graphs[0], load_external_data=False))[0]
    names = axis_names(specs)
    source = "kiln precision's variants.json" if from_variant else "signature.shapes"
    if not from_variant:
        refuse_unknown_axes(sizes, names)
    unnamed = unnamed_axes(specs)
    if unnamed:
        _warn_unnamed(graphs[0], unnamed, names)
        return {}, _recorded_only(graphs, names)
    if not names:
        return {}, {}
    if any(not sizes.get(n) for n in names):  # said once the backend builds without them (record_checked)
        return {}, _recorded_only(graphs, names)
    probe, why = SizeProbe.open(graphs)
    ranges = {n: (min(sizes[n]), max(sizes[n])) for n in names}
    base = probe.base(ranges) if probe else None
    if probe is None or base is None:
        _warn_unchecked(
            names, f"ONNX Runtime could not run the graph on the CPU to check them ({probe.why if probe else why})"
        )
        return {}, _recorded_only(graphs, names)
    checked, steps = _probe_axes(probe, base, ranges, source)
    steps = _with_recorded(steps, recorded_steps(graphs), {n: sizes[n] for n in checked}, graphs[0], source)
    if from_variant:
        _warn_single_sizes({n: sizes[n] for n in checked})
    return checked, steps


def _probe_axes(
    probe: SizeProbe, base: dict[str, int], ranges: dict[str, tuple[int, int]], source: str
) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """The ranges and steps :func:`checked_ranges` records, axis by axis, each moved with its partners."""
    checked, steps, unpaired = {}, {}, []
    for name, (low, high) in ranges.items():
        partners = probe.partners(base, name, ranges, source)
        if partners is None:
            unpaired.append(name)
            continue
        checked[name] = [low, high]
        pattern = probe.pattern(base, name, partners, low, high)
        if pattern is not None:
            steps[name] = pattern
            log.info("axis %s: the graph takes sizes%s only", name, steps_text(pattern, (low, high)))
    if unpaired:
        log.warning(
            "axes %s: the graph runs at their range ends only with other axes at sizes that do not move with them "
            "one for one (axes that must agree otherwise), so the engine records no sizes for them and takes any "
            "(one the graph cannot take fails in the backend, unchecked); give sizes of theirs that run with the "
            "others' ranges to record theirs",
            ", ".join(unpaired),
        )
    return checked, steps


def recorded_steps(graphs: list[Path]) -> dict[str, list[int]]:
    """The axis steps the export of the first of ``graphs`` that has them wrote into its metadata
    (:data:`GRAPH_STEPS_KEY`; a variant of ``kiln precision`` may have them on its FP32 graph only), {} where none
    has."""
    for path in graphs:
        text = metadata_value(load_onnx(path, load_external_data=False), GRAPH_STEPS_KEY)
        if text is not None:
            return parse_graph_steps(text, str(path))
    return {}


def _recorded_only(graphs: list[Path], names: list[str]) -> dict[str, list[int]]:
    """The steps the file's export recorded (:func:`recorded_steps`) for the graph's named axes, where the build
    checks no range of theirs: kept so the engine still refuses a size its graph runs at without computing the
    model, said in the log."""
    steps = {n: p for n, p in recorded_steps(graphs).items() if n in names}
    for name, pattern in steps.items():
        log.info(
            "axis %s: %s records that its graph computes the model at %s%s only (metadata %s): the engine refuses "
            "the others",
            *(name, graphs[0].name, name, steps_text(pattern), GRAPH_STEPS_KEY),
        )
    return steps


def _with_recorded(
    steps: dict[str, list[int]],
    recorded: dict[str, list[int]],
    sizes: dict[str, list[int]],
    src: Path,
    source: str,
) -> dict[str, list[int]]:
    """The probe's ``steps`` merged with those the file's export ``recorded``, for the axes the build checked
    (``sizes``: the sizes given each), said in the log; a given size off the recorded steps is warned of, since
    the engine then refuses it."""
    out = dict(steps)
    for name, pattern in recorded.items():
        if name not in sizes:
            continue
        out[name] = merged_steps(steps.get(name), pattern)
        low, high = min(sizes[name]), max(sizes[name])
        shown = steps_text(pattern, (low, high))
        log.info(
            "axis %s: %s records that its graph computes the model at %s%s only (metadata %s): the engine refuses "
            "the others",
            *(name, src.name, name, shown, GRAPH_STEPS_KEY),
        )
        off = [s for s in sizes[name] if not takes_size(pattern, s)]
        if off:
            log.warning(
                "axis %s: %s gives %s, where the graph of %s does not compute the model (its export recorded %s%s "
                "only): the engine refuses %s; give %s sizes on those steps",
                *(name, source, ", ".join(f"{name}={s}" for s in off), src.name, name, shown),
                *("it" if len(off) == 1 else "them", name),
            )
    return out


def merged_steps(found: list[int] | None, recorded: list[int]) -> list[int]:
    """The steps (``[period, *residues]``) of the sizes both ``found`` (None: every size) and ``recorded`` take: the
    residues of the longer period repeated up to the common one, kept where the other takes them. Where either lists
    its sizes (:func:`~kiln.core.steps.listed_steps`), those of them the other takes, listed: its period is no step,
    so a multiple of it would invent sizes neither probe ran."""
    if found is None:
        return recorded
    listed = next((steps for steps in (found, recorded) if steps[0] >= LISTED_PERIOD), None)
    if listed is not None:
        other = recorded if listed is found else found
        return listed_steps([size for size in listed[1:] if takes_size(other, size)])
    period = math.lcm(found[0], recorded[0])
    longer = max(found, recorded, key=lambda steps: steps[0])
    sizes = {r + k * longer[0] for r in longer[1:] for k in range(period // longer[0])}
    return [period, *sorted(r for r in sizes if takes_size(found, r) and takes_size(recorded, r))]


class SizeProbe:
    """A graph run by ONNX Runtime on the CPU on random inputs (one row, integer inputs within the tables they
    index) at chosen sizes of its named dynamic axes: whether it takes them."""

    def __init__(self, path: Path) -> None:
        graph = load_onnx(path, load_external_data=False)
        self.specs = io_specs(graph)[0]
        self.ints = index_ranges(graph)
        opts = session_options()
        opts.log_severity_level = 4  # a size the graph cannot take is an answer here, not an error to log
        self.session = ort_session(path, options=opts)
        self.why = ""
        self._seen: dict[tuple[tuple[str, int], ...], str | None] = {}

    @classmethod
    def open(cls, graphs: list[Path]) -> tuple[SizeProbe | None, str]:
        """A probe of the first of ``graphs`` ONNX Runtime opens on the CPU, else None and its reason for the
        first graph."""
        first = ""
        for path in graphs:
            try:
                return cls(path), ""
            except KilnError as exc:
                first = first or exc.message
        return None, first or "unknown"

    def fails(self, point: dict[str, int]) -> str | None:
        """ONNX Runtime's error running the graph at ``point`` (axis name -> size), or None where it runs."""
        key = tuple(sorted(point.items()))
        if key not in self._seen:
            self._seen[key] = self._run(point)
        return self._seen[key]

    def _run(self, point: dict[str, int]) -> str | None:
        dims = {s.name: {i: point[d] for i, d in enumerate(s.shape) if i and d in point} for s in self.specs}
        try:
            self.session.run(None, random_inputs(self.specs, 1, dims, int_ranges=self.ints))
        except Exception as exc:  # the graph cannot take these sizes (or these random values)
            return ort_reason(exc)
        return None

    def base(self, ranges: dict[str, tuple[int, int]]) -> dict[str, int] | None:
        """The sizes the other axes stay at while one is probed: every axis at its smallest, else at its largest
        where only those run; None where neither runs (random inputs the graph cannot take, or neither size)."""
        for end in (0, 1):
            point = {n: r[end] for n, r in ranges.items()}
            why = self.fails(point)
            if why is None:
                return point
            self.why = self.why or why
        return None

    def partners(
        self, base: dict[str, int], name: str, ranges: dict[str, tuple[int, int]], source: str
    ) -> list[str] | None:
        """The axes that move with ``name`` size for size (none where it runs at both ends alone; else the first
        of its linked axes, each other axis, all of them, with which both ends run inside every range). None where
        no such move runs but an end runs with the others at their own ends (axes that must agree otherwise); an
        end that runs with none of those is an error naming it."""
        low, high = ranges[name]
        for group in _groups(name, ranges):
            points = [_moved(base, name, end, group) for end in (low, high)]
            if all(_inside(p, ranges) for p in points) and all(self.fails(p) is None for p in points):
                return group
        for end in (low, high):
            why = self.fails({**base, name: end})
            if why is not None and not any(self.fails(p) is None for p in _corners(name, end, ranges)):
                raise ConfigError(
                    f"{source} gives axis {name} sizes from {low} to {high}, but the graph does not run at "
                    f"{name}={end}: {why}",
                    hint=_taken_hint(lambda s: self.fails({**base, name: s}) is None, name, low, high),
                )
        return None

    def pattern(self, base: dict[str, int], name: str, group: list[str], low: int, high: int) -> list[int] | None:
        """The steps of ``name`` between ``low`` and ``high``, moved with ``group``, the others at ``base``
        (:func:`size_steps`)."""
        return size_steps(lambda size: self.fails(_moved(base, name, size, group)) is None, low, high, name)


def _groups(name: str, ranges: dict[str, tuple[int, int]]) -> list[list[str]]:
    """The sets of axes to move with ``name``, in the order tried: none; those linked to it (an equal range, or a
    name that is arithmetic of its name, as ``past_sequence_length + 1`` of ``past_sequence_length``); each other
    axis; all of them."""
    others = [n for n in ranges if n != name]
    linked = [n for n in others if ranges[n] == ranges[name] or _related(name, n)]
    groups = [[], linked, *([n] for n in others), others]
    return [g for i, g in enumerate(groups) if (g or not i) and g not in groups[:i]]


def _related(a: str, b: str) -> bool:
    """Whether one axis name is an expression of the other (``past_sequence_length + 1``)."""
    words = {a: set(re.findall(r"[A-Za-z_]\w*", a)), b: set(re.findall(r"[A-Za-z_]\w*", b))}
    return a != b and (a in words[b] or b in words[a])


def _moved(base: dict[str, int], name: str, size: int, group: list[str]) -> dict[str, int]:
    """``base`` with ``name`` at ``size`` and each axis of ``group`` moved by as much."""
    return {**base, name: size, **{n: base[n] + size - base[name] for n in group}}


def _inside(point: dict[str, int], ranges: dict[str, tuple[int, int]]) -> bool:
    return all(ranges[n][0] <= s <= ranges[n][1] for n, s in point.items())


def _corners(name: str, size: int, ranges: dict[str, tuple[int, int]]) -> list[dict[str, int]]:
    """``name`` at ``size`` with the other axes at each combination of their range ends (all low or all high only,
    beyond :data:`CORNER_AXES` others)."""
    others = [n for n in ranges if n != name]
    combos = (
        itertools.product((0, 1), repeat=len(others))
        if len(others) <= CORNER_AXES
        else [(0,) * len(others), (1,) * len(others)]
    )
    return [{name: size, **{n: ranges[n][e] for n, e in zip(others, ends)}} for ends in combos]


class _OutOfRuns(Exception):
    """The run budget of a steps search is spent."""


def size_steps(runs: Callable[[int], bool], low: int, high: int, name: str) -> list[int] | None:
    """``[period, *residues]`` of the sizes from ``low`` to ``high`` that ``runs`` (both ends run), or None where it
    runs at every size tried, as :func:`kiln.stages.export.size_steps.size_pattern` finds them (its draw of sizes first,
    the same answer where every size runs), for at most :data:`STEP_RUNS` runs: a period of a power of two at
    ``low`` is tried first (a few sizes each, the cheap common case of pooling), then sizes one by one from
    ``low`` until one period repeats twice; a range probed whole without one keeps its sizes, a step between them
    only where confirmed past it (:func:`~kiln.core.steps.sparse_steps`). Past the budget, no steps, with a
    warning: a graph run costs seconds at an image's sizes, and the two periods of size by size probing hundreds of
    runs."""

    top = min(high, low + 2 * MAX_PERIOD)
    ok = {low: True, high: True}

    def seen(size: int) -> bool:
        if size not in ok:
            if len(ok) >= STEP_RUNS + 2:
                raise _OutOfRuns
            ok[size] = runs(size)
        return ok[size]

    inside = range(low + 1, top + 1)
    drawn = sorted({*inside[:3], *random.Random(0).sample(inside, min(SIZE_PROBES, len(inside)))})
    try:
        if all(seen(size) for size in drawn):
            return None
        period = aligned_period(seen, ok, low, top) or _scanned_period(seen, ok, low, top)
        if period is None and top == high:  # the range probed whole: its sizes, a step only where confirmed
            return sparse_steps(seen, ok, low, top)
    except _OutOfRuns:
        log.warning(
            "axis %s: steps not fully probed (%d runs of the graph, the most the build spends): the range %d to %d "
            "is recorded without steps, so a size between them the graph cannot take fails in the backend; give "
            "the sizes it takes in signature.shapes to check those alone",
            name,
            STEP_RUNS,
            low,
            high,
        )
        return None
    if period is None:
        log.warning(
            "axis %s: the graph runs at some sizes from %d to %d and not at others, in no pattern of period %d or "
            "less: no steps recorded, so a size it cannot take fails in the backend",
            name,
            low,
            high,
            MAX_PERIOD,
        )
        return None
    return [period, *sorted({size % period for size, good in ok.items() if good})]


def _fits(ok: dict[int, bool], period: int) -> bool:
    """Whether every two sizes tried a whole number of ``period`` apart gave the same answer."""
    first: dict[int, bool] = {}
    return all(first.setdefault(size % period, good) == good for size, good in ok.items())


def _scanned_period(seen: Callable[[int], bool], ok: dict[int, bool], low: int, top: int) -> int | None:
    """The shortest period of the sizes that run, found by running sizes one by one from ``low``: the first that
    holds over two whole periods of them and every size tried; None where none does up to ``top``."""
    for size in range(low, top + 1):
        seen(size)
        span = size - low + 1
        period = next((p for p in range(2, span // 2 + 1) if _fits(ok, p)), None)
        if period is not None:
            return period
    return None


def _taken_hint(runs: Callable[[int], bool], name: str, low: int, high: int) -> str:
    """The fix for a range whose end the graph cannot take: the widest range inside it whose ends it takes."""
    up = next((s for s in range(low, min(high, low + RANGE_PROBES) + 1) if runs(s)), None)
    down = next((s for s in range(high, max(low, high - RANGE_PROBES) - 1, -1) if runs(s)), None)
    if up is None or down is None or up > down:
        return f"give signature.shapes sizes of {name} the graph runs at (it ran at none from {low} to {high})"
    return f"give signature.shapes sizes of {name} the graph runs at, e.g. {name}: [{up}, {down}]"


def _warn_unchecked(names: list[str], why: str) -> None:
    """Said where the build records no range for the dynamic axes ``names``: it checked none of their sizes."""
    log.warning(
        "axes %s: %s, so the engine records no sizes for them and takes any (one the graph cannot take fails in the "
        "backend, unchecked); give %s to probe and record the sizes it takes",
        ", ".join(names),
        why,
        shapes_flag(names),
    )


def unnamed_axes(specs: list[TensorSpec]) -> list[tuple[str, int]]:
    """``(input, axis)`` for each dynamic axis besides the batch that the graph gives no name (``?``: neither a size
    nor a name, as tf2onnx and some converters write them): ``signature.shapes`` cannot size it, and the probe cannot
    run the graph without a size for it."""
    return [(s.name, i) for s in specs for i, d in enumerate(s.shape) if i and d in (0, "")]


def _warn_unnamed(path: Path, unnamed: list[tuple[str, int]], names: list[str]) -> None:
    """Said where the graph has dynamic axes with no name (:func:`unnamed_axes`), named ``input[axis]``: the build
    records no sizes for any axis. The fix names them in a copy of the file (each apart: one name for axes that are
    one is the user's to give) and sizes every axis."""
    given = [_dim_name(k, axis) for k, axis in unnamed]
    sets = "; ".join(f"d[{k!r}][{axis}].dim_param = {n!r}" for (k, axis), n in zip(unnamed, given))
    named = path.with_name(f"{path.stem}.named.onnx")
    command = (
        f'python -c "import onnx; m = onnx.load({str(path)!r}); '
        f'd = {{v.name: v.type.tensor_type.shape.dim for v in m.graph.input}}; {sets}; onnx.save(m, {str(named)!r})"'
    )
    log.warning(
        "axes %s have no name in the graph, and signature.shapes sizes axes by name, so the engine records no sizes "
        "for %s and takes any (one the graph cannot take fails in the backend, unchecked); name them in the file "
        "(one name for axes that are one): %s, then build %s with %s to probe and record the sizes it takes",
        ", ".join(f"{k}[{axis}]" for k, axis in unnamed),
        "them or the graph's other axes" if names else "them",
        command,
        named.name,
        shapes_flag(sorted({*names, *given})),
    )


def _dim_name(name: str, axis: int) -> str:
    """A name for axis ``axis`` of input ``name`` that YAML reads as text in a flow mapping (``input_1:0`` ->
    ``input_1_0_1``)."""
    return f"{re.sub(r'[^A-Za-z0-9_]+', '_', name).strip('_') or 'input'}_{axis}"


def _warn_single_sizes(sizes: dict[str, list[int]]) -> None:
    """Said where a variant's recorded sizes pin a dynamic axis to one size (its calibration data's): the engine
    refuses every other, though its graph may take them."""
    single = {n: v[0] for n, v in sizes.items() if len(set(v)) == 1}
    if single:
        log.warning(
            "the engine takes %s only: the sizes kiln precision recorded (its data's, in variants.json); give %s to "
            "probe and record a range",
            ", ".join(f"{n}={v}" for n, v in single.items()),
            shapes_flag(sorted(sizes)),
        )


def probe_graphs(src: Path, made_as: str | None) -> list[Path]:
    """The graphs whose sizes the build probes: ``src``, then, for a variant of ``kiln precision``, its FP32 graph
    (same shapes; ONNX Runtime's CPU provider may lack kernels for an FP16 graph)."""
    if not made_as:
        return [src]
    try:
        fp32 = Variants.read(src.parent.parent / "variants.json", hint="rerun `kiln precision`").variants.get("fp32")
    except KilnError:
        return [src]
    other = src.parent.parent / fp32.path if fp32 else None
    return [src, other] if other is not None and other.is_file() and other.resolve() != src.resolve() else [src]


def record_checked(out: Path, meta: EngineMetadata, ranges: dict[str, list[int]]) -> EngineMetadata:
    """``meta`` with only the axis ranges the build checked (:func:`checked_ranges`); the sizes it was given still
    shaped its profiles and audit. Called once the backend built the engine: where its graph's named axes were
    given no sizes, it takes any, which is said here, not before a backend that refuses them (TensorRT) fails."""
    _warn_unsized(meta)
    kept = {k: v for k, v in meta.axis_ranges.items() if k in ranges}
    if kept != meta.axis_ranges:
        meta.axis_ranges = kept
        meta.write(out / SIDECAR)
    return meta


def _warn_unsized(meta: EngineMetadata) -> None:
    """Said of an engine built from a graph whose named dynamic axes were not all given sizes: it records none
    (:func:`checked_ranges`) and takes any. Axes of no name were said already (:func:`_warn_unnamed`)."""
    names = axis_names(meta.inputs)
    missing = [n for n in names if n not in meta.axis_ranges]
    if missing and not unnamed_axes(meta.inputs):
        _warn_unchecked(names, "no sizes were given" + (f" for {', '.join(missing)}" if missing != names else ""))
