"""Calibration data: a fixed number of batches from the run's dataset, or from a user reader by import path.

The dataset's tensors are already preprocessed exactly as the validation split is (one function makes both),
so calibration sees the same distribution the accuracy gates are measured on.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch

from kiln.calibration.config import CalibrationConfig
from kiln.core.data import DatasetSplits, feed_for_graph, rows, take, tensors
from kiln.core.errors import ConfigError
from kiln.core.user_errors import running_user_code, user_frame
from kiln.models.registry import resolve_callable

log = logging.getLogger("kiln.calibration")


Batch = np.ndarray | dict[str, np.ndarray]  # one input's rows, or a feed of named inputs


def dataset_batches(
    data: DatasetSplits, cfg: CalibrationConfig, seed: int = 0, names: list[str] | None = None
) -> list[Batch]:
    """``num_batches`` x ``batch_size`` samples of the training split, in a seeded order (deterministic), at the
    data's real shapes. ``names``: the model's input names, to give feeds (required for several inputs)."""
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


def read_reader(cfg: CalibrationConfig) -> list[np.ndarray]:
    """Call the user's reader and take its first ``num_batches`` batches, as they come."""
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
                hint="return (or yield) numpy arrays / torch tensors of shape [batch, *input_shape]",
            )
        batches = [item for _, item in zip(range(cfg.num_batches), _as_arrays(source))]
    if not batches:
        raise ConfigError(f"calibration.reader '{cfg.reader}' yielded no batches", hint="yield at least one batch")
    return batches


def reader_batches(cfg: CalibrationConfig, sample_shape: tuple[int, ...], dtype: np.dtype) -> list[np.ndarray]:
    """The user reader's batches, checked against the model's input and cast to its dtype."""
    batches = read_reader(cfg)
    for i, item in enumerate(batches):
        if tuple(item.shape[1:]) != tuple(sample_shape):
            raise ConfigError(
                f"calibration batch {i} has shape {tuple(item.shape)}, the model takes "
                f"[batch, {', '.join(map(str, sample_shape))}]",
                hint="preprocess calibration data exactly like validation data",
            )
        problem = _unusable(item)
        if problem is not None:
            raise ConfigError(
                f"calibration batch {i} of reader '{cfg.reader}' {problem}",
                hint="yield real numbers, one row or more per batch, preprocessed exactly like validation data",
            )
    return [item.astype(dtype, copy=False) for item in batches]


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


def _as_arrays(source: Iterable[Any]) -> Iterator[np.ndarray]:
    for item in source:
        if isinstance(item, dict):  # {input_name: array}, the ONNX Runtime reader convention
            item = next(iter(item.values()))
        if isinstance(item, (tuple, list)):  # (x, y) pairs from a DataLoader
            item = item[0]
        if isinstance(item, torch.Tensor):  # one that needs grad, lives on a GPU, or is bfloat16 (no numpy type)
            item = item.detach().cpu()
            yield (item.float() if item.dtype == torch.bfloat16 else item).numpy()
        else:
            yield np.asarray(item)


def calibration_batches(
    data: DatasetSplits, cfg: CalibrationConfig, seed: int = 0, names: list[str] | None = None
) -> list[Batch]:
    if cfg.reader:
        if len(tensors(data.val_x)) > 1:
            raise ConfigError(
                "calibration.reader feeds one input; this model takes several",
                hint="remove calibration.reader: calibration then uses the dataset's inputs",
            )
        return reader_batches(cfg, data.input_shape, tensors(data.val_x)[0].numpy().dtype)
    return dataset_batches(data, cfg, seed, names)


def hash_batches(batches: list[Batch]) -> str:
    """Content hash of the calibration data (names, shapes, dtypes and bytes): part of the cache key."""
    h = hashlib.sha256()
    flat = [a for b in batches for a in (b.items() if isinstance(b, dict) else [(None, b)])]
    for name, b in flat:
        if name is not None:
            h.update(name.encode())
        b = np.ascontiguousarray(b)
        h.update(f"{b.shape}{b.dtype}".encode())
        h.update(memoryview(b).cast("B") if b.size else b"")  # the buffer itself: no copy of a large dataset
    return h.hexdigest()


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
