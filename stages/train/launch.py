"""Start a multi-process training job on this node with PyTorch's own launcher (``torch.distributed.run``).

The stage does not fork workers itself: it runs ``python -m torch.distributed.run --standalone
--nproc_per_node N -m kiln.stages.train.worker``, streams its output into the log, and reads back what rank 0
wrote (weights, ``summary.json``, or ``error.json`` with a user-facing error).
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
from collections import deque
from pathlib import Path
from typing import Any

from kiln.core.artifacts import write_json_atomic
from kiln.core.child_processes import die_with_parent
from kiln.core.errors import ConfigError, TrainingError
from kiln.stages.train.checkpoint import find_resume
from kiln.stages.train.config import TrainConfig
from kiln.stages.train.data import local_batch_size
from kiln.stages.train.dist import DistEnv, backend_for
from kiln.stages.train.precision import resolve_device

SUMMARY = "summary.json"
ERROR = "error.json"
STOP_TIMEOUT_S = 20.0  # torchrun's own stop of its workers (SIGTERM each) takes about a second


def torchrun_command(
    nproc: int, config_path: Path, out: Path, ckpt_dir: Path, sources_path: Path | None = None
) -> list[str]:
    sources = ["--sources", str(sources_path)] if sources_path is not None else []
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
        *sources,
    ]


def _check_gpus(train: TrainConfig, nproc: int) -> None:
    import torch

    wants_cuda = train.device == "cuda" or (train.device == "auto" and torch.cuda.is_available())
    if wants_cuda and nproc > torch.cuda.device_count():
        raise TrainingError(
            f"train.distributed.nproc_per_node is {nproc} but {torch.cuda.device_count()} GPUs are visible",
            hint="one process per GPU: lower nproc_per_node (or train.device: cpu)",
        )


def main_module_refs(settings: dict[str, Any], prefix: str = "") -> list[tuple[str, str]]:
    """The ``(key, ref)`` pairs of the settings whose value names code in ``__main__`` (``'__main__:build'``)."""
    found: list[tuple[str, str]] = []
    for key, value in settings.items():
        if isinstance(value, dict):
            found += main_module_refs(value, f"{prefix}{key}.")
        elif isinstance(value, str) and value.startswith("__main__:"):
            found.append((f"{prefix}{key}", value))
    return found


def _refuse_main_refs(config: Any) -> None:
    """Code named in ``__main__`` (a function of the script that called the Python API) cannot reach the torchrun
    workers: their ``__main__`` is ``kiln.stages.train.worker``, so each would fail only after the launch."""
    refs = main_module_refs(config.dump())
    if not refs:
        return
    key, ref = refs[0]
    names = " and ".join(dict.fromkeys(r.split(":", 1)[1] for _, r in refs))
    raise ConfigError(
        f"{key} {ref!r} is defined in your script, which the torchrun workers cannot import",
        hint=f"move {names} into a module file beside the script (e.g. mymodels.py) and name it "
        f"'mymodels:{ref.split(':', 1)[1]}'",
    )


def _check_cpu_cores(nproc: int, log: logging.Logger) -> None:
    """Processes beyond the CPU cores this process may run on share cores and train slower than fewer would."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if nproc > cores:
        log.warning(
            "train.distributed.nproc_per_node is %d but this machine gives Kiln %d CPU cores: each process runs one "
            "thread, and processes sharing a core train slower than fewer processes would (lower nproc_per_node)",
            nproc,
            cores,
        )


def check_before_launch(config: Any, ckpt_dir: Path, log: logging.Logger) -> None:
    """The worker-side checks that need only the settings and the number of processes, run before torchrun starts:
    a mistake is then said at once, rather than by every worker after the launch."""
    train: TrainConfig = config.train
    nproc = train.distributed.nproc_per_node
    _refuse_main_refs(config)
    _check_gpus(train, nproc)
    local_batch_size(train, DistEnv(0, nproc))
    device = resolve_device(train)
    backend_for(train.distributed, device)
    if train.checkpoint.resume not in ("auto", "never"):
        find_resume(train.checkpoint.resume, ckpt_dir, key="")  # an explicit path: refused when missing
    if device.type == "cpu":
        _check_cpu_cores(nproc, log)


def run_torchrun(
    config: Any, out: Path, ckpt_dir: Path, log: logging.Logger, sources: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Train with torchrun; ``config``: the stage's settings, handed to the workers as a run config of those
    sections (a JSON file they load like any config); ``sources``: what the run trains from (``train_to``)."""
    nproc = config.train.distributed.nproc_per_node
    check_before_launch(config, ckpt_dir, log)
    config_path = ckpt_dir / "worker_config.json"
    write_json_atomic(config_path, config.dump())
    sources_path = None
    if sources is not None:
        sources_path = ckpt_dir / "worker_sources.json"
        write_json_atomic(sources_path, sources)
    cmd = torchrun_command(nproc, config_path, out, ckpt_dir, sources_path)
    log.info("launching: %s", " ".join(cmd))
    tail: deque[str] = deque(maxlen=30)
    said: set[str] = set()
    proc = start_launcher(cmd)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            relay(line.rstrip(), log, said)
            tail.append(line)
        proc.wait()
    finally:  # Ctrl-C, SIGTERM or an error here: the job must not train on without Kiln
        stop_launcher(proc, log)
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


# A worker's own log line (kiln.stages.train.worker's format): its rank, level, logger and message
WORKER_LINE = re.compile(r"\[rank \d+\] (WARNING|ERROR|CRITICAL) (kiln[\w.]*): (.*)")


def relay(line: str, log: logging.Logger, said: set[str]) -> None:
    """One line of torchrun's output into this process's log: a worker's warning as a warning, said once however
    many ranks say it (``said``: the messages said so far; the other ranks' lines of it at debug level, -vv),
    a worker's error at debug level (``error.json`` carries it, raised once by :func:`run_torchrun`), everything
    else (torchrun's own output, the workers' info) at info level, which -v shows."""
    found = WORKER_LINE.fullmatch(line)
    if found is None:
        log.info("[torchrun] %s", line)
        return
    if found.group(1) != "WARNING" or found.group(3) in said:
        log.debug("[torchrun] %s", line)
        return
    said.add(found.group(3))
    log.warning("%s (from the torchrun workers)", found.group(3))


def start_launcher(cmd: list[str]) -> subprocess.Popen[str]:
    """Start torchrun in a process group of its own, which :func:`stop_launcher` signals as one, with SIGTERM
    asked for when this process ends (``PR_SET_PDEATHSIG``, as ``kiln serve`` starts Triton): a Kiln killed
    outright (SIGKILL) still stops it, and torchrun stops its workers. Call it from the thread that waits on it."""
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        preexec_fn=die_with_parent(),
    )


def stop_launcher(proc: subprocess.Popen[str], log: logging.Logger, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """Stop a torchrun still running: SIGTERM to its process group (torchrun then stops its workers), its output
    read meanwhile so that it never blocks on a full pipe; after ``timeout_s``, SIGKILL to the group and to the
    workers, which torchrun starts each in a session of its own."""
    if proc.poll() is None:
        log.warning("stopping torchrun (pid %d) and its workers", proc.pid)
        workers = _children(proc.pid)
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            rest, _ = proc.communicate(timeout=timeout_s)
            for line in (rest or "").splitlines():
                log.info("[torchrun] %s", line)
        except subprocess.TimeoutExpired:
            log.warning("torchrun did not stop within %.0f s: killing it and its workers", timeout_s)
            for pid in workers | _children(proc.pid) | {proc.pid}:
                _signal_group(pid, signal.SIGKILL)
            proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):  # already gone (or its id reused by another user's)
        pass


def _children(pid: int) -> set[int]:
    """The ids of ``pid``'s child processes (Linux ``/proc``; none elsewhere)."""
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            found.update(int(c) for c in task.read_text().split())
        except OSError:  # the process ended meanwhile
            pass
    return found
