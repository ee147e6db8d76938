"""What a backend is, and what every engine folder holds.

A backend is one folder under ``stages/engines/`` (``onnxruntime/``, ``tensorrt/``, ``torch/``) that defines a
:class:`Backend`: its config section (``build.<name>``), how it builds an engine, the record it keeps about the
build in ``kiln-engine.json``, its runners, the libraries its engines depend on and the hints it gives when one
misses an accuracy gate. :mod:`.registry` lists them; the build stage, validation, packaging and ``kiln build`` go
through this interface and never test a backend's name.

An engine is a folder: a model file plus ``kiln-engine.json`` (:class:`~kiln.core.records.EngineMetadata`). Runners
follow Polygraphy's shape: ``activate`` (load; heavy work happens here, not in ``__init__``), ``infer`` (dict of
numpy arrays in, dict out), ``deactivate``; they are context managers and import their library in ``activate``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel

from kiln.core.artifacts import hash_file
from kiln.core.errors import InputError, InputFileError
from kiln.core.feeds import overlong_lengths
from kiln.core.records import EngineMetadata, IntRange, PrecisionVariant, TensorSpec
from kiln.core.sections import Section
from kiln.core.signature import BATCH_AXIS
from kiln.core.text import ort_reason
from kiln.core.timing import time_calls, warm_up

SIDECAR = "kiln-engine.json"
REBUILD = "rebuild the engine: `kiln build` (or `kiln run --force build` in a workdir)"


@dataclass(frozen=True)
class BuildRequest:
    """One engine to build: ``onnx_path`` into the (staging) folder ``out``, with the backend's own settings."""

    onnx_path: Path
    out: Path
    device: str
    precision: str
    settings: Any  # the backend's config section (``build.<backend>``), of type ``Backend.config``
    cache_dir: Path
    inputs: list[TensorSpec]
    max_batch: int = 32  # bounds default optimization profiles and the batch sizes autotuned
    keep_fp32: list[str] | None = None  # FP16 converted at build time: nodes the precision stage kept FP32
    axis_sizes: dict[str, list[int]] = field(default_factory=dict)  # dynamic axis besides batch -> [min, max]
    name: str = ""  # the engine's name, for messages (``out`` is a staging folder whose name means nothing to users)
    # The trained PyTorch model (FP32, eval, CPU), for backends that compile it rather than the ONNX graph; None
    # where no PyTorch model exists (``kiln build model.onnx``). A loader, so other backends never load it.
    torch_model: Callable[[], Any] | None = None
    # The precision stage's calibration batches (an .npz of "<batch>/<input>" arrays), for backends that calibrate
    # the PyTorch model themselves (the torch backend's FP8/INT8 static scales); None where there are none.
    calibration: Path | None = None
    # Called with the engine's graph file as soon as the backend has written it, before it opens or times it: the
    # stage's precision audit, which raises for an engine its label misstates, so such an engine costs no load
    # check or autotuning (and ONNX Runtime never opens at full load optimization a graph it would refuse).
    check_graph: Callable[[Path], None] | None = None
    # The values each input that indexes a table may hold (kiln-engine.json's ``index_ranges``): what a backend's own
    # example inputs draw, so a float timestep the model casts to an index stays within its table.
    index_ranges: dict[str, IntRange] = field(default_factory=dict)


@dataclass(frozen=True)
class Built:
    """What a backend's build returns: its files (role -> file; ``model`` is the engine itself), the library that
    runs it (``flavour``) and versions, its own record (``Backend.record``) and the batch sizes it accepts."""

    files: dict[str, str]
    flavour: str
    versions: dict[str, str]
    info: BaseModel
    builder_settings: dict[str, Any] = field(default_factory=dict)
    batch_range: tuple[int, int] | None = None  # (smallest, largest) batch; None: any
    # The inputs as the engine takes them, where they differ from the graph's (an axis it takes at one size only)
    inputs: list[TensorSpec] | None = None


@dataclass(frozen=True)
class TritonModel:
    """How Triton's stock backend loads this engine kind: ``platform`` and the model file's name."""

    platform: str
    model_file: str


@dataclass(frozen=True)
class Plan:
    """What the build stage makes of one backend under its settings: the devices to build for, and why not others."""

    devices: list[str]
    skipped: list[str] = field(default_factory=list)
    by_default: bool = False  # the devices are the backend's default choice, not ones the user listed


def _any_device(meta: EngineMetadata) -> tuple[bool, str]:
    return True, ""


def _no_hints(meta: EngineMetadata, failures: list[str]) -> list[str]:
    return []


@dataclass(frozen=True)
class Backend:
    """One engine kind. Everything Kiln needs to know about it, so that adding one is its folder plus one line in
    :mod:`.registry` (``tests/stages/engines/test_registry.py`` registers a toy one from a test module)."""

    name: str
    devices: tuple[str, ...]  # devices it can build for
    config: type[Section]  # its section of the build config, ``build.<name>``; part of each engine's settings hash
    record: type[BaseModel]  # what it records about a build (``kiln-engine.json`` "backend_info")
    build: Callable[[BuildRequest], Built]  # writes the engine files into ``request.out``
    runners: dict[str, Callable[[Path, EngineMetadata, Any], Runner]]  # device -> runner class (or a factory)
    plan: Callable[[Any, str], Plan] = lambda settings, precision: Plan(list(settings.devices))
    can_run: Callable[[EngineMetadata], tuple[bool, str]] = _any_device  # on this machine, and why not
    libraries: tuple[str, ...] = ()  # distributions whose versions belong in its engines' cache keys
    hints: Callable[[EngineMetadata, list[str]], list[str]] = _no_hints  # what to try when gates fail
    triton: TritonModel | None = None  # None: no stock Triton backend loads it
    # Which of its engines that stock backend can load (e.g. not TensorRT-RTX engines, which Triton cannot run).
    triton_loads: Callable[[EngineMetadata], bool] = lambda meta: True
    # A build failure under these settings skips the engine (reported) instead of failing the stage.
    optional: Callable[[Any], bool] = lambda settings: False
    # Which graph of a precision variant this engine is built from, and the nodes to keep FP32 when converting.
    source: Callable[[Backend, str, str, dict[str, PrecisionVariant], Any], tuple[str, list[str] | None]] | None = None
    # Preference among engines within timing noise of each other (validate's per-batch choice): lower first.
    rank: int = 100
    # Builds from the precision stage's graph of each variant. False: from the PyTorch model itself, reading the
    # graph for its inputs and outputs only (the precision stage then converts no graph for it).
    reads_graph: bool = True
    # device -> (rival backend, why): on that device, engines chosen by default are not built where the rival
    # builds engines of the same precision in the run (measured to lose to them); listing the device forces them.
    yields: dict[str, tuple[str, str]] = field(default_factory=dict)

    def settings(self, build_config: Section) -> Any:
        """This backend's section of a build config (``build.<name>``)."""
        return getattr(build_config, self.name)

    def info(self, meta: EngineMetadata) -> Any:
        """The engine's ``backend_info`` as this backend's typed record."""
        return self.record.model_validate(meta.backend_info)

    def stock_triton(self, meta: EngineMetadata) -> TritonModel | None:
        """How Triton's stock backend loads this engine, or None where it cannot."""
        return self.triton if self.triton is not None and self.triton_loads(meta) else None

    def engine_name(self, device: str, precision: str) -> str:
        return f"{self.name}-{device}-{precision}" if len(self.devices) > 1 else f"{self.name}-{precision}"

    def source_for(
        self, device: str, precision: str, variants: dict[str, PrecisionVariant], settings: Any
    ) -> tuple[str, list[str] | None]:
        """The variant's graph made for this engine kind if it has one, else its graph; no nodes to keep."""
        if self.source is not None:
            return self.source(self, device, precision, variants, settings)
        variant = variants[precision]
        return variant.backend_paths.get(f"{self.name}-{device}", variant.path), None


# ------------------------------------------------------------------------------------------------ engine folders
def read_metadata(engine_dir: Path) -> EngineMetadata:
    p = Path(engine_dir) / SIDECAR
    if not Path(engine_dir).exists():
        raise InputFileError(f"{engine_dir} does not exist", hint="point at a folder `kiln build` wrote")
    if not p.is_file():
        raise InputFileError(
            f"{engine_dir} is not a Kiln engine (no {SIDECAR})", hint="point at a folder `kiln build` wrote"
        )
    return EngineMetadata.read(p, hint=REBUILD)


def engine_dirs(folder: Path) -> list[Path]:
    """The engine folders directly under ``folder`` (a build stage's output), in name order."""
    return sorted(p.parent for p in Path(folder).glob(f"*/{SIDECAR}"))


def verify_files(engine_dir: Path, meta: EngineMetadata) -> None:
    """Every file the metadata lists is there with its recorded content: a damaged engine is refused, not run."""
    for name, digest in meta.file_hashes.items():
        path = Path(engine_dir) / name
        if not path.is_file():
            raise InputFileError(f"engine {meta.name}: {name} is missing from {engine_dir}", hint=REBUILD)
        if hash_file(path) != digest:
            raise InputFileError(
                f"engine {meta.name}: {name} does not match its recorded sha256 (the file changed after the build)",
                hint=REBUILD,
            )


# ------------------------------------------------------------------------------------------------------ runners
HOST_INPUT_SHAPES = 8  # input shapes a runner keeps host buffers for (Runner.host_inputs)


class Runner:
    """Base runner. Subclasses implement ``_activate``, ``_infer`` and ``_deactivate``; ``info`` is the engine's
    ``backend_info`` as its backend's record. ``serving``: the engine runs inside a server, sharing the machine's
    cores with the server's threads and other processes (a runner that would busy-wait between calls does not)."""

    per_shape_sessions = False  # True: each new input shape costs a build (a session, a CUDA graph capture)

    def __init__(self, engine_dir: Path, meta: EngineMetadata, info: Any = None) -> None:
        self.engine_dir, self.meta, self.info, self.active = Path(engine_dir), meta, info, False
        self.serving = False  # set before activate() (load_engine's ``serving``)
        self.name = meta.name
        self._host_inputs: dict[Any, dict[str, np.ndarray]] = {}  # input shapes -> buffers (host_inputs)

    @property
    def input_names(self) -> list[str]:
        return [i.name for i in self.meta.inputs]

    def activate(self) -> Runner:
        if not self.active:
            self._activate()
            self.active = True
        return self

    def deactivate(self) -> None:
        if self.active:
            self._deactivate()
            self._host_inputs.clear()
            self.active = False

    def __enter__(self) -> Runner:
        return self.activate()

    def __exit__(self, *exc: object) -> None:
        self.deactivate()

    def host_inputs(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
        """Writable arrays of these shapes, one per input in its declared dtype, kept by the runner for the next
        call with the same shapes: a server writes a batch's rows into them and passes them to :meth:`infer`
        instead of joining and padding arrays anew for every batch. A runner whose engine reads host memory
        faster from its own buffers (page-locked for a GPU) returns those (:meth:`_host_array`). A few shapes are
        kept, the most recent ones."""
        key = tuple(sorted(shapes.items()))
        kept = self._host_inputs
        if key not in kept:
            if len(kept) >= HOST_INPUT_SHAPES:
                kept.pop(next(iter(kept)))
            dtypes = {s.name: np.dtype(s.dtype) for s in self.meta.inputs}
            kept[key] = {n: self._host_array(tuple(shape), dtypes[n]) for n, shape in shapes.items()}
        else:
            kept[key] = kept.pop(key)  # the most recent last
        return kept[key]

    def _host_array(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        return np.empty(shape, dtype)

    def infer(self, feed: dict[str, np.ndarray], *, allow_outside_ranges: bool = False) -> dict[str, np.ndarray]:
        """Outputs by name for ``feed`` (one array per input, as ``kiln-engine.json`` declares them), checked first
        (:func:`check_feed`): sizes outside those the engine was validated for (``axis_ranges``) are refused as the
        servers refuse them. ``allow_outside_ranges``: run them anyway, answers nobody compared with the model's
        (to try a size before validating it); a backend error is then said as the sizes it was validated for."""
        if not self.active:
            raise InputError(
                f"engine {self.name} called before it was activated (or after its `with` block ended)",
                hint="call it inside `with load_engine(path) as engine:`, or after engine.activate()",
            )
        check_feed(self.meta, feed, allow_outside_ranges=allow_outside_ranges)
        try:
            return self._infer(feed)
        except Exception as exc:  # the backend's own error: said as Kiln's where the feed is at fault
            refused = self._refused(feed, exc)
            if refused is None:
                raise
            raise refused from None

    def _refused(self, feed: dict[str, np.ndarray], exc: Exception) -> InputError | None:
        """The backend's error ``exc`` on ``feed`` as Kiln's :class:`InputError` where the feed is at fault: outside
        the sizes or values the engine was validated for (said as those), or holding an index past a table that its
        check does not range (:func:`past_index`); None for any other error."""
        outside = self.meta.refusal(feed)
        if outside is not None:
            return InputError(f"{outside}; the engine failed on it: {ort_reason(exc, 200)}", hint=OUTSIDE_HINT)
        past = past_index(exc)
        if past is None:
            return None
        return InputError(f"engine {self.name}: {past}{_index_sources(feed)}", hint=INDEX_HINT)

    def time_ms(
        self, feed: dict[str, np.ndarray], warmup: int, iterations: int, budget_s: float | None = None
    ) -> list[float]:
        """Latency of one call in ms, host arrays in and out (what a caller of the engine sees); at most
        ``iterations`` calls, fewer once ``budget_s`` seconds are spent (:func:`kiln.core.timing.time_calls`), after
        a warm-up that takes a quarter of the budget at most. The feed is checked once, as :meth:`infer` checks it
        but for the validated sizes: its answers go to no one, and timing a size is how one is tried
        (``kiln validate ENGINE``)."""
        self.infer(feed, allow_outside_ranges=True)  # the calls below skip the check
        warm_up(lambda: self._infer(feed), warmup, budget_s)
        return time_calls(lambda: self._infer(feed), iterations, cuda=False, budget_s=budget_s)

    def timer(
        self, feed: dict[str, np.ndarray], warmup: int, budget_s: float | None = None
    ) -> Callable[[int, float | None], list[float]]:
        """After a warm-up, ``(calls, budget_s) -> ms per call`` on ``feed``, for interleaved timing
        (:func:`kiln.core.timing.interleave`): a block of calls, measured as :meth:`time_ms` measures them."""
        if type(self).time_ms is not Runner.time_ms:  # a backend timing on its device: its own method, per block
            self.time_ms(feed, warmup, 1, budget_s)
            return lambda calls, block_s: self.time_ms(feed, 0, calls, block_s)
        self.infer(feed)  # checks the feed once; the calls below skip the check
        warm_up(lambda: self._infer(feed), warmup, budget_s)
        return lambda calls, block_s: time_calls(
            lambda: self._infer(feed), calls, cuda=False, budget_s=block_s, min_calls=1
        )

    def _activate(self) -> None:
        raise NotImplementedError

    def _infer(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def _deactivate(self) -> None:
        pass


OUTSIDE_HINT = "call the engine within the sizes and values it was validated for (kiln-engine.json: axis_ranges)"
STEPS_HINT = (
    "pass a size the engine's graph takes (the nearest are named above; kiln-engine.json: axis_steps), resizing or "
    "padding the input to it"
)
VALUES_HINT = (
    "pass indices within what the input indexes (kiln-engine.json: index_ranges, index_floors): a class id or timestep "
    "within its embedding's rows, a token id within the vocabulary (one past it: a tokenizer made for another model), "
    "a node index within the graph's nodes, from 0 (PyTorch refuses a negative one)"
)
LENGTHS_HINT = (
    "pass each row's length within the axis it measures (its real positions; the rest is padding), or pad that input "
    "to the longest row; from Python, infer(feed, allow_outside_ranges=True) runs it unchecked"
)
INDEX_HINT = (
    "pass values within the rows of the table the input indexes (a class id or timestep within the embedding's rows, "
    "a token id within the vocabulary, a node index within the graph's nodes) and masks of 0s and 1s"
)
# ONNX Runtime's error where an index op's index lies past the axis it reads (Gather; GatherND and ScatterND, whose
# kernels say "index" and "indice"; GatherElements and ScatterElements), naming the node and, for Gather, GatherND and
# ScatterND, the index and, for Gather, the range the axis allows
_PAST_INDEX = re.compile(
    r"running (?P<op>\w+) node\. Name:'(?P<node>[^']*)' Status Message: .*?(?:"
    r"indices element out of data bounds, idx=(?P<idx>-?\d+) must be within the inclusive range "
    r"\[(?P<low>-?\d+),(?P<high>-?\d+)\]|invalid ind(?:ex|ice) found, ind(?:ex|ice) = (?P<nd>-?\d+)"
    r"|out of range value in index)",
    re.IGNORECASE | re.DOTALL,
)


def past_index(exc: BaseException) -> str | None:
    """The sentence for a backend's error that an index op of the graph got an index past the axis it reads (ONNX
    Runtime's, :data:`_PAST_INDEX`): the node, its op, the index and the positions it takes, where the error says
    them; None for any other error. An input the engine's own check ranges (``index_ranges``) is refused before it
    runs; this is an index the check cannot follow (one computed from the inputs, or a table whose rows the graph
    does not fix)."""
    found = _PAST_INDEX.search(str(exc))
    if found is None:
        return None
    where = f"node '{found['node']}' ({found['op']})"
    if found["idx"] is not None:
        low, high = int(found["low"]), int(found["high"])
        return (
            f"{where} got index {found['idx']}, outside the {high + 1} rows of the table it reads (indices {low} to "
            f"{high}, negative ones counted from its end)"
        )
    index = f" {found['nd']}" if found["nd"] is not None else ""
    return f"{where} got an index{index} past the axis it reads"


def _index_sources(feed: dict[str, np.ndarray]) -> str:
    """The clause naming the feed's integer inputs, those an index past its axis may come from (a token id past the
    vocabulary, an attention mask holding a value other than 0 and 1 that the graph turns into positions); empty
    where the feed has none."""
    names = [name for name, array in feed.items() if np.issubdtype(array.dtype, np.integer)]
    if not names:
        return ""
    return f"; the index may come from the values of {'input' if len(names) == 1 else 'inputs'} " + ", ".join(
        f"'{n}'" for n in names
    )


BATCH_HINT = (
    "call it with at most that many rows at a time, or validate the larger batch (signature.batch_sizes) and package "
    "again; from Python, infer(feed, allow_outside_ranges=True) runs it at a batch nobody validated"
)
RANGES_HINT = (
    "pass sizes within kiln-engine.json's axis_ranges, or build the engine for the sizes you need (signature.shapes); "
    "from Python, infer(feed, allow_outside_ranges=True) runs it at sizes nobody validated"
)


def check_feed(meta: EngineMetadata, feed: dict[str, Any], *, allow_outside_ranges: bool = False) -> None:
    """Every input the engine declares, as a numpy array of its dtype, rank and fixed sizes, none empty, each named
    axis within the sizes the engine was validated for and each row's length within the axis it measures
    (:func:`kiln.core.feeds.overlong_lengths`; both unless ``allow_outside_ranges``), each index within what it
    indexes; nothing else. One :class:`InputError` naming the first input that differs, before any backend sees it."""
    if not isinstance(feed, Mapping):
        raise InputError(
            f"engine {meta.name} takes a dict of input name -> array, not a {type(feed).__name__}",
            hint="pass {" + ", ".join(f"{n!r}: array" for n in meta.input_names()) + "}",
        )
    missing, extra = sorted(set(meta.input_names()) - set(feed)), sorted(set(feed) - set(meta.input_names()))
    if missing or extra:
        problem = f"needs inputs {sorted(meta.input_names())}, got {sorted(feed)}"
        raise InputError(f"engine {meta.name} {problem}", hint="pass one array per input, named as the engine names it")
    for spec in meta.inputs:
        array = feed[spec.name]
        if not isinstance(array, np.ndarray):
            raise InputError(
                f"engine {meta.name}: input '{spec.name}' is a {type(array).__name__}, not a numpy array",
                hint="pass numpy arrays (np.asarray(x), or tensor.numpy())",
            )
        if array.dtype != np.dtype(spec.dtype) or array.ndim != len(spec.shape):
            dims = ", ".join(str(d) for d in spec.shape)
            raise InputError(
                f"engine {meta.name}: input '{spec.name}' is {array.dtype}{list(array.shape)}, the engine takes "
                f"{spec.dtype}[{dims}]",
                hint=f"pass '{spec.name}' as {spec.dtype} with that shape (a named axis takes the sizes in "
                "kiln-engine.json's axis_ranges)",
            )
    shapes = {k: v.shape for k, v in feed.items()}
    fixed = meta.fixed_axis(shapes)
    if fixed is not None:
        raise InputError(meta.fixed_refusal(*fixed, shape=shapes[fixed[0]]), hint=_fixed_fix(meta, fixed, shapes))
    empty = meta.empty_axis(shapes)  # an empty batch aborts ONNX Runtime's LSTM/GRU kernels, and the process
    if empty is not None:
        raise InputError(meta.empty_refusal(*empty), hint=empty_hint(*empty, ranged=str(empty[2]) in meta.axis_ranges))
    check_sizes(meta, shapes, allow_outside_ranges)
    overlong = None if allow_outside_ranges else overlong_lengths(meta.inputs, feed)
    if overlong is not None:
        raise InputError(overlong, hint=LENGTHS_HINT)
    outside = meta.outside_values(feed)
    if outside is not None:
        raise InputError(outside, hint=VALUES_HINT)


def _fixed_fix(meta: EngineMetadata, fixed: tuple[str, int, int, int], shapes: dict[str, tuple[int, ...]]) -> str:
    """The fix for an input refused on an axis its graph fixes (:meth:`EngineMetadata.fixed_axis`): its axes
    reordered where only their order differs (an NHWC image given to an NCHW engine: a dynamic channel axis would not
    help), else :func:`fixed_hint`."""
    found = meta.reordered(fixed[0], shapes[fixed[0]])
    if found is not None:
        return f"pass '{fixed[0]}' with its axes in the engine's order: {found[1]}"
    return fixed_hint(*fixed, pinned=pinned_at_export(meta, *fixed[:2]))


def pinned_at_export(meta: EngineMetadata, name: str, axis: int) -> bool:
    """Whether the engine takes input ``name``'s ``axis`` at one size because torch.export fixed it while
    ``signature.dynamic_axes`` has it vary (the torch backend's ``one_size_axes``: an nn.GRU's length), rather than
    because the graph it was built from fixes it. Axes are keys of JSON objects there: text once read back."""
    pinned = meta.builder_settings.get("one_size_axes", {}).get(name, {})
    return str(axis) in {str(a) for a in pinned}


def fixed_hint(name: str, axis: int, size: int, fixed: int, pinned: bool = False) -> str:
    """The fix for an input given at ``size`` on an axis its graph fixes at ``fixed``: that size, or an engine
    exported with the axis dynamic (the batch: ``export.dynamic_batch``; another: ``signature.dynamic_axes``).
    ``pinned`` (:func:`pinned_at_export`): the axis is dynamic already and torch.export fixed it, which no setting
    undoes, so the other sizes are the ONNX graph's engines' of the same run."""
    if pinned:
        return (
            f"pass '{name}' at {fixed} on axis {axis}: torch.export fixed that size when it compiled this engine, "
            "though the run's config has the axis vary; for other sizes use an engine of the same run built from "
            "the ONNX graph (ONNX Runtime, TensorRT)"
        )
    declare = (
        "export.dynamic_batch: true"
        if axis == 0
        else f"signature.dynamic_axes: {{{name}: {{{axis}: NAME}}}}, sizes in signature.shapes"
    )
    return f"pass '{name}' at {fixed} on axis {axis}, or export the model with that axis dynamic ({declare}) and build"


def empty_hint(name: str, axis: int, dim: str | int, ranged: bool = False) -> str:
    """The fix for an input empty on ``axis`` where the engine takes no 0: one row or more for the batch (axis 0
    that no range of its own sizes: ``ranged``); for another axis, a size it takes, or an engine validated at 0
    (``signature.shapes`` from 0: a decoder's empty past)."""
    if str(dim) == BATCH_AXIS or (axis == 0 and not ranged):
        return "pass one row or more (no engine takes an empty batch: ONNX Runtime's LSTM and GRU abort on one)"
    if not isinstance(dim, str) or not dim.isidentifier():  # fixed, or an axis of no name that no size declares
        return f"pass '{name}' with a size of 1 or more on axis {axis}"
    return (
        f"pass '{name}' at a size of {dim} the engine takes (kiln-engine.json's axis_ranges), or declare 0 among "
        f"{dim}'s sizes (signature.shapes: {{{dim}: [0, ...]}}) and build the engine again"
    )


def check_sizes(meta: EngineMetadata, shapes: dict[str, tuple[int, ...]], allow_outside_ranges: bool = False) -> None:
    """Inputs at one size on each axis they share (:meth:`EngineMetadata.tied_mismatch`), no more rows than a
    packaged engine was validated for (:meth:`EngineMetadata.outside_batch`), and each named axis at a
    size the engine was validated for (``axis_ranges``, and ``axis_steps`` between them) unless
    ``allow_outside_ranges``: the servers' own check (:meth:`EngineMetadata.outside_range`), so that the engine
    answers no call a server would refuse, where ONNX Runtime would run it unchecked or TensorRT fail with an error
    of its own. It runs on every call, so the shapes are read once: ``outside_range`` checks the ties first."""
    batch = None if allow_outside_ranges else meta.outside_batch(shapes)  # a packaged engine's validated batches
    if batch is not None:
        raise InputError(batch, hint=BATCH_HINT)
    ranged = bool(meta.axis_ranges or meta.axis_steps) and not allow_outside_ranges
    problem = meta.outside_range(shapes) if ranged else meta.tied_mismatch(shapes)
    if problem is None:
        return
    if not ranged or meta.tied_mismatch(shapes) is not None:
        raise InputError(problem, hint="pass every input at one size on the axes they share (the batch, a sequence)")
    off_steps = all(within for within, _ in meta.refused_sizes(shapes).values())
    raise InputError(problem, hint=STEPS_HINT if off_steps else RANGES_HINT)
