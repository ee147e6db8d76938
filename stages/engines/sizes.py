"""What ``kiln build FILE`` records of the sizes its engine takes: each named dynamic axis's range and the steps
between its ends, found by running the graph in ONNX Runtime on the CPU at those sizes (the pipeline's export stage
finds them on the PyTorch model), so an engine refuses a size its graph cannot take with Kiln's error instead of the
backend's; nothing where nothing was checked."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from kiln.core.errors import ConfigError, KilnError
from kiln.core.inputs import random_inputs
from kiln.core.onnx_io import index_ranges, io_specs, load_onnx, ort_session, session_options
from kiln.core.records import EngineMetadata, Variants, steps_text
from kiln.core.shapes import axis_names, shapes_flag
from kiln.core.text import first_line
from kiln.stages.engines.backend import SIDECAR

log = logging.getLogger("kiln.build")

RANGE_PROBES = 128  # sizes tried from a range's failing end inwards, for a range to suggest


def checked_ranges(
    graphs: list[Path], sizes: dict[str, list[int]], from_variant: bool = False
) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """The range ``[smallest, largest]`` of ``sizes`` for each dynamic axis besides batch of the graph, and the
    steps (``[period, *residues]``, :func:`kiln.stages.export.stage.size_pattern`) it takes between them, found by
    running the first of ``graphs`` ONNX Runtime opens on the CPU: what ``kiln build FILE`` records, so that an
    engine refuses a size its graph cannot take with Kiln's error instead of the backend's. Both ends of every range
    must run (else an error naming the size). Axes it cannot check (no sizes, or no graph runs here) get no range,
    with a warning naming them. ``from_variant``: the sizes are those ``kiln precision`` recorded."""
    names = axis_names(io_specs(load_onnx(graphs[0], load_external_data=False))[0])
    source = "kiln precision's variants.json" if from_variant else "signature.shapes"
    unknown = sorted(set(sizes) - set(names))
    if unknown and not from_variant:
        raise ConfigError(
            f"signature.shapes names axes {unknown}; the graph's dynamic axes besides batch are {names or 'none'}",
            hint="key signature.shapes by the names the graph gives its axes"
            + (f": {shapes_flag(names)}" if names else " (or leave it out)"),
        )
    missing = [n for n in names if not sizes.get(n)]
    if missing:
        _warn_unchecked(names, "no sizes were given" + (f" for {', '.join(missing)}" if missing != names else ""))
        return {}, {}
    probe = SizeProbe.open(graphs)
    base = probe.base({n: min(sizes[n]) for n in names}, {n: max(sizes[n]) for n in names}) if probe else None
    if probe is None or base is None:
        why = probe.why if probe else SizeProbe.why_not(graphs)
        _warn_unchecked(names, f"ONNX Runtime could not run the graph on the CPU to check them ({why})")
        return {}, {}
    steps = {}
    for name in names:
        low, high = min(sizes[name]), max(sizes[name])
        pattern = probe.pattern(base, name, low, high, source)
        if pattern is not None:
            steps[name] = pattern
            log.info("axis %s: the graph takes sizes%s only", name, steps_text(pattern, (low, high)))
    if from_variant:
        _warn_single_sizes({n: sizes[n] for n in names})
    return {n: [min(sizes[n]), max(sizes[n])] for n in names}, steps


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
    def open(cls, graphs: list[Path]) -> SizeProbe | None:
        """A probe of the first of ``graphs`` ONNX Runtime opens on the CPU, or None."""
        for path in graphs:
            try:
                return cls(path)
            except KilnError:
                continue
        return None

    @staticmethod
    def why_not(graphs: list[Path]) -> str:
        """ONNX Runtime's reason it cannot open the first of ``graphs``."""
        try:
            SizeProbe(graphs[0])
        except KilnError as exc:
            return exc.message
        return "unknown"

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
            return first_line(exc)
        return None

    def base(self, smallest: dict[str, int], largest: dict[str, int]) -> dict[str, int] | None:
        """The sizes the other axes stay at while one is probed: every axis at its smallest, else at its largest
        where only those run; None where neither runs (random inputs the graph cannot take, or neither size)."""
        for point in (smallest, largest):
            why = self.fails(point)
            if why is None:
                return point
            self.why = self.why or why
        return None

    def pattern(self, base: dict[str, int], name: str, low: int, high: int, source: str) -> list[int] | None:
        """The steps of ``name`` between ``low`` and ``high`` (the others at ``base``), after checking both ends
        run: a range whose end the graph cannot take is an error naming it and the nearest sizes it takes."""
        from kiln.stages.export.stage import size_pattern  # imports torch: only where a range is probed

        def runs(size: int) -> bool:
            return self.fails({**base, name: size}) is None

        for end in (low, high):
            why = self.fails({**base, name: end})
            if why is not None:
                raise ConfigError(
                    f"{source} gives axis {name} sizes from {low} to {high}, but the graph does not run at "
                    f"{name}={end}: {why}",
                    hint=_taken_hint(runs, name, low, high),
                )
        return size_pattern(runs, low, high, name)


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
    shaped its profiles and audit."""
    kept = {k: v for k, v in meta.axis_ranges.items() if k in ranges}
    if kept != meta.axis_ranges:
        meta.axis_ranges = kept
        meta.write(out / SIDECAR)
    return meta
