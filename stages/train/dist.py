"""torch.distributed plumbing: read the torchrun environment, start/stop the process group, wrap in DDP.

Kiln never launches processes itself beyond calling ``torch.distributed.run`` (see ``launch.py``);
everything here reads what torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT).
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist
from torch import nn

from kiln.core.errors import TrainingError
from kiln.stages.train.config import DistributedConfig

log = logging.getLogger("kiln.train")


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Only the main process writes artifacts, checkpoints and logs metrics."""
        return self.rank == 0


def env_from_torchrun() -> DistEnv:
    """The process's place in the job, from torchrun's variables; a plain process is rank 0 of 1."""
    if "WORLD_SIZE" not in os.environ:
        return DistEnv()
    return DistEnv(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)))


def backend_for(cfg: DistributedConfig, device: torch.device) -> str:
    if cfg.backend != "auto":
        if cfg.backend == "nccl" and device.type != "cuda":
            raise TrainingError("train.distributed.backend 'nccl' needs CUDA", hint="use backend: gloo or auto")
        return cfg.backend
    return "nccl" if device.type == "cuda" else "gloo"


@contextmanager
def process_group(env: DistEnv, cfg: DistributedConfig, device: torch.device) -> Iterator[None]:
    """Initialise the default process group for the job (no-op for one process) and always tear it down."""
    if not env.enabled or dist.is_initialized():
        yield
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = backend_for(cfg, device)
    dist.init_process_group(backend, device_id=device if backend == "nccl" else None)
    log.info("rank %d/%d joined (%s on %s)", env.rank, env.world_size, backend, device)
    try:
        yield
        # Everyone done before anyone tears down: a peer closing its sockets while another still polls
        # them can abort the slower process.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def end_worker(code: int) -> NoReturn:
    """End a torchrun worker process with ``code`` once its results are written, skipping interpreter shutdown.

    DDP keeps its gloo process group alive past ``destroy_process_group`` (the reducer holds it), so gloo's
    native threads are still running while Python finalizes; one that releases a finished collective's tensors
    then needs the GIL of an interpreter going away, and the C++ runtime aborts the process (SIGABRT, "terminate
    called without an active exception"; pytorch/pytorch#179291). Logs and standard streams are flushed first.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing left to save
            pass
    os._exit(code)


def wrap_ddp(model: nn.Module, env: DistEnv, cfg: DistributedConfig, device: torch.device) -> nn.Module:
    """DistributedDataParallel with the configured buckets; SyncBatchNorm first when asked (CUDA only). One process
    trains the module itself, and a sync_batchnorm asked for does nothing there: said once."""
    if not env.enabled:
        if cfg.sync_batchnorm:
            log.warning(
                "train.distributed.sync_batchnorm ignored: one process trains (nproc_per_node 1), so BatchNorm's "
                "statistics are already over the whole batch"
            )
        return model
    if cfg.sync_batchnorm:
        if device.type != "cuda":
            raise TrainingError(
                "train.distributed.sync_batchnorm needs CUDA (PyTorch's SyncBatchNorm is GPU-only)",
                hint="set sync_batchnorm: false for CPU runs",
            )
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return nn.parallel.DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=cfg.bucket_cap_mb,
        gradient_as_bucket_view=cfg.gradient_as_bucket_view,
        find_unused_parameters=cfg.find_unused_parameters,
    )


def all_sum(values: list[float], device: torch.device, env: DistEnv) -> list[float]:
    """Sum a few numbers over all processes (one small all-reduce); identity for one process."""
    if not env.enabled:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


# How DistributedDataParallel (without find_unused_parameters) fails when a parameter got no gradient in a step
UNUSED_SAID = "Expected to have finished reduction in the prior iteration"
UNUSED_INDICES = re.compile(r"Parameter indices which did not receive grad for rank \d+: ([\d ]+)")


def unused_parameters_error(exc: BaseException, model: nn.Module) -> TrainingError | None:
    """DDP's error for a parameter the loss does not use, as one error naming them and the setting that fixes it;
    None for any other error. DDP waits for every parameter's gradient before it averages them, and fails the next
    step's forward pass when one never came."""
    said = str(exc)
    if UNUSED_SAID not in said:
        return None
    names = [name for name, p in model.named_parameters() if p.requires_grad]  # DDP's order of the indices
    found = UNUSED_INDICES.search(said)
    unused = [names[int(i)] for i in found.group(1).split() if int(i) < len(names)] if found else []
    which = f" ({', '.join(unused[:6])}{', ...' if len(unused) > 6 else ''})" if unused else ""
    return TrainingError(
        f"parameters of the model got no gradient from the loss{which}: with several processes "
        "DistributedDataParallel then fails, waiting for their gradients",
        hint="set train.distributed.find_unused_parameters: true, or freeze (requires_grad_(False)) or remove what "
        "the loss does not use",
    )
