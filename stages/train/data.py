"""Batches for the loop: torch DataLoader over a TensorDataset, sharded and shuffled by DistributedSampler.

The same sampler is used with one process (num_replicas=1), so a single-process run sees exactly the global
batches a multi-process run sees: rank r's j-th local batch is elements ``r::W`` of global batch j.
The loader yields one process's share of a *global* batch; the loop splits it into accumulation
micro-batches, so the last, smaller batch of an epoch is weighted exactly like a full one.
"""

from __future__ import annotations

import gc
import itertools
import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from kiln.core.data import Inputs, rebuild, rows, tensors
from kiln.core.errors import ConfigError
from kiln.stages.train.config import LoaderConfig, TrainConfig
from kiln.stages.train.dist import DistEnv

log = logging.getLogger("kiln.train")


class ResumableSampler(DistributedSampler):
    """DistributedSampler that can start an epoch part-way (resume after ``start`` local samples).

    Hand-written because torch's samplers have no offset; torchdata's StatefulDataLoader would do it
    but is not a dependency.
    """

    start = 0

    def set_position(self, epoch: int, start: int = 0) -> None:
        self.set_epoch(epoch)
        self.start = start

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(super().__iter__(), self.start, None)

    def __len__(self) -> int:
        return self.num_samples - self.start


def local_batch_size(cfg: TrainConfig, env: DistEnv) -> int:
    if cfg.batch_size % env.world_size:
        raise ConfigError(
            f"train.batch_size {cfg.batch_size} is not divisible by {env.world_size} processes",
            hint="make the global batch a multiple of the number of processes",
        )
    return cfg.batch_size // env.world_size


class DeviceBatches:
    """Batches of a device-resident dataset, in exactly the order ``BatchSampler(sampler)`` gives.

    Hand-written because indexing a CUDA tensor with a Python list (what DataLoader + TensorDataset do)
    copies the indices from pageable memory and synchronises the stream on every batch. Here the epoch's
    indices go to the device once, from pinned memory without blocking, and each batch is an index_select.
    """

    def __init__(self, x: Inputs, y: torch.Tensor, sampler: ResumableSampler, batch: int) -> None:
        self.x, self.y, self.sampler, self.batch = x, y, sampler, batch

    def __iter__(self) -> Iterator[tuple[Inputs, torch.Tensor]]:
        idx = torch.tensor(list(self.sampler), dtype=torch.long)
        if self.y.is_cuda:
            idx = idx.pin_memory().to(self.y.device, non_blocking=True)
        for part in idx.split(self.batch):
            yield rebuild(self.x, [t.index_select(0, part) for t in tensors(self.x)]), self.y.index_select(0, part)

    def __len__(self) -> int:
        return -(-len(self.sampler) // self.batch)


class _Structured:
    """The loader's flat ``(*inputs, y)`` tuples back in the data's input structure (tensor, tuple or dict)."""

    def __init__(self, loader: DataLoader, like: Inputs) -> None:
        self.loader, self.like = loader, like

    def __iter__(self) -> Iterator[tuple[Inputs, torch.Tensor]]:
        for *xs, y in forked_iter(self.loader):
            yield rebuild(self.like, xs), y


def forked_iter(loader: DataLoader) -> Iterator[Any]:
    """``iter(loader)``, whose worker processes (``num_workers`` > 0) are forked with the garbage collector's
    objects frozen: a worker collects none of the objects it inherits. A forked child that collects one that owns
    threads of its parent's (an ONNX Runtime session left for the collector: the data function's, a notebook's)
    waits forever on a lock no thread of the child holds; the parent collects its garbage first, where it can."""
    if not loader.num_workers:
        return iter(loader)
    gc.collect()
    gc.freeze()
    try:
        return iter(loader)
    finally:
        gc.unfreeze()

    def __len__(self) -> int:
        return len(self.loader)


def make_loader(
    x: Inputs, y: torch.Tensor, cfg: TrainConfig, env: DistEnv, seed: int, device: torch.device
) -> tuple[Iterable[tuple[Inputs, torch.Tensor]], ResumableSampler]:
    """Batches of this process's share of each global batch, in the order fixed by ``seed`` and the epoch."""
    lc: LoaderConfig = cfg.loader
    n = rows(x)
    if n % env.world_size and env.enabled:
        log.warning(
            "%d samples over %d processes: DistributedSampler repeats %d samples to even the shards",
            n,
            env.world_size,
            env.world_size - n % env.world_size,
        )
    warn_ignored_loader_settings(lc, device)
    if env.is_main:
        warn_batch_over_rows(n, cfg.batch_size)
    dataset = TensorDataset(*tensors(x), y)
    sampler = ResumableSampler(dataset, num_replicas=env.world_size, rank=env.rank, shuffle=True, seed=seed)
    warn_one_row_last_batch(sampler.num_samples, local_batch_size(cfg, env), env)
    if lc.on_device:
        on_dev = rebuild(x, [t.to(device) for t in tensors(x)])
        return DeviceBatches(on_dev, y.to(device), sampler, local_batch_size(cfg, env)), sampler
    # A BatchSampler as the sampler with batch_size=None: the dataset is indexed with the whole list of
    # indices at once (one gather per batch instead of one per sample plus a collate).
    batches = BatchSampler(sampler, local_batch_size(cfg, env), drop_last=False)
    workers = lc.num_workers
    pin = device.type == "cuda" if lc.pin_memory is None else lc.pin_memory
    loader = DataLoader(
        dataset,
        sampler=batches,
        batch_size=None,
        num_workers=workers,
        pin_memory=pin and torch.cuda.is_available(),
        persistent_workers=lc.persistent_workers and workers > 0,
        prefetch_factor=lc.prefetch_factor if workers > 0 else None,
        # Its own generator, so creating iterators never draws from the global RNG (dropout).
        generator=torch.Generator().manual_seed(seed),
    )
    return _Structured(loader, x), sampler


def warn_ignored_loader_settings(lc: LoaderConfig, device: torch.device) -> None:
    """One warning naming the ``train.loader`` settings that do nothing in this run, and why."""
    ignored = []
    if not lc.num_workers:
        if lc.persistent_workers:
            ignored.append("persistent_workers (num_workers is 0: there are no workers to keep)")
        if lc.prefetch_factor is not None:
            ignored.append("prefetch_factor (num_workers is 0: no worker loads ahead)")
    if device.type != "cuda":
        if lc.pin_memory:
            ignored.append("pin_memory (training runs on the CPU, no GPU to copy to)")
        if lc.on_device:
            ignored.append("on_device (training runs on the CPU, where the data already is)")
    if ignored:
        log.warning("train.loader settings ignored: %s", "; ".join(ignored))


def warn_batch_over_rows(num_rows: int, batch_size: int) -> None:
    """Say when train.batch_size is larger than the training split: each epoch is one step on the whole split, which
    a model learns little from in a few epochs, and the setting does not mean what it says."""
    if batch_size > num_rows:
        log.warning(
            "train.batch_size %d is larger than the %d training rows: one step per epoch, the batch is the whole "
            "split; lower train.batch_size (below %d) for more steps an epoch",
            batch_size,
            num_rows,
            num_rows,
        )


def warn_one_row_last_batch(num_samples: int, local_batch: int, env: DistEnv) -> None:
    """Say when each epoch ends on a batch of one row per process: it is weighted like a full batch, and a model
    with BatchNorm layers cannot train on one row (PyTorch then fails in the model's forward pass)."""
    if local_batch > 1 and num_samples % local_batch == 1:
        log.warning(
            "the epoch's last batch on each process has 1 row (%d rows per process, %d per batch): BatchNorm cannot "
            "train on one row, and the step weighs it like a full batch; change train.batch_size (e.g. %d)",
            num_samples,
            local_batch,
            _batch_without_one_row(num_samples, local_batch) * env.world_size,
        )


def _batch_without_one_row(num_samples: int, local_batch: int) -> int:
    """The batch size per process nearest ``local_batch`` whose epoch does not end on a batch of one row."""
    for step in range(1, local_batch):
        for size in (local_batch - step, local_batch + step):
            if size > 1 and num_samples % size != 1:
                return size
    return local_batch + 1


def micro_batches(xb: Inputs, yb: torch.Tensor, steps: int) -> list[tuple[Inputs, torch.Tensor]]:
    """Split one process's batch into at most ``steps`` micro-batches (fewer for a short last batch). A last
    micro-batch of one row joins the one before it (BatchNorm cannot train on one row); each micro-batch's loss is
    weighted by its share of the batch, so the update is the same."""
    if steps == 1:  # no accumulation: the batch itself, without the views and rebuilding of a split
        return [(xb, yb)]
    n = rows(xb)
    size = -(-n // steps)
    sizes = [size] * (n // size) + ([n % size] if n % size else [])
    if len(sizes) > 1 and sizes[-1] == 1 and size > 1:
        sizes[-2:] = [size + 1]
    parts = zip(*(t.split(sizes) for t in tensors(xb)))
    return [(rebuild(xb, list(p)), y) for p, y in zip(parts, yb.split(sizes))]
