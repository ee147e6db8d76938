"""Activation ranges from calibration data, computed by ONNX Runtime's calibrators and cached on disk.

The cache key is a content hash of (model file, calibration data, method, settings, ORT version): a changed
model or data set never reuses stale ranges, while a rebuild, a later run or another fallback round does.
The file format is ONNX Runtime's own calibration cache (``save_tensors_data``), which ``quantize_static``
reads back through its ``calibration_cache_path`` argument.
"""

from __future__ import annotations

import io
import logging
import warnings
from collections.abc import Collection, Iterator
from contextlib import contextmanager, nullcontext, redirect_stdout
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from kiln.calibration.data import ArrayReader, hash_batches
from kiln.calibration.entropy import beyond_histograms, entropy_ranges
from kiln.calibration.quiet import ort_said_to_debug
from kiln.core.artifacts import hash_file, hash_json, write_text_atomic
from kiln.core.errors import InputError
from kiln.core.ownership import scratch_dir

log = logging.getLogger("kiln.calibration")

# Entropy (KL) calibration as TensorRT's EntropyCalibration2 does it: a 2048-bin histogram, thresholds tried over
# 128 quantized bins. ONNX Runtime's defaults (128 and 128) leave one candidate threshold, the full range:
# "entropy" would then silently equal "minmax".
ENTROPY_BINS = {"num_bins": 2048, "num_quantized_bins": 128}
# Counts real calibrator passes in this process, so callers and tests can prove a cache hit did no work.
STATS = {"calibrations": 0}


@dataclass
class Ranges:
    """Per-tensor calibration result: ``tensors`` is ORT's ``TensorsData``; ``path`` its cache file."""

    tensors: Any
    path: Path | None  # None: not cached
    key: str
    cache_hit: bool
    method: str

    def amax(self) -> dict[str, float]:
        """Largest magnitude seen per tensor (what a symmetric INT8 scale and an FP16 range check need); infinite
        for a tensor that is not finite (:meth:`unbounded`) or that held no value (:meth:`unreached`): no scale."""
        out = {}
        for name, td in self.tensors.items():
            lo, hi = td.range_value
            finite = _finite(td.range_value)
            out[name] = float(max(np.max(np.abs(lo)), np.max(np.abs(hi)))) if finite else float("inf")
        return out

    def unbounded(self) -> list[str]:
        """Tensors whose calibrated range is not finite: a graph may hold infinities on purpose (T5's relative
        position buckets take the log of 0, a mask adds -inf before a softmax), and no scale holds them, so the
        nodes that write or read them stay in float (:func:`kiln.calibration.quantize.unbounded_nodes`). Tensors
        that held no value at all are :meth:`unreached`, not these."""
        return sorted(
            name for name, td in self.tensors.items() if not _finite(td.range_value) and not _empty(td.range_value)
        )

    def unreached(self) -> list[str]:
        """Tensors empty in every calibration batch (a routed branch, such as an MoE expert, that no sample takes):
        their range is the empty one, (+inf, -inf), so nothing gives them a scale and their nodes stay in float."""
        return sorted(name for name, td in self.tensors.items() if _empty(td.range_value))

    def nan_bounded(self) -> list[str]:
        """Tensors with a NaN bound (:meth:`unbounded` ones NaN in every sample): ORT's quantizer computes a scale
        for every tensor of the ranges it is given, and a NaN one fails its check ("scale issue")."""
        return sorted(
            name
            for name, td in self.tensors.items()
            if any(np.isnan(np.asarray(v, dtype=np.float64)).any() for v in td.range_value)
        )

    def without(self, names: Collection[str]) -> Ranges:
        """These ranges less the tensors ``names``, in memory only (no cache file: ``path`` None)."""
        from onnxruntime.quantization.calibrate import TensorsData

        kept = {n: td for n, td in self.tensors.data.items() if n not in names}
        return replace(self, tensors=TensorsData(self.tensors.calibration_method, kept), path=None)


@contextmanager
def ranges_file(ranges: Ranges) -> Iterator[Path]:
    """A file holding ``ranges`` in ORT's cache format (what ``quantize_static`` reads): its cache file, or for
    uncached ranges a scratch copy removed after the block."""
    if ranges.path is not None:
        yield ranges.path
        return
    from onnxruntime.quantization.calibrate import save_tensors_data

    with scratch_dir("kiln-calib") as tmp:
        save_tensors_data(ranges.tensors, tmp / f"{ranges.key}.json")
        yield tmp / f"{ranges.key}.json"


def model_hash(model_path: Path) -> str:
    """Content hash of an ONNX file plus its external-data file, if any."""
    parts = [hash_file(model_path)]
    data = model_path.with_name(model_path.name + ".data")
    if data.is_file():
        parts.append(hash_file(data))
    return hash_json(parts)


def _ort_method(method: str) -> Any:
    from onnxruntime.quantization import CalibrationMethod

    return {
        "minmax": CalibrationMethod.MinMax,
        "entropy": CalibrationMethod.Entropy,
        "percentile": CalibrationMethod.Percentile,
        "distribution": CalibrationMethod.Distribution,  # FP8: ORT's float quantizer takes its histograms only
    }[method]


def calibrate(
    model_path: Path,
    batches: list[np.ndarray],
    input_name: str,
    method: str,
    *,
    cache_dir: Path | None,
    symmetric: bool = True,
    percentile: float = 99.999,
) -> Ranges:
    """Ranges of every float tensor of the model (not only the quantized ops', so FP16 can use them too)."""
    import onnxruntime

    settings = {
        "symmetric": symmetric if method != "entropy" else None,  # ORT's entropy ranges do not depend on it
        "percentile": percentile if method == "percentile" else None,
        "bins": ENTROPY_BINS if method == "entropy" else None,
    }
    key = hash_json(
        {
            "model": model_hash(model_path),
            "data": hash_batches(batches),
            "method": method,
            "settings": settings,
            "ort": onnxruntime.__version__,
            "empty": "kept",  # a tensor no batch held a value of keeps its empty range (Ranges.unreached)
        }
    )
    if cache_dir is None:  # no cache: the ranges live in memory only, nothing is written
        tensors = _run_calibrator(model_path, batches, input_name, method, symmetric, percentile)
        check_ranges(tensors, model_path)
        return Ranges(tensors, None, key, False, method)
    path = cache_dir / "calibration" / f"{key}.json"
    try:
        from onnxruntime.quantization.calibrate import (
            load_tensors_data,
            save_tensors_data,
        )
    except ImportError:  # ONNX Runtime < 1.32 has no cache format: ranges work, caching does not
        log.warning("onnxruntime %s cannot cache calibration ranges", onnxruntime.__version__)
        return Ranges(
            _run_calibrator(model_path, batches, input_name, method, symmetric, percentile), path, key, False, method
        )
    checksum = path.with_suffix(".sha256")  # the file's content as written: damage that still parses is caught
    if path.is_file():
        try:
            if not checksum.is_file() or checksum.read_text().strip() != hash_file(path):
                raise ValueError("its content does not match the checksum written with it")
            tensors = load_tensors_data(path)
        except (OSError, ValueError, KeyError, TypeError) as exc:  # torn, foreign or damaged: recalibrate over it
            log.warning("ignoring calibration cache %s: %s", path, exc)
        else:
            log.info("calibration cache hit %s (%s)", path.name[:12], method)
            check_ranges(tensors, model_path)
            return Ranges(tensors, path, key, True, method)
    tensors = _run_calibrator(model_path, batches, input_name, method, symmetric, percentile)
    check_ranges(tensors, model_path)
    save_tensors_data(tensors, path)  # atomic (temp file + rename) in ORT
    write_text_atomic(checksum, hash_file(path))
    return Ranges(tensors, path, key, False, method)


def check_ranges(tensors: Any, model_path: Path) -> None:
    """Ranges that cannot be right are an error, never INT8 scales: a NaN or infinite bound, every range 0 (the
    calibration data measured nothing: all zeros, say), or a float graph input whose range is 0."""
    import onnx

    bounds = {name: [np.asarray(v, dtype=np.float64) for v in td.range_value] for name, td in tensors.items()}
    hint = "calibrate on real, varied samples of the inputs the model will see (--calibration, data.name)"
    graph = onnx.load(str(model_path), load_external_data=False).graph
    inputs = {i.name for i in graph.input}
    broken = sorted(n for n, pair in bounds.items() if not _finite(pair) and not _empty(pair))
    empty = sorted(n for n, pair in bounds.items() if _empty(pair))
    if empty:  # a routed branch no sample takes: Ranges.unreached, kept in float and warned of per variant
        log.info("%d tensors hold no value in any calibration batch; their nodes stay in float", len(empty))
    if any(n in inputs for n in broken) or bounds and len(broken) == len(bounds):
        where = [n for n in broken if n in inputs] or broken
        raise InputError(
            f"calibration gave NaN or infinite ranges for {len(where)} "
            f"{'inputs' if where[0] in inputs else 'tensors'} ({', '.join(where[:4])})",
            hint=hint,
        )
    if broken:  # inside the graph: kept in float where they are made and read (Ranges.unbounded)
        log.info("%d tensors are not finite on calibration data; their nodes stay in float", len(broken))
    flat = {n for n, (lo, hi) in bounds.items() if not (np.any(lo != 0) or np.any(hi != 0) or np.any(lo != hi))}
    if bounds and len(flat) == len(bounds):
        raise InputError(f"calibration measured nothing: all {len(bounds)} tensor ranges are 0", hint=hint)
    floats = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE)
    constant = [i.name for i in graph.input if i.name in flat and i.type.tensor_type.elem_type in floats]
    if constant:
        raise InputError(f"calibration input '{constant[0]}' is 0 in every sample: its range is 0", hint=hint)


def _finite(pair: Any) -> bool:
    """Whether both bounds of a range (scalars or per-channel arrays) are finite numbers."""
    return all(np.isfinite(np.asarray(v, dtype=np.float64)).all() for v in pair)


def _empty(pair: Any) -> bool:
    """Whether a range is the empty one, (+inf, -inf): the min and max of no values (ONNX's ReduceMin and ReduceMax
    of an empty tensor), which a tensor keeps only if it held no value in any batch."""
    lo, hi = (np.asarray(v, dtype=np.float64) for v in pair)
    return bool(np.all(lo == np.inf) and np.all(hi == -np.inf))


def _symmetric(tensors: Any) -> Any:
    """ORT's symmetric minmax ranges, (-amax, amax), from its asymmetric ones, the empty range kept as it is: ORT's
    own symmetric pass makes that (-inf, inf), which cannot be told from a tensor that is infinite."""
    from onnxruntime.quantization.calibrate import TensorData, TensorsData

    data = {}
    for name, td in tensors.data.items():
        lo, hi = td.range_value
        if not _empty((lo, hi)):
            amax = np.nanmax([np.abs(lo), np.abs(hi)], axis=0)  # as ORT's MinMaxCalibrater.compute_data
            lo, hi = -amax, amax
        data[name] = TensorData(lowest=lo, highest=hi)
    return TensorsData(tensors.calibration_method, data)


# Rows fed to the calibrator in one call: its session holds a call's activations (a transformer's at 32 rows, GBs),
# and every method's ranges merge exactly across calls (:func:`_minmax`, :class:`_FiniteHistograms`), so smaller
# calls change no range
CALIBRATE_ROWS = 8


def _pieces(batches: list[Any]) -> list[Any]:
    """``batches`` cut into pieces of at most :data:`CALIBRATE_ROWS` rows, where every array of a batch has that many
    rows on its first axis (a batch of inputs of one batch axis); any other batch (inputs of no batch axis, a graph's
    edges) stays whole."""
    out: list[Any] = []
    for batch in batches:
        arrays = list(batch.values()) if isinstance(batch, dict) else [batch]
        rows = {len(a) if np.ndim(a) else -1 for a in arrays}
        n = next(iter(rows)) if len(rows) == 1 else -1
        if n <= CALIBRATE_ROWS:
            out.append(batch)
            continue
        for i in range(0, n, CALIBRATE_ROWS):
            cut = slice(i, i + CALIBRATE_ROWS)
            out.append({k: v[cut] for k, v in batch.items()} if isinstance(batch, dict) else batch[cut])
    return out


def _run_calibrator(
    model_path: Path, batches: list[np.ndarray], input_name: str, method: str, symmetric: bool, percentile: float
) -> Any:
    from onnxruntime.quantization import create_calibrator

    # minmax: asymmetric ranges made symmetric here (_symmetric), so a tensor that held no value keeps its empty range
    extra: dict[str, Any] = {"symmetric": symmetric and method != "minmax"}
    if method == "percentile":
        extra["percentile"] = percentile
    if method == "entropy":
        extra |= ENTROPY_BINS
    # ORT's histogram calibrators print their progress: it goes to Kiln's debug log, not the user's output
    # tmp: in the workdir, removed on failure; numpy's warnings on a tensor NaN everywhere go to the debug log too
    with scratch_dir("kiln-calib") as tmp, _ort_prints_logged(), ort_said_to_debug("calibration"):
        calibrator = create_calibrator(
            model_path,
            None,
            augmented_model_path=str(Path(tmp) / "augmented.onnx"),
            calibrate_method=_ort_method(method),
            extra_options=extra,
            use_external_data_format=model_path.with_name(model_path.name + ".data").is_file(),
        )
        tensors = _collect(calibrator, [ArrayReader(input_name, [piece]) for piece in _pieces(batches)], method)
        if method == "minmax" and symmetric:
            tensors = _symmetric(tensors)
    STATS["calibrations"] += 1
    log.info("calibrated %d tensors with %s over %d batches", len(tensors.data), method, len(batches))
    return tensors


def _collect(calibrator: Any, readers: list[ArrayReader], method: str) -> Any:
    """Run the calibration data through ``calibrator`` one batch a call (``readers``: one batch each) and compute its
    ranges. ORT keeps every tensor of every batch a ``collect_data`` call reads until the call ends (histogram
    methods: the tensors themselves, many GB for a transformer), so one batch a call holds one batch's tensors.
    Histogram methods see only the tensors that are finite on the data (:class:`_FiniteHistograms`); the others
    come back with the range of the values seen, not finite, as minmax gives it, so their nodes stay in float
    (:meth:`Ranges.unbounded`). Entropy: thresholds from :func:`kiln.calibration.entropy.entropy_ranges` (ORT's
    search, vectorised); a tensor past float32's half range (a mask fill) overflows the width of ORT's histogram, so
    numpy's bare overflow warning is replaced by one log line naming those tensors, whose ranges are the values
    seen."""
    if not readers:
        raise ValueError("No data is collected.")  # as ORT says it
    if method == "minmax":
        return _minmax(calibrator, readers)
    finite = _FiniteHistograms(calibrator)
    calibrator.collector = finite  # ORT's collect_data builds its own collector only where none is set
    with np.errstate(over="ignore") if method == "entropy" else nullcontext():
        for histogramming in (False, True):  # the ranges of all the data, then its histograms over them
            finite.histogramming = histogramming
            for reader in readers:
                reader.rewind()
                calibrator.collect_data(reader)
    if method != "entropy":
        return finite.with_unbounded(calibrator.compute_data() if finite.get_histogram_dict() else None)
    histograms = finite.get_histogram_dict()
    wide = beyond_histograms(histograms)
    if wide:
        log.info(
            "entropy calibration: %d tensors reach %.3g (%s%s), a fill value such as an attention mask's "
            "finfo(float32).min; no histogram spans that, so their ranges are the values seen",
            len(wide),
            max(max(abs(float(histograms[n][2])), abs(float(histograms[n][3]))) for n in wide),
            ", ".join(wide[:4]),
            f" and {len(wide) - 4} more" if len(wide) > 4 else "",
        )
    return finite.with_unbounded(entropy_ranges(histograms, ENTROPY_BINS["num_quantized_bins"]))


def _minmax(calibrator: Any, readers: list[ArrayReader]) -> Any:
    """ORT's minmax ranges of all the batches, one batch a ``collect_data`` call. Each call's ranges are taken alone
    and merged here as ``np.nanmin``/``np.nanmax`` over all batches would (``np.fmin``/``np.fmax``: a NaN bound of
    one batch does not hide the others'); ORT's own merge across calls (Python ``min``) depends on the order."""
    from onnxruntime.quantization.calibrate import TensorData, TensorsData

    merged: dict[str, tuple[Any, Any]] = {}
    for reader in readers:
        calibrator.calibrate_tensors_range = None  # this batch's ranges alone, not ORT's merge with the last ones
        calibrator.collect_data(reader)
        for name, td in calibrator.compute_data().data.items():
            lo, hi = td.range_value
            if name in merged:
                lo, hi = np.fmin(merged[name][0], lo), np.fmax(merged[name][1], hi)
            merged[name] = (lo, hi)
    data = {name: TensorData(lowest=lo, highest=hi) for name, (lo, hi) in merged.items()}
    return TensorsData(_ort_method("minmax"), data)


class _FiniteHistograms:
    """ORT's histograms for ``calibrator`` over the data fed it batch by batch, of the tensors finite on all of it.

    ``np.histogram`` refuses a range that is not finite, so one ``-inf`` (a policy's masked logits) or NaN in any
    tensor would stop the whole calibration. ORT's ``HistogramCalibrater.collect_data`` uses ``calibrator.collector``
    where one is set, and calls nothing else on it than ``collect`` and ``compute_collection_result``: this wrapper
    in that place is the one hook there is, short of reimplementing the collection loop. The data goes through twice:
    first (``histogramming`` False) each tensor's range and whether it is finite, then its histogram over that range,
    the batches' counts summed: the histogram ORT's ``HistogramCollector`` makes of all the batches at once (ORT's
    merge of one call's histogram into the last one's rebins, and would depend on the batch order). Tensors holding a
    non-finite value are set aside with the range of the values seen (NaN ignored, as minmax's ``np.nanmin``). An
    empty batch of a tensor is left out (ORT would histogram it as zeros); a tensor empty in every batch gets the
    empty range, (+inf, -inf), as minmax gives it (:meth:`Ranges.unreached`)."""

    def __init__(self, calibrator: Any) -> None:
        from onnxruntime.quantization.calibrate import HistogramCollector

        self.collector = HistogramCollector(  # as ORT's collect_data builds it
            method=calibrator.method,
            symmetric=calibrator.symmetric,
            num_bins=calibrator.num_bins,
            num_quantized_bins=calibrator.num_quantized_bins,
            percentile=calibrator.percentile,
            scenario=calibrator.scenario,
        )
        self.histogramming = False
        self.bounds: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # NaN-ignoring min and max of the values seen
        self.unbounded: set[str] = set()  # tensors holding a value that is not finite
        self.nearest: dict[str, np.ndarray] = {}  # smallest magnitude seen: where a magnitude histogram starts
        self.empty: dict[str, Any] = {}  # tensor name -> dtype, for the tensors no batch has held a value of

    @property
    def aside(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """The ranges of the tensors holding a non-finite value: no histogram, the range of the values seen."""
        return {name: self.bounds[name] for name in sorted(self.unbounded)}

    def collect(self, name_to_arr: dict[str, Any]) -> None:
        """One batch's tensors: their ranges on the first pass, their histograms on the second."""
        for name, arrays in name_to_arr.items():
            flat = np.concatenate([np.ravel(a) for a in (arrays if isinstance(arrays, list) else [arrays])])
            if flat.size == 0:
                if name not in self.bounds:
                    self.empty[name] = flat.dtype
            elif self.histogramming:
                if name not in self.unbounded:
                    self._histogram(name, flat)
            else:
                self._measure(name, flat)

    def _measure(self, name: str, flat: np.ndarray) -> None:
        """Merge ``flat``'s range (NaN ignored) into ``name``'s, and note a value that is not finite."""
        self.empty.pop(name, None)
        if not np.isfinite(flat).all():
            self.unbounded.add(name)
        with warnings.catch_warnings():  # a tensor NaN everywhere: its range is NaN, said by check_ranges
            warnings.simplefilter("ignore", RuntimeWarning)
            lo, hi, near = np.nanmin(flat), np.nanmax(flat), np.nanmin(np.absolute(flat))
        if name in self.bounds:
            lo, hi = np.fmin(self.bounds[name][0], lo), np.fmax(self.bounds[name][1], hi)
            near = np.fmin(self.nearest[name], near)
        self.nearest[name] = np.asarray(near, dtype=flat.dtype)
        self.bounds[name] = (np.asarray(lo, dtype=flat.dtype), np.asarray(hi, dtype=flat.dtype))

    def _histogram(self, name: str, flat: np.ndarray) -> None:
        """Add ``flat``'s counts to ``name``'s histogram, in ORT's ``HistogramCollector`` layout and bins: magnitudes
        over [min |x|, max |x|] for symmetric percentile (``collect_absolute_value``), else values over
        [-amax, amax] (``collect_value``), ``num_bins`` bins, the range that of all the batches."""
        lo, hi = (v.astype(flat.dtype)[()] for v in self.bounds[name])
        absolute = self.collector.method == "percentile" and self.collector.symmetric
        if absolute:
            outer = max(abs(lo), abs(hi))
            counts, edges = np.histogram(
                np.absolute(flat), self.collector.num_bins, range=(self.nearest[name][()], outer)
            )
            entry: tuple[Any, ...] = (counts, edges.astype(flat.dtype), lo, hi)
        else:
            threshold = np.array(max(abs(lo), abs(hi)), dtype=flat.dtype)
            counts, edges = np.histogram(flat, self.collector.num_bins, range=(-threshold, threshold))
            entry = (counts, edges, lo, hi, threshold)
        old = self.collector.histogram_dict.get(name)
        if old is not None:
            entry = (old[0] + counts, *entry[1:])
        self.collector.histogram_dict[name] = entry

    def get_histogram_dict(self) -> dict[str, tuple[Any, ...]]:
        """The histograms of the finite tensors, as ORT's collector keeps them."""
        return self.collector.get_histogram_dict()

    def compute_collection_result(self) -> dict[str, Any]:
        """ORT's ranges of the finite tensors (its percentile or distribution method)."""
        return self.collector.compute_collection_result()

    def with_unbounded(self, tensors: Any) -> Any:
        """``tensors`` (ORT ``TensorsData``, None where no tensor was finite) plus the ranges set aside and the empty
        range of each tensor that held no value."""
        from onnxruntime.quantization.calibrate import TensorData, TensorsData

        data = {} if tensors is None else dict(tensors.data)
        data |= {name: TensorData(lowest=lo, highest=hi) for name, (lo, hi) in self.aside.items()}
        data |= {
            name: TensorData(lowest=np.array(np.inf, dtype), highest=np.array(-np.inf, dtype))
            for name, dtype in self.empty.items()
        }
        return TensorsData(_ort_method(self.collector.method), data)


@contextmanager
def _ort_prints_logged() -> Iterator[None]:
    """ONNX Runtime's calibrators print progress to stdout: captured, and each line logged at debug level."""
    buffer = io.StringIO()
    try:
        with redirect_stdout(buffer):
            yield
    finally:
        for line in buffer.getvalue().splitlines():
            if line.strip():
                log.debug("onnxruntime: %s", line.strip())
