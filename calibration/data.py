"""Calibration data: a fixed number of batches from the run's dataset, or from a user reader by import path.

The dataset's tensors are already preprocessed exactly as the validation split is (one function makes both),
so calibration sees the same distribution the accuracy gates are measured on.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from kiln.calibration.config import CalibrationConfig
from kiln.core.data import DatasetSplits, feed_for_graph, is_tensor, rows, take, tensors
from kiln.core.errors import ConfigError
from kiln.core.feeds import in_batches, rows_per_call
from kiln.core.labels import is_label_name
from kiln.core.records import TensorSpec
from kiln.core.user_errors import running_user_code, user_frame
from kiln.models.registry import resolve_callable

log = logging.getLogger("kiln.calibration")


Batch = np.ndarray | dict[str, np.ndarray]  # one input's rows, or a feed of named inputs
ReaderBatch = Batch | tuple[np.ndarray, ...]  # as a reader yields it: also one array per input, in input order


def dataset_batches(
    data: DatasetSplits, cfg: CalibrationConfig, seed: int = 0, names: list[str] | None = None
) -> list[Batch]:
    """``num_batches`` x ``batch_size`` samples of the training split, in a seeded order (deterministic), at the
    data's real shapes. ``names``: the model's input names, to give feeds (required for several inputs)."""
    import torch  # the dataset's tensors are torch's: loaded by the dataset already

    x = data.train_x if rows(data.train_x) else data.val_x
    perm = torch.randperm(rows(x), generator=torch.Generator().manual_seed(seed))
    batches: list[Batch] = []
    for i in range(cfg.num_batches):
        idx = perm[i * cfg.batch_size : (i + 1) * cfg.batch_size]
        if len(idx) == 0:
            break  # fewer samples than asked for: use what there is
        part = take(x, idx)
        batches.append(feed_for_graph(part, names) if names is not None else tensors(part)[0].numpy())
    return batches


def check_reader(settings: Any) -> None:
    """The stage check (:attr:`kiln.core.stage.Stage.checks`) of ``settings.calibration.reader``: its import path
    names a function, before any stage's work is spent."""
    if settings.calibration.reader is not None:
        resolve_callable(settings.calibration.reader, {}, "calibration reader")


def read_reader(cfg: CalibrationConfig) -> list[ReaderBatch]:
    """Call the user's reader and take its first ``num_batches`` batches, as they come: an array, a dict of arrays
    by input name, or a tuple of arrays (one per input, or an ``(x, y, ...)`` batch: :func:`_reader_feed` tells
    them apart by the model's inputs; a pair whose ``x`` is a dict or a tuple gives its ``x``)."""
    assert cfg.reader is not None
    fn = resolve_callable(cfg.reader, {}, "calibration reader")
    what = f"calibration reader '{cfg.reader}'"
    with running_user_code("reading calibration batches", what):
        try:
            source = fn(**cfg.reader_params)
        except TypeError as exc:
            if user_frame(exc) is not None:  # raised inside the reader: its own line, not its params
                raise
            raise ConfigError(
                f"calibration.reader '{cfg.reader}' rejected its params: {exc}", hint="fix calibration.reader_params"
            ) from exc
        if not isinstance(source, Iterable):
            raise ConfigError(
                f"calibration.reader '{cfg.reader}' returned {type(source).__name__}, not an iterable",
                hint="return (or yield) numpy arrays / torch tensors of shape [batch, *input_shape], or dicts of them "
                "keyed by input name",
            )
        batches = [item for _, item in zip(range(cfg.num_batches), _as_batches(source))]
    if not batches:
        raise ConfigError(f"calibration.reader '{cfg.reader}' yielded no batches", hint="yield at least one batch")
    return batches


SHAPE_HINT = "preprocess calibration data exactly like validation data"


def reader_batches(cfg: CalibrationConfig, inputs: list[TensorSpec]) -> list[Batch]:
    """The user reader's batches, checked against the model's ``inputs`` and cast to their dtypes. A named
    (dynamic) axis takes any size, one size per batch wherever the graph names it. One input: its array per
    batch (a dict keyed by its name is read too, or by another name where that is its one key not named like
    labels); several: a dict of every input, keyed by name, or a tuple of one array per input, in the model's
    input order."""
    feeds: list[dict[str, np.ndarray]] = []
    taken: set[str] = set()  # dict keys read as the one input though they name no input
    for i, item in enumerate(read_reader(cfg)):
        feed = _reader_feed(cfg, i, item, inputs, taken)
        _check_shapes(i, feed, inputs)
        for name, array in feed.items():
            problem = _unusable(array)
            if problem is not None:
                where = f" input '{name}'" if len(inputs) > 1 else ""
                raise ConfigError(
                    f"calibration batch {i}{where} of reader '{cfg.reader}' {problem}",
                    hint="yield real numbers, one row or more per batch, preprocessed exactly like validation data",
                )
        feeds.append({s.name: feed[s.name].astype(np.dtype(s.dtype), copy=False) for s in inputs})
    if taken:  # said once per run, not per batch
        log.warning(
            "calibration reader '%s' yields no key '%s': took its key %s as the model's input '%s'",
            cfg.reader,
            inputs[0].name,
            ", ".join(map(repr, sorted(taken))),
            inputs[0].name,
        )
    _refuse_all_zero(cfg, feeds, inputs)
    return [f if len(inputs) > 1 else f[inputs[0].name] for f in feeds]


def _refuse_all_zero(cfg: CalibrationConfig, feeds: list[dict[str, np.ndarray]], inputs: list[TensorSpec]) -> None:
    """Float inputs that are all 0 in every sample of every batch are a reader's mistake (arrays never filled, the
    wrong field read): there is nothing to calibrate at all. One such input beside others that vary may be real
    data (an RNN's initial state, a padding mask without padding): the INT8 variant's own range check fails INT8
    alone there, and FP32 and FP16 go on. Integer inputs may be all 0 (token type ids)."""
    floats = [s.name for s in inputs if np.dtype(s.dtype).kind == "f"]
    if not floats or any(np.any(f[name]) for f in feeds for name in floats):
        return
    n = len(feeds)
    which = f"input '{floats[0]}'" if len(floats) == 1 else f"every float input ({', '.join(floats)})"
    raise ConfigError(
        f"calibration reader '{cfg.reader}' yields {which} as 0 in every sample of its {n} "
        f"batch{'es' if n > 1 else ''}: {'its range is' if len(floats) == 1 else 'their ranges are'} 0, nothing "
        "to calibrate INT8 scales from",
        hint="yield real samples of the input, preprocessed exactly like validation data",
    )


def _reader_feed(
    cfg: CalibrationConfig, i: int, item: ReaderBatch, inputs: list[TensorSpec], taken: set[str]
) -> dict[str, np.ndarray]:
    """A reader's batch keyed by the model's input names; keys that are not exactly those (beside a DataLoader's
    labels) are an error, except for one input, where a dict's one key not named like labels is read as that
    input (the key is added to ``taken``, for a warning), as a dataset's ``{"pixel_values": x, "labels": y}``."""
    names = [s.name for s in inputs]
    if isinstance(item, tuple):
        return _tuple_feed(cfg, i, item, names)
    if not isinstance(item, dict):
        if len(names) > 1:
            raise ConfigError(
                f"calibration batch {i} of reader '{cfg.reader}' is one array; the model takes {len(names)} "
                f"inputs ({', '.join(names)})",
                hint="yield a dict {input name: batch} holding every input",
            )
        return {names[0]: item}
    keys = list(item)
    item = {k: v for k, v in item.items() if k in names or not is_label_name(k)}  # a DataLoader's batch: its labels
    if len(names) == 1 and len(item) == 1 and names[0] not in item:
        (key,) = item
        taken.add(key)
        return {names[0]: item[key]}
    missing = [n for n in names if n not in item]
    extra = [k for k in item if k not in names]
    if missing or extra:
        said = [f"lacks {', '.join(map(repr, missing))}"] if missing else []
        said += [f"has {', '.join(map(repr, extra))}, which the model does not take"] if extra else []
        raise ConfigError(
            f"calibration batch {i} of reader '{cfg.reader}' has keys {keys}; the model takes {names}"
            + (f": the batch {' and '.join(said)}" if len(names) > 1 else ""),
            hint=f"key each batch by the model's input names: {', '.join(names)}",
        )
    return item


def _tuple_feed(
    cfg: CalibrationConfig, i: int, item: tuple[np.ndarray, ...], names: list[str]
) -> dict[str, np.ndarray]:
    """A tuple batch as a feed: one array per input by position, as :func:`kiln.core.data.feed_for_graph` feeds a
    tuple of the data's; for one input, its first array (a DataLoader's ``(x, y)`` or ``(x, y, ...)`` batch gives
    ``x``, whatever ``y`` is: labels, or targets of ``x``'s shape as a denoiser's or a forecaster's). For several
    inputs, any other count is an error."""
    if len(names) == 1 and item:
        return {names[0]: item[0]}
    if len(item) == len(names):
        return dict(zip(names, item))
    raise ConfigError(
        f"calibration batch {i} of reader '{cfg.reader}' is a tuple of {len(item)} arrays; the model takes "
        f"{len(names)} input{'s' if len(names) > 1 else ''} ({', '.join(names)})",
        hint=f"yield one array per input in this order ({', '.join(names)}), or a dict {{input name: batch}}",
    )


def _check_shapes(i: int, feed: dict[str, np.ndarray], inputs: list[TensorSpec]) -> None:
    """Each array's rank and fixed sizes as its input's; sizes of one named axis (the batch axis included) equal
    across the inputs of the batch."""
    seen: dict[str, tuple[str, int]] = {}  # axis name -> (the input it was first read from, its size there)
    for spec in inputs:
        array = feed[spec.name]
        dims = _axes(spec)
        where = f"calibration batch {i}" + (f" input '{spec.name}'" if len(inputs) > 1 else "")
        fixed = [d if isinstance(d, int) and d > 0 else None for d in dims]
        if array.ndim != len(dims) or any(f is not None and f != n for f, n in zip(fixed, array.shape)):
            raise ConfigError(
                f"{where} has shape {tuple(array.shape)}, the model takes [{', '.join(str(d or '?') for d in dims)}]",
                hint=SHAPE_HINT,
            )
        for axis, size in zip(dims, array.shape):
            if isinstance(axis, str) and axis:
                first, had = seen.setdefault(axis, (spec.name, size))
                if had != size:
                    raise ConfigError(
                        f"calibration batch {i}: input '{spec.name}' has {axis} = {size} and input '{first}' "
                        f"{axis} = {had}; the model takes one {axis} for both",
                        hint="yield the inputs of one batch at matching sizes",
                    )


def _axes(spec: TensorSpec) -> list[int | str]:
    """An input's axes as a reader's batch must match them: a fixed size, a named axis, or 0 (any size); the
    first is the batch axis, ``batch`` unless the graph names it."""
    if not spec.shape:
        return []
    first = spec.shape[0]
    return [first if isinstance(first, str) and first else "batch", *spec.shape[1:]]


def _unusable(item: np.ndarray) -> str | None:
    """Why a batch cannot calibrate ranges (it would give NaN ranges, or none, and INT8 would be dropped quietly):
    no rows, values that are not real numbers, or values that are not finite."""
    if item.dtype.kind not in "biuf":
        return f"holds {item.dtype} values, not real numbers"
    if len(item) == 0:
        return "has no rows"
    if item.dtype.kind == "f" and not np.isfinite(item).all():
        return f"holds {int((~np.isfinite(item)).sum())} NaN or infinite values"
    return None


def _as_batches(source: Iterable[Any]) -> Iterator[ReaderBatch]:
    for item in source:
        yield _as_batch(item)


def _as_batch(item: Any) -> ReaderBatch:
    """One yielded batch as numpy: a dict by input name (the ONNX Runtime reader convention), a tuple of arrays
    (one per input, or a DataLoader's ``(x, y)`` of arrays), or one array. A tuple holding more than arrays is a
    DataLoader's ``(x, y)`` whose ``y`` is no array (a list of labels or of targets): its ``x``, left unread."""
    if isinstance(item, Mapping):
        return {str(k): _as_array(v) for k, v in item.items()}
    if _all_arrays(item):
        return tuple(_as_array(v) for v in item)
    if isinstance(item, (tuple, list)) and item:
        x = item[0]
        return _as_batch(x) if isinstance(x, Mapping) or _all_arrays(x) else _as_array(x)
    return _as_array(item)


def _all_arrays(item: Any) -> bool:
    """Whether ``item`` is a tuple or list of arrays or tensors only."""
    return isinstance(item, (tuple, list)) and all(isinstance(v, np.ndarray) or is_tensor(v) for v in item)


def _as_array(item: Any) -> np.ndarray:
    if is_tensor(item):  # one that needs grad, lives on a GPU, or is bfloat16 (no numpy type)
        import torch  # loaded already: the reader gave a tensor

        item = item.detach().cpu()
        return (item.float() if item.dtype == torch.bfloat16 else item).numpy()
    return np.asarray(item)


def calibration_batches(
    data: DatasetSplits,
    cfg: CalibrationConfig,
    seed: int = 0,
    names: list[str] | None = None,
    inputs: list[TensorSpec] | None = None,
    limit: tuple[int, str] | None = None,
) -> list[Batch]:
    """The calibration batches: the reader's, checked against ``inputs`` (the graph's; default: the data's own,
    by ``names``), else the dataset's; split to at most ``limit`` rows each (:func:`batch_limit`: the most rows,
    and why), so every row calibrates."""
    if cfg.reader:
        batches = reader_batches(cfg, inputs or _data_inputs(data, names))
    else:
        batches = dataset_batches(data, cfg, seed, names)
    return split_batches(batches, *limit) if limit is not None else batches


def batch_limit(
    batch_sizes: list[int], inputs: list[TensorSpec] | None = None, outputs: list[TensorSpec] | None = None
) -> tuple[int, str]:
    """The most rows one calibration (or check) batch may hold, and why: the largest of ``batch_sizes``
    (signature.batch_sizes; a model validated at [1] may read one row a call), or fewer where the graph's outputs
    answer fewer rows a call (:func:`rows_per_call`): a batch of more rows would calibrate on its first rows only."""
    limits = [(max(batch_sizes), f"the largest of signature.batch_sizes {sorted(batch_sizes)}")]
    answered = rows_per_call(inputs or [], outputs or [])
    if answered is not None:
        limits.append((answered, f"the graph's outputs hold {answered} row{'s' if answered > 1 else ''} a call"))
    return min(limits)


def split_batches(batches: list[Batch], most: int, why: str) -> list[Batch]:
    """``batches`` with each of more than ``most`` rows split into consecutive batches of ``most`` rows (the last
    shorter): the same rows in the same order, each read by the model. Said once in the log where any is split."""
    out = [part for batch in batches for part in _split(batch, most)]
    if len(out) > len(batches):
        log.info(
            "calibration: %d rows in %d batches of at most %s (%s), not %s",
            sum(batch_rows(b) for b in batches),
            len(out),
            f"{most} row" if most == 1 else f"{most} rows",
            why,
            "1 batch" if len(batches) == 1 else f"{len(batches)} batches",
        )
    return out


def _split(batch: Batch, most: int) -> list[Batch]:
    """One batch as consecutive batches of at most ``most`` rows (inputs taken in counts of their own, texts beside
    images, each cut into as many parts: :func:`~kiln.core.feeds.in_batches`)."""
    if isinstance(batch, dict):
        return in_batches(batch, most)
    return [batch[i : i + most] for i in range(0, batch_rows(batch), most)]


def batch_rows(batch: Batch) -> int:
    """The rows of a batch (of its first input, for a feed)."""
    return len(next(iter(batch.values())) if isinstance(batch, dict) else batch)


def _data_inputs(data: DatasetSplits, names: list[str] | None) -> list[TensorSpec]:
    """The data's inputs as a graph would take them: any batch size, a sample's shape, the data's dtype."""
    parts = tensors(data.val_x)
    keys = names or list(data.sample_shapes)
    return [TensorSpec(name=k, shape=["batch", *t.shape[1:]], dtype=str(t.numpy().dtype)) for k, t in zip(keys, parts)]


def hash_batches(batches: list[ReaderBatch]) -> str:
    """Content hash of the calibration data (names, shapes, dtypes and bytes): part of the cache key."""
    h = hashlib.sha256()
    flat = [a for b in batches for a in _named_arrays(b)]
    for name, b in flat:
        if name is not None:
            h.update(name.encode())
        b = np.ascontiguousarray(b)
        h.update(f"{b.shape}{b.dtype}".encode())
        h.update(memoryview(b).cast("B") if b.size else b"")  # the buffer itself: no copy of a large dataset
    return h.hexdigest()


def _named_arrays(batch: ReaderBatch) -> list[tuple[str | None, np.ndarray]]:
    """A batch's arrays with their input names (None: by position)."""
    if isinstance(batch, dict):
        return list(batch.items())
    return [(None, a) for a in batch] if isinstance(batch, tuple) else [(None, batch)]


class ArrayReader:
    """An ``onnxruntime.quantization.CalibrationDataReader`` over in-memory batches (re-iterable via ``rewind``)."""

    def __init__(self, input_name: str, batches: list[Batch]) -> None:
        self.input_name, self.batches, self._i = input_name, batches, 0
        self.reads = 0  # how many batches were consumed: lets tests prove a cache hit skipped calibration

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self._i >= len(self.batches):
            return None
        self._i += 1
        self.reads += 1
        batch = self.batches[self._i - 1]
        return batch if isinstance(batch, dict) else {self.input_name: batch}

    def rewind(self) -> None:
        self._i = 0

    def __len__(self) -> int:
        return len(self.batches)

    def set_range(self, start_index: int, end_index: int) -> None:  # part of ORT's reader protocol
        self._i = start_index
