"""Start a multi-process training job on this node with PyTorch's own launcher (``torch.distributed.run``).

The stage does not fork workers itself: it runs ``python -m torch.distributed.run --standalone
--nproc_per_node N -m kiln.stages.train.worker``, streams its output into the log, and reads back what rank 0
wrote (weights, ``summary.json``, or ``error.json`` with a user-facing error).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections import deque
from pathlib import Path
from typing import Any

from kiln.core.artifacts import write_json_atomic
from kiln.core.errors import TrainingError
from kiln.stages.train.config import TrainConfig

SUMMARY = "summary.json"
ERROR = "error.json"


def torchrun_command(nproc: int, config_path: Path, out: Path, ckpt_dir: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "kiln.stages.train.worker",
        "--config",
        str(config_path),
        "--out",
        str(out),
        "--checkpoint-dir",
        str(ckpt_dir),
    ]


def _check_gpus(train: TrainConfig, nproc: int) -> None:
    import torch

    wants_cuda = train.device == "cuda" or (train.device == "auto" and torch.cuda.is_available())
    if wants_cuda and nproc > torch.cuda.device_count():
        raise TrainingError(
            f"train.distributed.nproc_per_node is {nproc} but {torch.cuda.device_count()} GPUs are visible",
            hint="one process per GPU: lower nproc_per_node (or train.device: cpu)",
        )


def run_torchrun(config: Any, out: Path, ckpt_dir: Path, log: logging.Logger) -> dict[str, Any]:
    """Train with torchrun; ``config``: the stage's settings, handed to the workers as a run config of those
    sections (a JSON file they load like any config)."""
    nproc = config.train.distributed.nproc_per_node
    _check_gpus(config.train, nproc)
    config_path = ckpt_dir / "worker_config.json"
    write_json_atomic(config_path, config.dump())
    cmd = torchrun_command(nproc, config_path, out, ckpt_dir)
    log.info("launching: %s", " ".join(cmd))
    tail: deque[str] = deque(maxlen=30)
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            log.info("[torchrun] %s", line.rstrip())
            tail.append(line)
    if (out / ERROR).is_file():
        err = json.loads((out / ERROR).read_text())
        raise TrainingError(err["message"], hint=err.get("hint"))
    if proc.returncode != 0 or not (out / SUMMARY).is_file():
        raise TrainingError(
            f"torchrun ({nproc} processes) exited with code {proc.returncode}:\n" + "".join(tail),
            hint="see the log above; run the worker by hand: " + " ".join(cmd),
        )
    summary = json.loads((out / SUMMARY).read_text())
    (out / SUMMARY).unlink()  # the manifest holds it; keep the folder the same as a one-process run's
    return summary
