"""``kiln serve``: the validated engines of a workdir (or one engine folder) behind a real Triton server.

By default (:func:`serve_python_backend`) the ``tritonserver`` bundled in PyTriton's wheel runs a Python-backend
repository written for the engines (the ``package/triton-python`` layout): each model instance is a Triton stub
process that loads the engine and gets the dynamic batcher's requests (queued for up to ``max_queue_delay_us``) as
one concatenated batch. CUDA engines get several instances per GPU (``--gpus``, ``--instances-per-gpu``), each stub
pinned to its GPU. This path has no hop beyond Triton's own stub: measured against PyTriton's (``--pytriton``: the
engines run in this process, bound with ``Triton.bind``) it served 2.8-7.3x the requests on an H200 and 1.8-3.1x on
a 2-core CPU (benchmarks/README.md, Serving). Names, dtypes and shapes come from ``kiln-engine.json``; health and
readiness are Triton's own ``/v2/health/live`` and ``/v2/health/ready``.

SIGINT and SIGTERM stop the server and its stubs: the models are unloaded first (:func:`drain_models`: new requests
are refused, those in flight answered) for up to ``EXIT_TIMEOUT_S``, and whatever of the server still runs
``STOP_DEADLINE_S`` after the signal is killed (:class:`_Reaper`), so nothing outlives ``kiln serve`` and it is gone
within Kubernetes' grace period with room to
spare. A signal before the server is ready ends the start at its next step or poll (:class:`_StopRequest`): nothing
was served, ``on_ready`` is never called, and the CLI exits 130 (143) saying so. A ``kiln serve`` killed outright
(SIGKILL, out of memory) takes its ``tritonserver`` with it: the server is started with a parent-death signal
(:func:`server_popen`), and Kiln's stubs end themselves once their server is gone (:mod:`kiln.serve.stub_parent`).
A server that cannot start says so within seconds: ports are checked the way the server binds them before anything
starts (a port an orphaned ``tritonserver`` holds names its process), and a ``tritonserver`` that dies while starting
ends the wait for it at once with its log's error. A served workdir is marked as such while it is served
(:func:`kiln.pipeline.workdir_lock.served_workdir`): a ``kiln run`` there is refused until the server stops, and a
workdir a run holds is not served.
"""

from __future__ import annotations

import errno
import functools
import http.client
import importlib.util
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from datetime import datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from kiln.core import interrupt
from kiln.core.artifacts import read_manifest
from kiln.core.child_processes import die_with_parent
from kiln.core.errors import (
    BackendUnavailable,
    ConfigError,
    GateFailure,
    InputError,
    InputFileError,
    KilnError,
    storage_error,
)
from kiln.core.records import EngineMetadata, ValidationResult, steps_text
from kiln.core.text import first_line
from kiln.pipeline.manifests import changed_inputs
from kiln.pipeline.workdir_lock import LOCK_NAME, served_workdir
from kiln.serve.batching import buckets_for, padded_infer, request_fault, warm_buckets
from kiln.stages.engines.backend import SIDECAR, read_metadata
from kiln.stages.engines.registry import load_engine, runnable
from kiln.stages.package import INDEX as PACKAGE_INDEX
from kiln.stages.package.triton import scalar_tensors, served_max_batch, unbatchable_reason, write_python_model

log = logging.getLogger("kiln.serve.server")
INSTALL_HINT = 'pip install "kiln[serve]"'
# Triton waits this long for in-flight requests at shutdown, then exits anyway (its default is 30 s).
EXIT_TIMEOUT_S = 3
# After a stop signal, whatever of the server still runs this long after is killed: the whole tree is gone within
# 10 s (issue 34), a third of Kubernetes' default grace period (30 s) before its SIGKILL.
STOP_DEADLINE_S = 7.0
# How long a starting server may take to answer its readiness probe (a loaded 2-core machine needs ~30 s)
STARTUP_TIMEOUT_S = 120.0
# AF_UNIX socket paths hold at most 107 bytes on Linux (sun_path is 108 with its NUL)
MAX_SOCKET_PATH = 107
# Where the server's sockets go when the scratch folder's path is too long for them (a deep TMPDIR)
SHORT_SOCKET_ROOT = Path("/tmp")


class PortInUse(KilnError):
    """A port the server must listen on is taken (or cannot be listened on)."""


class ServerDied(KilnError):
    """The ``tritonserver`` process ended while it was starting or serving."""


@dataclass
class ServedEngine:
    model_name: str
    engine_dir: Path
    meta: EngineMetadata


def _validation_verdicts(workdir: Path) -> dict[str, Any] | None:
    result = _validation(workdir)
    return None if result is None else {e.name: e.passed for e in result.engines}


def _validation(workdir: Path) -> ValidationResult | None:
    path = workdir / "validate" / "validation.json"
    return ValidationResult.read(path, hint="rerun `kiln run --force validate`") if path.is_file() else None


def _as_validated(meta: EngineMetadata, workdir: Path) -> EngineMetadata:
    """An engine of ``workdir``'s build/ as the package stage would record it: with the outputs validation found
    not to be the samples' rows (served unbatched) and the batch sizes it was validated at (served up to the
    largest)."""
    result = _validation(workdir)
    return meta if result is None else result.served_metadata(meta)


def _refuse(verdicts: dict[str, Any]) -> None:
    """Refuse engines (name -> validation's verdict) unless every one passed, saying which failed and which no
    validation ran (built for a device the validating machine does not have)."""
    failed = [name for name, passed in verdicts.items() if passed is False]
    unrun = [name for name, passed in verdicts.items() if passed is not True and passed is not False]
    states = [f"{', '.join(failed)} failed validation"] if failed else []
    if unrun:
        states.append(f"{', '.join(unrun)} not validated on a machine that can run {'them' if unrun[1:] else 'it'}")
    if states:
        fixes = ["fix the engine and `kiln run` again (see report.md)"] if failed else []
        fixes += ["validate it where it runs (`kiln run` or `kiln validate` on that machine)"] if unrun else []
        raise GateFailure(
            f"engine {'; '.join(states)}: Kiln serves only engines proven against PyTorch",
            hint="; ".join(fixes) + ", or serve another engine",
        )


def _unvalidated_sizes(meta: EngineMetadata) -> str:
    """The sizes a server takes for an engine no validation has seen, as its own record bounds them (the sizes it
    was built for, ``kiln-engine.json``'s ``axis_ranges``, and its profiles' largest batch); any, where none."""
    bounds = [
        f"{dim} from {low} to {high}{steps_text(meta.axis_steps.get(dim, [1, 0]), (low, high))}"
        for dim, (low, high) in meta.axis_ranges.items()
    ]
    limit = meta.max_batch()
    bounds += [f"batches up to {limit}"] if limit is not None else []
    if not bounds:
        return "at any size its axes take"
    return f"only at the sizes it records, those it was built for ({', '.join(bounds)})"


def changed_since_packaged(workdir: Path) -> tuple[list[str], bool]:
    """The stages ``workdir``'s package was made from whose results are no longer those it was made from, and
    whether a run redid them. Those that hash otherwise than the package recorded (:func:`changed_inputs`) and ran
    again since it was made: True. A stage whose record predates the package's ran on nothing since: its results
    are those packaged, whatever its hash reads now. Where every stage that hashes otherwise predates it, all of
    them are named with False: their files changed since, not by a run (still not the package's)."""
    changed = changed_inputs(workdir, "package")
    packaged = _finished(workdir / "package")
    # a stage of the package's own run finished before it (times to the microsecond): only a later one is a rerun
    rerun = [up for up in changed if packaged is None or (ran := _finished(workdir / up)) is None or ran > packaged]
    return (rerun, True) if rerun else (changed, False)


def _stale_package(path: Path, changed: list[str], rerun: bool, engine: Path) -> GateFailure:
    """The refusal to serve ``path``'s package, made from other results of ``changed`` than the workdir's:
    redone by a later run that did not package (``rerun``), or their files changed since, by no run."""
    if rerun:
        return GateFailure(
            f"{path / 'package'} holds the engines of an earlier run: {_listed(changed)} changed since it was made "
            f"(a later run redid {'them' if changed[1:] else 'it'} and failed, or stopped, before its package stage)",
            hint="see report.md and `kiln run` again until it passes; to serve the earlier engines anyway, pass "
            f"one's folder: kiln serve {engine}",
        )
    return GateFailure(
        f"{path / 'package'} was made from other results than the workdir holds: the files of {_listed(changed)} "
        "differ from those packaged (changed since it was made, by no run of its stages)",
        hint="`kiln run` again, so that it redoes what those files feed and packages the result; to serve the "
        f"packaged engines anyway, pass one's folder: kiln serve {engine}",
    )


def _finished(stage_dir: Path) -> datetime | None:
    """When the stage in ``stage_dir`` last ran (its manifest's ``finished``), or None where it records no time."""
    try:
        return datetime.fromisoformat((read_manifest(stage_dir) or {})["finished"])
    except (KeyError, TypeError, ValueError):
        return None


def _listed(names: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def find_engines(path: str | Path) -> list[ServedEngine]:
    """The engines to serve under ``path``: one engine folder (refused if its workdir's validation failed it), a
    package folder's ``engines`` (a workdir's ``package``, or a copy of it), a workdir's ``package/engines`` (all
    validated), else its ``build/*`` that ``validate`` passed."""
    path = Path(path).resolve()  # `kiln serve .` inside build/<engine> is that engine of that run
    if (path / SIDECAR).is_file():
        meta = read_metadata(path)
        verdicts = _validation_verdicts(path.parent.parent) if path.parent.name == "build" else None
        if verdicts is not None:
            _refuse({meta.name: verdicts.get(meta.name)})
            meta = _as_validated(meta, path.parent.parent)
        elif not (path.parent.parent / PACKAGE_INDEX).is_file():  # not a package's: no validation has seen it
            log.warning(
                "engine %s has no validation record beside it (a workdir's validate/validation.json, a package's "
                "kiln-package.json): served %s, its checks unknown here (`kiln validate %s --reference MODEL` checks "
                "it and prints the result, keeping no record; serve a `kiln run` workdir or its package to serve "
                "only engines with one)",
                meta.name,
                _unvalidated_sizes(meta),
                path,
            )
        return [ServedEngine(model_name(meta.name), path, meta)]
    if not path.is_dir():
        raise InputFileError(
            f"{path} is neither a Kiln workdir nor an engine folder",
            hint="pass the --workdir of a `kiln run`, or a folder holding kiln-engine.json",
        )
    if (path / PACKAGE_INDEX).is_file():  # a package folder itself (shipped apart from its workdir): all validated
        shipped = sorted(p.parent for p in (path / "engines").glob(f"*/{SIDECAR}"))
        return [ServedEngine(model_name(d.name), d, read_metadata(d)) for d in shipped]
    packaged = sorted(p.parent for p in (path / "package" / "engines").glob(f"*/{SIDECAR}"))
    changed, rerun = changed_since_packaged(path) if packaged else ([], False)
    if changed:
        raise _stale_package(path, changed, rerun, packaged[0])
    if packaged:
        return [ServedEngine(model_name(d.name), d, read_metadata(d)) for d in packaged]
    built = sorted(p.parent for p in (path / "build").glob(f"*/{SIDECAR}"))
    verdicts = _validation_verdicts(path)
    if not built or verdicts is None:
        raise InputFileError(
            f"{path} holds no validated engines (no package/engines, or build/ without validate/validation.json)",
            hint="`kiln run` first, or pass an engine folder",
        )
    served = []
    for d in built:
        meta = read_metadata(d)
        if verdicts.get(meta.name) is True:
            served.append(ServedEngine(model_name(meta.name), d, _as_validated(meta, path)))
    if not served:
        _refuse({d.name: verdicts.get(read_metadata(d).name) for d in built})
    return served


def runnable_here(served: list[ServedEngine]) -> list[ServedEngine]:
    """The engines of ``served`` this machine can run (a CUDA engine needs a GPU, a TensorRT one its runtime); each
    left out is a warning, and none left is an error naming why: Triton would only fail to load them."""
    kept, why = [], {}
    for s in served:
        ok, reason = runnable(s.meta)
        if ok:
            kept.append(s)
        else:
            why[s.model_name] = reason
    if not kept:
        raise BackendUnavailable(
            f"no engine to serve can run on this machine: {'; '.join(f'{m}: {r}' for m, r in why.items())}",
            hint="serve it on a machine that can run it (see its kiln-engine.json), or build an engine for this "
            "machine (kiln build MODEL.onnx --backend onnxruntime)",
        )
    for model, reason in why.items():
        log.warning("not serving %s: %s (the other engines are served)", model, reason)
    return kept


def model_name(engine_name: str) -> str:
    """The name an engine is served under: its folder's name in Triton's alphabet (onnxruntime_cpu_fp32)."""
    return re.sub(r"[^A-Za-z0-9_]", "_", engine_name)


def check_ports(address: str, *ports: int) -> None:
    """Fail before starting anything if a port cannot be listened on (Triton would only log it and exit).

    Bound as the servers bind (Triton's HTTP and gRPC servers set SO_REUSEADDR): a port a killed server left in
    TIME_WAIT is free for them and is not called busy; a port something listens on is."""
    if len(set(ports)) < len(ports):
        raise PortInUse(
            f"the same port is given twice ({', '.join(map(str, ports))})",
            hint="give --http-port, --grpc-port and --metrics-port three different ports",
        )
    for port in ports:
        if not 0 < port < 65536:
            raise PortInUse(f"port {port} is not a TCP port (1-65535)", hint="choose ports between 1024 and 65535")
        _bind_probe(address, port)


def _bind_probe(address: str, port: int) -> None:
    """Bind ``address:port`` with SO_REUSEADDR and let go; an OSError becomes one message by errno."""
    try:
        infos = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise PortInUse(
            f"address '{address}' cannot be resolved ({exc.strerror})",
            hint="give --address an IP address of this machine (127.0.0.1, or 0.0.0.0 for every interface)",
        ) from None
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(sockaddr)
        except OSError as exc:
            raise _bind_error(address, port, exc) from None


def _bind_error(address: str, port: int, exc: OSError) -> PortInUse:
    if exc.errno == errno.EADDRINUSE:
        return PortInUse(
            f"port {port} on {address} is in use ({exc.strerror})",
            hint=_held_by_server(port)
            or "stop what listens there, or choose other ports with --http-port/--grpc-port/--metrics-port",
        )
    if exc.errno == errno.EADDRNOTAVAIL:
        return PortInUse(
            f"address {address} is not an address of this machine ({exc.strerror})",
            hint="give --address an IP address of this machine (127.0.0.1, or 0.0.0.0 for every interface)",
        )
    if exc.errno == errno.EACCES:
        return PortInUse(
            f"port {port} on {address} needs privileges this process lacks ({exc.strerror})",
            hint="choose ports above 1023",
        )
    return PortInUse(f"cannot listen on {address}:{port} ({exc.strerror})", hint="choose another port or address")


def _held_by_server(port: int) -> str | None:
    """The fix for a busy ``port`` that a ``tritonserver`` listens on (None for anything else, or where it cannot
    be told): one a killed ``kiln serve`` left running (from a ``kiln-serve-`` scratch folder, its parent gone) is
    named with its pid to kill; a ``kiln serve`` still running is named as such."""
    import psutil

    pid = _listener_pid(port)
    if pid is None:
        return None
    try:
        server = psutil.Process(pid)
        if server.name() != "tritonserver":
            return None
        ours = "kiln-serve-" in (server.cmdline() or [""])[0]
        parent = server.parent()
        parent_cmd = " ".join(parent.cmdline()) if parent is not None and parent.pid != 1 else ""
    except psutil.Error:  # gone meanwhile, or not ours to look at
        return None
    if ours and "kiln" in parent_cmd:
        return f"a running kiln serve (pid {parent.pid}) listens there: stop it, or choose other ports"
    if ours:
        return f"a tritonserver (pid {pid}) left by an earlier kiln serve holds it: kill {pid}"
    return f"a tritonserver (pid {pid}) holds it: stop it (kill {pid}), or choose other ports"


def _listener_pid(port: int) -> int | None:
    """The process listening on TCP ``port`` (any address), from the kernel's socket tables and the processes'
    open files (Linux; None elsewhere, or where nothing this process may look at holds it)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:  # sl local_address rem_address st ... inode
            fields = row.split()
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[-1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return None
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return None
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # gone, or another user's
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                    return pid
            except OSError:
                continue
    return None


def socket_folder(scratch: Path, names: list[str]) -> Path:
    """PyTriton's workspace, where the server's model sockets go: in ``scratch``, or where its path is too long
    for a socket (a deep TMPDIR), in a fresh folder under ``SHORT_SOCKET_ROOT``; checked either way."""
    folder = scratch / "pytriton"
    if len(os.fsencode(folder / _longest_socket(names))) <= MAX_SOCKET_PATH:
        check_socket_folder(folder, names)
        return folder
    try:
        short = Path(tempfile.mkdtemp(prefix="kiln-", dir=SHORT_SOCKET_ROOT)) / "pytriton"
    except OSError:
        short = folder  # no usable short folder: the check below says why the long one fails
    try:
        check_socket_folder(short, names)
    except KilnError:
        if short != folder:
            shutil.rmtree(short.parent, ignore_errors=True)
        raise
    return short


def _longest_socket(names: list[str]) -> str:
    return f"{max(names, key=len)}_0_99-server.sock"


def check_socket_folder(folder: Path, names: list[str]) -> None:
    """The server's model sockets (AF_UNIX, ``<model>_0_<n>-server.sock`` under ``folder``) can be bound there.

    A path over the OS limit, a folder that refuses sockets or writes: refused now, in one line, instead of a
    model that fails to load in the server's log. Bound and removed, as the server binds them; ``folder`` is made
    for the probe and removed again (PyTriton makes its workspace itself, and refuses one that exists)."""
    for name in names:
        path = folder / _longest_socket([name])
        if len(os.fsencode(path)) > MAX_SOCKET_PATH:
            raise KilnError(
                f"the server's socket path {path} is {len(os.fsencode(path))} bytes, over the OS limit of "
                f"{MAX_SOCKET_PATH}",
                hint="set TMPDIR to a shorter folder (e.g. TMPDIR=/tmp), or serve under a shorter model name",
            )
    try:
        folder.mkdir(parents=True)
    except OSError as exc:
        raise storage_error(exc, "making the server's socket folder (TMPDIR)") from None
    for name in names:
        path = folder / _longest_socket([name])
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            try:
                s.bind(str(path))
            except OSError as exc:
                folder.rmdir()
                raise KilnError(
                    f"the OS refuses the server's socket {path} ({exc.strerror})",
                    hint="set TMPDIR to a local folder you can write to (e.g. TMPDIR=/tmp)",
                ) from None
            path.unlink(missing_ok=True)
    folder.rmdir()


def free_port() -> int:
    """An ephemeral port free right now on the loopback interface."""
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` different ephemeral ports free right now on the loopback interface: all held at once while they are
    picked (ports asked for one at a time can come back the same, once each is let go)."""
    with ExitStack() as stack:
        held = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(n)]
        for s in held:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in held]


def server_env(stub_python: Path, env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a ``tritonserver`` process. Its Python backend stub loads the first ``libpython3.X``
    the loader finds; with an interpreter not installed by the system (pyenv, conda) that is the system's, two
    interpreters mix and the model fails to load ('_thread.RLock' object has no attribute '_recursion_count').
    The running interpreter's LIBDIR goes first on LD_LIBRARY_PATH. ``stub_python`` (:func:`stub_python_env`)
    goes first on PATH: the stub's embedded interpreter takes its prefix from the ``python3`` it finds there."""
    distribution = _distribution()
    env = dict(os.environ if env is None else env)
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    # PyTriton's bundled libraries (its CUDA runtime among them): tritonserver runs from a copy in a workspace,
    # where its relative RPATH no longer reaches them (libcudart-*.so not found) ...
    # ... and the libraries auditwheel bundled beside the package (nvidia_pytriton.libs: libcudart and others).
    wheel_libs = distribution.get_root_module_path().resolve().parent / "nvidia_pytriton.libs"
    bundled = [str(distribution.get_libs_path())] + ([str(wheel_libs)] if wheel_libs.is_dir() else [])
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (libdir, *bundled, env.get("LD_LIBRARY_PATH", "")) if p)
    env["PATH"] = os.pathsep.join((str(stub_python / "bin"), env.get("PATH", "")))
    return env


def stub_python_env(scratch: Path) -> Path:
    """A virtual environment (no packages of its own) whose ``.pth`` file lists this process's ``sys.path``.

    The Python backend stub embeds an interpreter that ignores PYTHONPATH, so packages this process imports
    from there (``pip install --target DIR`` + PYTHONPATH, as on the GPU host; Bazel-style layouts) were missing
    in the stub: PyTriton's proxy model failed to load with ``No module named 'zmq'``. An interpreter started
    from this environment's ``bin/python3`` reads ``pyvenv.cfg`` and the ``.pth`` and sees exactly what this
    process sees. Hand-written because neither PyTriton nor Triton has a setting for it (Triton's
    EXECUTION_ENV_PATH wants a packed environment per model)."""
    import venv

    root = scratch / "stub-python"
    if not (root / "pyvenv.cfg").is_file():
        venv.EnvBuilder(symlinks=True, with_pip=False, clear=True).create(root)
    purelib = sysconfig.get_path("purelib", vars={"base": str(root), "platbase": str(root)})
    paths = list(dict.fromkeys(str(Path(p).resolve()) for p in sys.path if p and Path(p).is_dir()))
    # addsitedir, not plain lines: the .pth files in those folders (editable installs' finders) must run too
    (Path(purelib) / "kiln-serve-paths.pth").write_text(f"import site; list(map(site.addsitedir, {paths!r}))\n")
    return root


def _pytriton() -> Any:
    """PyTriton itself, for `kiln serve --pytriton` (the Python-backend server needs only its files)."""
    _bundled()
    try:
        import pytriton.triton
    except ImportError:
        raise _not_installed() from None
    return pytriton


def _not_installed() -> BackendUnavailable:
    return BackendUnavailable("kiln serve needs PyTriton (nvidia-pytriton), which is not installed", hint=INSTALL_HINT)


def _bundled() -> None:
    """Refuse a missing PyTriton, or one whose bundled stub cannot read this numpy, without importing it."""
    if importlib.util.find_spec("pytriton") is None:
        raise _not_installed()
    try:
        pytriton_version = version("nvidia-pytriton")
    except PackageNotFoundError:  # importable without its distribution's metadata (vendored): nothing to compare
        return
    check_stub_numpy(np.__version__, pytriton_version)


@functools.cache
def _distribution() -> ModuleType:
    """PyTriton's ``pytriton.utils.distribution`` (where its bundled tritonserver, stubs and libraries lie), run from
    its own file: importing it as a submodule first runs ``pytriton/__init__``, which imports PyTriton's clients
    (aiohttp, gevent; about 0.4 s of every `kiln serve` start) that the Python-backend server never uses."""
    _bundled()
    spec = importlib.util.find_spec("pytriton")
    folder = Path(next(iter(spec.submodule_search_locations or [])))  # type: ignore[union-attr]
    found = importlib.util.spec_from_file_location("kiln_pytriton_distribution", folder / "utils" / "distribution.py")
    module = importlib.util.module_from_spec(found)  # type: ignore[arg-type]
    found.loader.exec_module(module)  # type: ignore[union-attr]
    return module


# The last PyTriton whose bundled tritonserver (2.51) has a Python backend stub built with pybind11 < 2.12
LAST_PYTRITON_WITHOUT_NUMPY2 = (0, 7, 0)


def check_stub_numpy(numpy_version: str, pytriton_version: str) -> None:
    """Refuse numpy 2 with a stub that cannot read it. The Python backend stub bundled up to PyTriton 0.7.0 was
    built with pybind11 2.10, which predates numpy 2: with numpy 2 it sends every output empty (fixed in Triton's
    python_backend#384, Triton 24.11). Serving would run and answer nothing usable, so it stops here."""

    def parts(v: str) -> tuple[int, ...]:
        return tuple(int(x) for x in re.findall(r"\d+", v)[:3])

    if parts(numpy_version)[:1] >= (2,) and parts(pytriton_version) <= LAST_PYTRITON_WITHOUT_NUMPY2:
        raise BackendUnavailable(
            f"numpy {numpy_version} is installed, and the Triton Python backend bundled with PyTriton "
            f"{pytriton_version} sends every answer empty with numpy 2 (its stub predates numpy 2)",
            hint='pip install "numpy<2" (kiln[serve] pins it), or a PyTriton that bundles Triton 24.11 or newer',
        )


class RequestRefused(Exception):
    """`kiln serve --pytriton`: the batch's requests are not what the engine takes (outside its validated sizes,
    an index past its table, the engine's own :class:`InputError`, ONNX Runtime's INVALID_ARGUMENT). Answered as
    its message alone, HTTP 400 (:data:`PROXY_MODEL_PY`), and logged as one line (:class:`_RefusalInOneLine`).
    ``requests``: how many requests the refused batch held."""

    requests = 1


class BatchFailed(Exception):
    """`kiln serve --pytriton`: the engine failed on a batch it takes. Answered as its message alone, HTTP 500."""


def engine_failure(exc: Exception) -> RequestRefused | BatchFailed:
    """What a batch the engine raised ``exc`` on is answered with: :class:`RequestRefused` (HTTP 400) where its
    requests are at fault (:func:`~kiln.serve.batching.request_fault`: the engine's own input check, or ONNX
    Runtime's INVALID_ARGUMENT), :class:`BatchFailed` (HTTP 500) for any other failure of the engine."""
    if isinstance(exc, InputError):
        return RequestRefused(first_line(exc, 1000))
    if request_fault(exc):
        return RequestRefused(f"the engine refused this request: {first_line(exc, 1000)}")
    return BatchFailed(f"the engine failed on this batch: {type(exc).__name__}: {first_line(exc)}")


def _infer_func(
    runner: Any,
    outputs: dict[str, np.dtype],
    buckets: list[int] | None,
    meta: EngineMetadata | None = None,
    batched: bool = True,
) -> Callable[..., dict[str, np.ndarray]]:
    """``buckets``: pad every batch to the next of these sizes (engines that build a session and capture a CUDA
    graph per input shape: without it each new batch size the dynamic batcher forms costs a session build).
    ``meta``: inputs outside the sizes the engine was validated for are answered with an error naming them.
    ``batched``: the requests are joined into one batch (PyTriton's ``@batch``, which holds every output to the
    rows of the requests' first inputs); else each runs whole, its outputs of any rows (an engine served with
    ``max_batch_size: 0``: a two-tower model's 5 texts and 2 images).
    Errors are raised as :class:`RequestRefused` or :class:`BatchFailed` with a one-line message, chained to the
    engine's own exception: PyTriton logs the whole chain of a failure here (a refusal in one line), and the client
    gets the last line."""
    from pytriton.decorators import batch

    def infer(**inputs: np.ndarray) -> dict[str, np.ndarray]:
        outside = meta.refusal(inputs) if meta is not None else None
        if outside is not None:
            raise RequestRefused(outside)
        try:
            result = padded_infer(runner, inputs, buckets)
        except Exception as exc:
            raise engine_failure(exc) from exc
        return {name: np.asarray(result[name], dtype=dtype) for name, dtype in outputs.items()}

    joined = batch(infer)  # PyTriton's: the dynamic batcher's requests arrive as one batch of numpy arrays

    def infer_requests(requests: list[Any]) -> Any:
        try:
            return joined(requests) if batched else [infer(**request) for request in requests]
        except RequestRefused as exc:
            exc.requests = len(requests)
            raise

    return infer_requests


class _RefusalInOneLine(logging.Filter):
    """PyTriton logs every error of an infer function as a warning with its traceback. A refused request
    (:class:`RequestRefused`) is the client's error, answered 400: logged as one line, its reason; a batch of several
    requests, which :data:`PROXY_MODEL_PY` runs again a request at a time (the refused one then logs its line), only
    in the debug log. PyTriton logs inside its ``except`` block, so the exception handled there is the refusal."""

    def filter(self, record: logging.LogRecord) -> bool:
        refused = sys.exc_info()[1]
        if isinstance(refused, RequestRefused) and record.levelno == logging.WARNING:
            record.msg, record.args, record.exc_info = "refused a request: %s", (str(refused),), None
            if refused.requests > 1:
                record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return True


class _ExitOfAStop(logging.Filter):
    """PyTriton warns that its server "exited with failure" when the server ends on a signal: after a stop (Ctrl-C
    reaches the server too; a start stopped before it was ready kills it), that is the stop, said in the debug log."""

    def __init__(self, stop: _StopRequest) -> None:
        super().__init__()
        self.stop = stop

    def filter(self, record: logging.LogRecord) -> bool:
        if self.stop.requested and "exited with failure" in record.getMessage():
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return True


def _filter_pytriton_log(stop: _StopRequest) -> Callable[[], None]:
    """PyTriton's log lines as `kiln serve --pytriton` says them (:class:`_RefusalInOneLine`, :class:`_ExitOfAStop`)
    until the function returned is called."""
    filters = [
        (logging.getLogger("pytriton.proxy.inference"), _RefusalInOneLine()),
        (logging.getLogger("pytriton.server.triton_server"), _ExitOfAStop(stop)),
    ]
    for logger, added in filters:
        logger.addFilter(added)

    def remove() -> None:
        for logger, added in filters:
            logger.removeFilter(added)

    return remove


def _marked(error: type[Exception]) -> str:
    """How a traceback's last line starts for an exception of this class (``module.Class: ``)."""
    return f"{error.__module__}.{error.__qualname__}: "


# The model file Triton loads for each PyTriton model (its model.py, renamed pytriton_model.py beside it): PyTriton's
# proxy, whose error answer is Python's traceback twice over (this process's, then the stub's) with HTTP 500 for any
# error, to every request of the batch. This model runs a failed batch's requests again one at a time, so that only
# the request at fault gets an error: the last line of that text, without the class of a Kiln error, and with
# INVALID_ARG (HTTP 400) for a RequestRefused.
PROXY_MODEL_PY = f'''"""PyTriton's proxy model (pytriton_model.py), as `kiln serve --pytriton` loads it: an error
is answered as one line."""
import triton_python_backend_utils as pb_utils

from .pytriton_model import TritonPythonModel as PyTritonModel

REFUSED, FAILED = {_marked(RequestRefused)!r}, {_marked(BatchFailed)!r}


def _error(text):
    line = next((part.strip() for part in reversed(text.splitlines()) if part.strip()), text.strip())
    invalid = line.startswith(REFUSED)
    for mark in (REFUSED, FAILED):
        if line.startswith(mark):
            line = line[len(mark):]
    code = getattr(pb_utils.TritonError, "INVALID_ARG", None) if invalid else None
    return pb_utils.TritonError(line) if code is None else pb_utils.TritonError(line, code)


class TritonPythonModel(PyTritonModel):
    def execute(self, requests):
        try:
            return super().execute(requests)
        except pb_utils.TritonModelException as exc:
            if len(requests) == 1:
                return [pb_utils.InferenceResponse(error=_error(str(exc)))]
        return [self._alone(request) for request in requests]  # the failing one gets the error, the others answers

    def _alone(self, request):
        try:
            return super().execute([request])[0]
        except pb_utils.TritonModelException as exc:
            return pb_utils.InferenceResponse(error=_error(str(exc)))
'''


def _one_line_errors() -> None:
    """Each PyTriton model is loaded with :data:`PROXY_MODEL_PY` in front of PyTriton's proxy model: the files
    PyTriton sends Triton for a model are the one place to say so. A PyTriton whose files have no ``model.py``
    keeps its own."""
    from pytriton.models.model import Model

    original = getattr(Model.get_proxy_model_files, "kiln_original", Model.get_proxy_model_files)

    def files(self: Any) -> dict[str, bytes]:
        out = dict(original(self))
        model = f"file:{self.model_version}/model.py"
        if model in out:
            out[f"file:{self.model_version}/pytriton_model.py"] = out.pop(model)
            out[model] = PROXY_MODEL_PY.encode()
        return out

    files.kiln_original = original  # type: ignore[attr-defined]
    Model.get_proxy_model_files = files


def say_capped(served: list[ServedEngine], asked: int) -> None:
    """Warn where ``--max-batch`` asks for more rows than an engine was validated for: Triton forms at most the
    largest validated batch (:func:`served_max_batch`), and a given option is not overridden without a word."""
    for s in served:
        mbs = served_max_batch(s.meta, asked)
        if 0 < mbs < asked:
            log.warning(
                "%s: --max-batch %d capped to %d, the largest batch it was validated at; to serve larger batches, "
                "add the size to signature.batch_sizes and validate again",
                s.model_name,
                asked,
                mbs,
            )


def say_unbatched(served: list[ServedEngine]) -> None:
    """Warn once per engine that Triton serves unbatched (``max_batch_size: 0``, :func:`served_max_batch`), naming
    why: each request then runs alone, whatever ``--max-batch`` asks, and nothing else tells a client so."""
    for s in served:
        why = unbatchable_reason(s.meta)
        if why is not None:
            log.warning("%s: served unbatched (each request runs alone, no dynamic batching): %s", s.model_name, why)


def _scalars_as_one(infer_func: Callable[..., Any], meta: EngineMetadata) -> Callable[..., Any]:
    """``infer_func`` for an engine whose 0-d tensors (:func:`scalar_tensors`) are bound as shape ``(1,)``, as the
    package's Triton configs declare them (Triton takes no empty dims): each request's such input handed to the
    engine as its ``[]``, each such output answered as ``[1]``, as Kiln's Python-backend model does. Such an engine
    is never batched (:func:`served_max_batch`), so each request's arrays are its own."""
    names = set(scalar_tensors(meta))
    if not names:
        return infer_func

    def infer_requests(requests: list[Any]) -> list[dict[str, np.ndarray]]:
        for request in requests:
            for name in names.intersection(request.keys()):
                if request[name].size == 1:
                    request[name] = request[name].reshape(())
        answers = infer_func(requests)
        return [{n: a.reshape(1) if n in names else a for n, a in answer.items()} for answer in answers]

    return infer_requests


def _bind(triton: Any, served: ServedEngine, runner: Any, max_batch: int, queue_delay_us: int) -> None:
    from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor

    mbs = served_max_batch(served.meta, max_batch)
    batched = mbs > 0

    def tensors(specs: list[dict[str, Any]]) -> list[Any]:
        """PyTriton's tensors, a 0-d one as shape ``(1,)`` (:func:`_scalars_as_one`)."""
        return [
            Tensor(
                name=s.name,
                dtype=np.dtype(s.dtype),
                shape=tuple(d if isinstance(d, int) and d > 0 else -1 for d in (s.shape[1:] if batched else s.shape))
                or (1,),
            )
            for s in specs
        ]

    outputs = {s.name: np.dtype(s.dtype) for s in served.meta.outputs}
    buckets = buckets_for(runner, mbs)
    if buckets and warm_buckets(runner, served.meta, buckets):
        log.info("%s: batches padded to %s rows, each size warmed", served.model_name, buckets)
    config = ModelConfig(
        max_batch_size=mbs,
        batching=batched,
        batcher=DynamicBatcher(max_queue_delay_microseconds=queue_delay_us, preferred_batch_size=buckets or []),
    )
    triton.bind(
        model_name=served.model_name,
        infer_func=_scalars_as_one(_infer_func(runner, outputs, buckets, served.meta, batched), served.meta),
        inputs=tensors(served.meta.inputs),
        outputs=tensors(served.meta.outputs),
        config=config,
        strict=True,
    )


def _bind_or_explain(triton: Any, served: ServedEngine, runner: Any, max_batch: int, queue_delay_us: int) -> None:
    """Bind one model; Triton refusing to load it is one error/fix pair, not PyTriton's and tritonclient's
    tracebacks (the server's own log says why in full)."""
    from pytriton.exceptions import PyTritonError
    from tritonclient.utils import InferenceServerException

    try:
        _bind(triton, served, runner, max_batch, queue_delay_us)
    except (PyTritonError, InferenceServerException) as exc:
        message = getattr(exc, "message", None)
        reason = first_line((message() if callable(message) else message) or str(exc))
        missing = "No module named" in reason  # from the stub, which imports what this process imports
        raise KilnError(
            f"Triton could not load model {served.model_name}: {reason}",
            hint="install the module into this environment"
            if missing
            else "rerun with --verbose to see the server's log; or serve without --pytriton",
        ) from None


class _Stopped(Exception):
    """A stop signal came before the server was ready: :func:`serve` ends its start and returns, nothing served."""


class _StopRequest:
    """SIGINT/SIGTERM handler: the first signal asks the server to stop, and :meth:`check` raises :class:`_Stopped`
    at the next step of a start that is still under way (each wait for the server looks at it every 0.1-0.5 s); once
    ready, the serving loop looks every 0.5 s. A second signal before the stop began raises KeyboardInterrupt (a
    start step that hangs can still be interrupted); once it began (``stopping``), later signals change nothing:
    :class:`_Reaper` bounds the stop, which an exception raised in the middle of it would leave half done.

    Why not raise from the first signal (Python's SIGINT default): an exception raised by a signal lands in
    whatever the main thread runs at that moment, and inside a finalizer (``__del__`` of a multiprocessing
    connection, seen in CI) Python prints "Exception ignored" and drops it: the server then never stopped."""

    def __init__(self) -> None:
        self.requested = False  # plain flags: a handler must not take a lock its own thread may hold
        self.served = False  # ready, ``on_ready`` called: a stop from then on is the server's normal end
        self.stopping = False
        # called by a stop while the server starts: ends a start step that would run on (a model still loading)
        self.abort_start: Callable[[], None] | None = None
        _stopped_by.clear()

    def __call__(self, signum: int, frame: Any) -> None:
        if not self.requested:
            self.requested = True
            _stopped_by[:] = [signum]
            if not self.served and self.abort_start is not None:
                self.abort_start()
        elif not self.stopping:
            raise KeyboardInterrupt

    def check(self) -> None:
        """Raise :class:`_Stopped` if a stop came while the server starts (between its steps, in its waits)."""
        if self.requested and not self.served:
            self.stopping = True
            raise _Stopped


_stopped_by: list[int] = []  # the signal that stopped the last server of this process


def stopped_by() -> int | None:
    """The signal (SIGINT or SIGTERM) that stopped the last :func:`serve` of this process, if one did."""
    return _stopped_by[0] if _stopped_by else None


@contextmanager
def _signals_to(stop: _StopRequest) -> Iterator[None]:
    """SIGINT and SIGTERM go to ``stop`` for the block; the previous handlers come back after it. A Ctrl-C that the
    command's own handler (:mod:`kiln.core.interrupt`) took before, but that a finalizer swallowed, is a stop too."""
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            interrupt.check()
        except KeyboardInterrupt:
            stop(interrupt.last_signal() or signal.SIGINT, None)
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)  # None: one set outside Python


def _marking_workdir(fn: Callable[..., None]) -> Callable[..., None]:
    """``fn(path, ...)`` with ``path`` marked as served meanwhile when it is a workdir (:func:`served_workdir`)."""

    @functools.wraps(fn)
    def marked(path: str | Path, *args: Any, **kwargs: Any) -> None:
        with served_workdir(Path(path)) if _is_workdir(Path(path)) else nullcontext():
            return fn(path, *args, **kwargs)

    return marked


def _is_workdir(path: Path) -> bool:
    """Whether ``path`` is a run's workdir (not an engine folder): its lock, package or build is there."""
    if (path / SIDECAR).is_file() or not path.is_dir():
        return False
    return any((path / name).exists() for name in (LOCK_NAME, "package", "build"))


@_marking_workdir
def serve(
    path: str | Path,
    http_port: int = 8000,
    grpc_port: int = 8001,
    metrics_port: int = 8002,
    max_batch: int | None = None,
    max_queue_delay_us: int = 100,
    address: str = "127.0.0.1",
    on_ready: Callable[[list[ServedEngine]], None] | None = None,
    verbose: bool = False,
    gpus: list[int] | None = None,
    instances_per_gpu: int | None = None,
    exit_on_overrun: bool = False,
    pytriton: bool = False,
    http_threads: int | None = None,
) -> None:
    """Serve until SIGINT or SIGTERM. ``on_ready`` is called once every model answers. The server's own log
    is printed with ``verbose`` only; otherwise its error is named when the server fails.
    ``gpus``: serve CUDA engines on these GPUs (default: GPU 0 when every engine runs on CUDA), ``instances_per_gpu``
    stubs on each (default :func:`default_instances`); ``max_batch``: the largest batch Triton forms (default
    :func:`default_max_batch`). ``pytriton``: run the engines in this process through
    PyTriton instead. ``http_threads``: Triton's HTTP threads (its ``--http-thread-count``; default Triton's own).
    ``exit_on_overrun``: a stop that overruns ``STOP_DEADLINE_S`` ends this process too (the
    CLI's choice; a caller in-process keeps its process).
    A signal at any moment of the start ends it: the server (if it started) is stopped, ``on_ready`` is never
    called, and this returns; :func:`stopped_by` says which signal it was. A start that fails after a stop signal
    (Ctrl-C reaches the whole process group, ``tritonserver`` included) is that stop, not an error.
    A workdir is marked as served meanwhile (:func:`served_workdir`): a run holding it is refused, and a run started
    while it is served is refused."""
    stop = _StopRequest()
    with _signals_to(stop):
        try:
            served = runnable_here(find_engines(path))
            if max_batch is not None:
                say_capped(served, max_batch)
            if max_batch != 0:
                say_unbatched(served)
            stop.check()
            if not pytriton:
                if gpus is None and all(s.meta.device == "cuda" for s in served):
                    gpus = [0]
                instances = instances_per_gpu or default_instances(gpus)
                max_batch = default_max_batch(gpus) if max_batch is None else max_batch
                ports = (http_port, grpc_port, metrics_port)
                args = (max_batch, max_queue_delay_us, address, on_ready, exit_on_overrun, verbose, http_threads)
                serve_python_backend(served, gpus, instances, ports, *args, stop=stop)
            elif gpus is not None:
                raise ConfigError(
                    "--gpus serves through Triton's Python backend, not PyTriton", hint="drop --pytriton, or --gpus"
                )
            else:
                ports = (http_port, grpc_port, metrics_port)
                max_batch = default_max_batch(None) if max_batch is None else max_batch
                args = (max_batch, max_queue_delay_us, address, on_ready, exit_on_overrun, verbose, http_threads)
                _serve_pytriton(served, ports, *args, stop=stop)
        except _Stopped:
            log.info("stopped before the server was ready: nothing was served")
        except KeyboardInterrupt:  # a second signal, in a start step that had not ended
            log.info("stopping")
        except Exception:
            if not stop.requested or stop.served:
                raise
            log.debug("the start failed after a stop signal: a stop, not an error", exc_info=True)


def _serve_pytriton(
    served: list[ServedEngine],
    ports: tuple[int, int, int],
    max_batch: int,
    queue_delay_us: int,
    address: str,
    on_ready: Callable[[list[ServedEngine]], None] | None,
    exit_on_overrun: bool,
    verbose: bool,
    http_threads: int | None,
    *,
    stop: _StopRequest,
) -> None:
    """Every engine in this process, bound to PyTriton's server (``kiln serve --pytriton``)."""
    http_port, grpc_port, metrics_port = ports
    pytriton = _pytriton()
    _server_log_on_stdout(verbose)
    check_ports(address, *ports)
    stop.check()
    scratch = _scratch()
    reaper = _Reaper(stop, STOP_DEADLINE_S, exit_on_overrun, scratch)
    runners: list[Any] = []
    triton: Any = None
    workspace: Path | None = None
    unfilter = _filter_pytriton_log(stop)
    unpatch: Callable[[], None] | None = None
    try:
        workspace = socket_folder(scratch, [s.model_name for s in served])
        stub_python = stub_python_env(scratch)
        os.environ.update(server_env(stub_python))  # PyTriton starts tritonserver with a copy of os.environ
        _use_stub_python(stub_python)
        for s in served:  # before the server starts: an engine this machine cannot run fails fast
            stop.check()
            runners.append(load_engine(s.engine_dir, serving=True).activate())
        stop.check()
        triton = pytriton.triton.Triton(
            config=_triton_config(pytriton, address, http_port, grpc_port, metrics_port, http_threads),
            security_config=_security(pytriton),
            workspace=workspace,
        )
        unpatch = _fail_fast_if_server_dies(pytriton, triton, stop.check)
        _clean_models_at_once()
        _one_line_errors()
        stop.abort_start = functools.partial(_kill_starting, triton)
        with triton:
            for s, runner in zip(served, runners):
                stop.check()
                _bind_or_explain(triton, s, runner, max_batch, queue_delay_us)
            stop.check()
            triton.run()  # returns once the server and every model are ready
            url = f"http://{address}:{http_port}"
            wait_ready(url, [], STARTUP_TIMEOUT_S, listening=(grpc_port, metrics_port), check=stop.check)
            _declare_ready(stop, on_ready, served)
            _wait(triton, stop)
            stop.stopping = True
            log.info("stopping: draining requests in flight (up to %d s)", EXIT_TIMEOUT_S)
            names = [s.model_name for s in served]
            drain_models(f"{address}:{http_port}", names, EXIT_TIMEOUT_S, _pytriton_headers(triton))
    except KilnError as exc:  # the server's own last error, said now: its log goes with the scratch folder
        said = None if verbose or triton is None else _server_said(triton)
        if said:
            exc.hint = f"{exc.hint}; the server said: {said}" if exc.hint else f"the server said: {said}"
        raise
    finally:
        stop.stopping = True
        if triton is not None and stop.requested and not stop.served:
            _kill_starting(triton)  # a signal before its server was started, or before abort_start was set
        if triton is not None:
            triton.stop()  # a no-op after its `with` block; after a failed start, before its workspace goes
            _until_pytriton_cleaned(triton)
        for r in runners:
            r.deactivate()
        reaper.close()
        unfilter()
        if unpatch is not None:
            unpatch()
        shutil.rmtree(scratch, ignore_errors=True)
        if workspace is not None and not workspace.is_relative_to(scratch):
            shutil.rmtree(workspace.parent, ignore_errors=True)


def _named(process: Any) -> str:
    """``name (pid)`` of a psutil process, or ``pid (gone)`` for one that exited since it was listed: a process that
    ends between two looks is what a reaper meets, and its name must not turn a stop into a traceback."""
    import psutil

    try:
        return f"{process.name()} ({process.pid})"
    except psutil.Error:
        return f"{process.pid} (gone)"


def _kill_starting(triton: Any) -> None:
    """A stop signal while PyTriton's server starts: nothing was served, so nothing drains. The server is killed, so
    that a step waiting on it (a model loading, which takes seconds) ends now, and PyTriton's own stop does not wait
    ``EXIT_TIMEOUT_S`` for that model; :class:`_Reaper` ends the stubs it leaves. Called from the signal handler:
    a plain ``kill``, no lock taken."""
    running = getattr(getattr(triton, "_triton_server", None), "_tritonserver_running_cmd", None)
    pid = getattr(running, "pid", None)
    if isinstance(pid, int):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:  # gone already
            pass


def _pytriton_headers(triton: Any) -> dict[str, str] | None:
    """The access-token header PyTriton's own client sends to its server's restricted endpoints (the repository
    API among them); None where this PyTriton keeps none."""
    headers = getattr(getattr(triton, "_model_manager", None), "_headers", None)
    return dict(headers) if isinstance(headers, dict) else None


def _until_pytriton_cleaned(triton: Any, timeout_s: float = 2.0) -> None:
    """PyTriton stops itself, from another thread, when its server exits (a server killed, or ended by Ctrl-C): that
    stop may still be removing its workspace when ours returns at once (stopped already). Waits, up to
    ``timeout_s``, for the workspace to be gone, so that the scratch folder is not removed under PyTriton's own
    cleaning (which then warns it could not clean it)."""
    workspace = getattr(getattr(triton, "_workspace", None), "path", None)
    deadline = time.monotonic() + timeout_s
    while workspace is not None and Path(workspace).exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def _declare_ready(
    stop: _StopRequest, on_ready: Callable[[list[ServedEngine]], None] | None, served: list[ServedEngine]
) -> None:
    """The server answers (:func:`wait_ready` found it ready): it is served from here on, and ``on_ready`` says so,
    also where a stop came since that poll (a client may have been answered meanwhile). A stop from here on is the
    server's normal end: requests in flight drain."""
    stop.abort_start, stop.served = None, True
    if on_ready is not None:
        on_ready(served)


def _scratch() -> Path:
    """A fresh folder under TMPDIR for the stub's environment, PyTriton's workspace and its sockets."""
    try:
        return Path(tempfile.mkdtemp(prefix="kiln-serve-"))
    except OSError as exc:
        raise storage_error(exc, "making the server's scratch folder (TMPDIR)") from None


def _triton_config(
    pytriton: Any, address: str, http_port: int, grpc_port: int, metrics_port: int, http_threads: int | None = None
) -> Any:
    return pytriton.triton.TritonConfig(
        http_thread_count=http_threads,
        http_address=address,
        http_port=http_port,
        grpc_address=address,
        grpc_port=grpc_port,
        metrics_port=metrics_port,
        exit_timeout_secs=EXIT_TIMEOUT_S,
        log_verbose=0,
    )


def _security(pytriton: Any) -> Any:
    """Statistics stay readable without PyTriton's token (they show batching at work; `kiln loadtest` reads them);
    model loading, shared memory, tracing and logging stay restricted."""
    return pytriton.triton.TritonSecurityConfig(
        restricted_endpoints=["shared-memory", "model-repository", "trace", "logging"]
    )


def _fail_fast_if_server_dies(
    pytriton: Any, triton: Any, check: Callable[[], None] | None = None
) -> Callable[[], None]:
    """PyTriton polls a starting server for readiness for 120 s even after its process died (then a traceback),
    before it starts and before it loads each model: its module-level waits (the server's and its client's) are the
    one place to make the poll also watch the process, and ``check`` (a stop). Returns the function that puts
    PyTriton's own waits back."""
    client, utils = (importlib.import_module(f"pytriton.client.{name}") for name in ("client", "utils"))
    # the server's start, a model's load (ModelClient.wait_for_server) and its readiness (wait_for_model_ready)
    modules = (pytriton.triton, client, utils)
    originals = [m.wait_for_server_ready for m in modules]
    wait = _ready_or_dead(lambda: getattr(triton, "_triton_server", None), check)
    for module in modules:
        module.wait_for_server_ready = wait

    def restore() -> None:
        for module, original in zip(modules, originals):
            module.wait_for_server_ready = original

    return restore


def _ready_or_dead(server: Callable[[], Any], check: Callable[[], None] | None = None) -> Callable[..., None]:
    """A readiness wait (PyTriton's signature) that ends with :class:`ServerDied` as soon as ``server()`` is a
    process that is no longer alive, naming the server's last error line. ``check`` is called before each poll:
    it ends the wait by raising (a stop asked meanwhile)."""

    def wait(client: Any, timeout_s: float | None = None, headers: dict | None = None) -> None:
        deadline = time.monotonic() + (timeout_s or STARTUP_TIMEOUT_S)
        while time.monotonic() < deadline:
            if check is not None:
                check()
            proc = server()
            if proc is not None and not proc.is_alive():
                reason = _last_error_line(proc.logs() if hasattr(proc, "logs") else "")
                raise ServerDied(
                    f"the Triton server exited while starting{f': {reason}' if reason else ''}",
                    hint="rerun with --verbose to see its log",
                )
            try:
                if client.is_server_ready(headers=headers) and client.is_server_live(headers=headers):
                    return
            except Exception:  # connection refused while it starts: keep polling
                pass
            time.sleep(0.2)
        raise ServerDied(
            f"the Triton server was not ready within {timeout_s or STARTUP_TIMEOUT_S:.0f} s",
            hint="rerun with --verbose to see its log; a machine this busy may need fewer engines at once",
        )

    return wait


def _last_error_line(text: str) -> str:
    """Triton's last error line (``E0102 12:00:00.000 1 file.cc:12] message``), its message part."""
    errors = [line for line in text.splitlines() if re.match(r"E\d{4} ", line)]
    return first_line(errors[-1].split("] ", 1)[-1]) if errors else ""


def _clean_models_at_once() -> None:
    """PyTriton stops its models' proxies one after another, each waiting up to 1 s for its polling loop to see
    the stop flag (0.8 s per model measured): with the server already stopped (nothing to unload), they are
    stopped together, so the stop does not grow with the number of engines. Its manager's method is the one
    place to say so."""
    from concurrent.futures import ThreadPoolExecutor

    from pytriton.models.manager import ModelManager

    original = getattr(ModelManager.clean, "kiln_original", ModelManager.clean)

    def clean(self: Any) -> None:
        if _answers(self._triton_url):  # a live server unloads each model first: PyTriton's own way
            return original(self)
        models = list(self._models.values())
        with ThreadPoolExecutor(max(1, len(models))) as pool:
            list(pool.map(lambda m: m.clean(), models))
        self._models.clear()

    clean.kiln_original = original  # type: ignore[attr-defined]
    ModelManager.clean = clean


def _answers(url: str) -> bool:
    """Whether a Triton server answers its liveness probe at ``url`` (within a second)."""
    try:
        return triton_http(re.sub(r"^\w+://", "", url), "/v2/health/live", timeout_s=1.0)[0] == 200
    except OSError:  # refused, reset, timed out: not answering
        return False


_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # a local server: never through a proxy


def triton_http(
    address: str, path: str, method: str = "GET", timeout_s: float = 5.0, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    """One call of Triton's HTTP/REST protocol (KServe v2 and its repository extension) to ``host:port``:
    ``(status, JSON body or None)``; OSError when nothing answers, or nothing that speaks HTTP. Plain urllib for
    the few calls the server itself makes (readiness, a model's config, a reload): importing tritonclient's HTTP
    client (aiohttp, gevent: 0.27 s in ``python -X importtime`` on the 2-core machine) would be about a third of a
    ready server's start on the demo."""
    data = b"" if method == "POST" else None
    request = urllib.request.Request(f"http://{address}{path}", data=data, method=method, headers=headers or {})
    try:
        with _NO_PROXY.open(request, timeout=timeout_s) as answer:
            status, body = answer.status, answer.read()
    except urllib.error.HTTPError as exc:
        status, body = exc.code, exc.read()
    except http.client.HTTPException as exc:  # something not speaking HTTP on the port, or a reply cut short
        raise OSError(f"{address} answered no HTTP: {type(exc).__name__}: {exc}") from exc
    try:
        return status, json.loads(body) if body else None
    except ValueError:
        return status, None


LOADED = ("LOADING", "READY", "UNLOADING")  # the repository index's states of a model that may still hold requests


def drain_models(http_address: str, models: list[str], timeout_s: float, headers: dict[str, str] | None = None) -> bool:
    """Stop new work and let the requests in flight finish, before the server is stopped. Each model is unloaded
    through Triton's repository API (explicit model control): from then on Triton answers new requests for it with
    404 and its readiness with not-ready, while the requests it already holds (queued or executing) complete and
    its stubs end. Triton's own SIGTERM stop does neither: it keeps taking requests until ``--exit-timeout-secs``,
    then exits with those in flight cut and a busy stub left running. Returns True once no model is loaded or
    unloading, False at ``timeout_s`` (the stop goes on: the server's SIGTERM and :class:`_Reaper` bound the rest).
    ``headers``: PyTriton's access token, which its restricted repository API asks for."""
    deadline = time.monotonic() + timeout_s
    try:
        for model in models:
            path = f"/v2/repository/models/{urllib.parse.quote(model)}/unload"
            triton_http(http_address, path, "POST", timeout_s=timeout_s, headers=headers)
        while time.monotonic() < deadline:
            status, index = triton_http(http_address, "/v2/repository/index", "POST", timeout_s, headers)
            if status != 200 or not isinstance(index, list):
                return False
            if not any(m.get("name") in models and m.get("state") in LOADED for m in index):
                return True
            time.sleep(0.05)
    except OSError:  # the server no longer answers: nothing is left to drain through it
        return False
    log.warning("requests still in flight after %.0f s of draining: the server stops anyway", timeout_s)
    return False


class _Reaper:
    """Bounds a stop, and leaves nothing of the server behind.

    It keeps a list of the server's processes (refreshed every 0.5 s, so a stub Triton orphans is still on it): the
    descendants of this process started after the reaper, so a caller's own children (another server) are left be.
    Once a stop is asked, what still runs ``deadline_s`` later is killed, logged as an error (never silent); with
    ``exit_process`` this process ends a second later if PyTriton's own threads still hold it. :meth:`close`, once
    the server's stop returned, kills what of the list outlived it: on a loaded machine Triton can reach its drain
    timeout while still taking requests, and a Python stub (with its children) can outlive ``kiln serve``."""

    def __init__(self, stop: _StopRequest, deadline_s: float, exit_process: bool, scratch: Path | None = None) -> None:
        self.stop, self.deadline_s, self.exit_process, self.scratch = stop, deadline_s, exit_process, scratch
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._tree: dict[int, Any] = {}
        self._shm: set[str] = set()  # the Python backend's shared-memory regions the server maps
        self.shm_dir = SHM_DIR
        self._stop_at: float | None = None
        self._others = self._children()  # this process's children from before the server: not the server's
        threading.Thread(target=self._run, daemon=True, name="kiln-serve-reaper").start()

    @staticmethod
    def _children() -> set[Any]:
        import psutil

        return set(psutil.Process().children(recursive=True))  # psutil.Process: equal by pid and start time

    def _look(self) -> None:
        found = {p.pid: p for p in self._children() - self._others}
        with self._lock:
            # the tracker is told by the pid multiprocessing records once it started, which a look may precede (the
            # child runs before its pid is stored): dropped at every look, not only when first seen
            self._tree = {pid: p for pid, p in (self._tree | found).items() if not _own_resource_tracker(p)}

    def _server_tree(self) -> list[Any]:
        """The server's processes seen so far, less this process's resource tracker (a look may have preceded its
        pid being recorded)."""
        with self._lock:
            return [p for p in self._tree.values() if not _own_resource_tracker(p)]

    def _regions(self, pids: list[int] | None = None) -> None:
        """The /dev/shm files the server's processes (or ``pids``) map (the Python backend's region): a server killed
        at its deadline leaves its region behind, 1 MiB or more of the machine's memory until removed."""
        if pids is None:
            with self._lock:
                pids = list(self._tree)
        for pid in pids:
            try:
                lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
            except OSError:  # gone, or no /proc (not Linux)
                continue
            self._shm |= {ln.split(maxsplit=5)[-1] for ln in lines if SHM_REGION in ln}
        self._shm |= pytriton_regions(self.shm_dir)

    def _run(self) -> None:
        while not self.stop.requested:
            self._look()
            if self._done.wait(0.5):
                return
        self._look()
        self._regions()
        self._stop_at = time.monotonic()
        if self._done.wait(self.deadline_s):
            return
        self._kill(f"the server did not stop within {self.deadline_s:.0f} s of the signal")
        if self.exit_process and not self._done.wait(1.0):
            os._exit(1)  # PyTriton's threads still stopping: the process ends anyway, with a failing status

    def _kill(self, why: str, level: int = logging.ERROR) -> None:
        import psutil

        left = [p for p in self._server_tree() if p.is_running()]
        left += [p for p in self._from_scratch() if p not in left]
        self._regions([p.pid for p in left])  # what they map goes with them (close() removes it)
        if left:
            log.log(level, "%s: killing %s", why, ", ".join(_named(p) for p in left))
        for p in left:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass

    def _from_scratch(self) -> list[Any]:
        """Processes running a program of the server's scratch folder (its copy of tritonserver and the Python
        stub): a stub whose server died between two looks (Ctrl-C while Triton starts reaches the whole process
        group) is no descendant of this process any more, and runs on with the init process as its parent."""
        import psutil

        if self.scratch is None:
            return []
        root = str(self.scratch.resolve()) + os.sep
        found = []
        for p in psutil.process_iter(["cmdline"]):
            cmd = p.info.get("cmdline") or []
            if cmd and cmd[0].startswith(root):
                found.append(p)
        return found

    def close(self) -> None:
        """The server's stop returned: its processes get until the deadline (2 s without a stop signal: an error
        path) to end, then what is left is killed. A start that a signal ended before the server was ready served
        nothing and drains nothing: what it started (a stub still loading, whose server is gone) is killed at once,
        said in the debug log only."""
        import psutil

        self._done.set()
        if self.stop.requested and not self.stop.served:
            self._look()  # a stub started since the last look
            self._kill("stopped before the server was ready", logging.DEBUG)
        else:
            end = (self._stop_at or time.monotonic()) + (self.deadline_s if self._stop_at else 2.0)
            psutil.wait_procs(self._server_tree(), timeout=max(0.1, end - time.monotonic()))
            # a stub still busy with the last requests when the deadline came: killed, as the stop promised
            self._kill("processes of the server outlived its stop", logging.WARNING)
        # unlinked while a killed process may still map it: the name goes now, the memory with the last mapping
        for path in sorted(self._shm):  # what the server would have removed had it ended on its own
            if Path(path).exists():
                Path(path).unlink(missing_ok=True)
                log.info("removed %s, the shared memory of a server that did not end on its own", path)


SHM_DIR = Path("/dev/shm")
SHM_REGION = f"{SHM_DIR}/triton_python_backend_shm_region"
PYTRITON_REGION = "pytrtion"  # PyTriton's prefix for its server's regions, spelled as PyTriton spells it


def pytriton_regions(shm_dir: Path = SHM_DIR, pid: int | None = None) -> set[str]:
    """The shared-memory files of the PyTriton servers this process (or ``pid``) made: PyTriton names its server's
    Python-backend regions ``pytrtion<pid>-<random>...`` after the process that made the server, where the stubs'
    maps do not show them once the stubs are killed; 4 MiB each of the machine's memory until removed."""
    pid = os.getpid() if pid is None else pid
    try:
        return {str(path) for path in shm_dir.glob(f"{PYTRITON_REGION}{pid}-*")}
    except OSError:  # no such folder (not Linux)
        return set()


def _own_resource_tracker(process: Any) -> bool:
    """Whether ``process`` is this process's multiprocessing resource tracker (PyTriton's shared memory starts it
    under load): no part of the server, it ends with this process, so a stop that waited for it would always run
    to the reaper's deadline and then kill it. Told by the pid multiprocessing keeps (its command line may still be
    this process's own for a moment after it started)."""
    from multiprocessing import resource_tracker

    return process.pid == getattr(resource_tracker._resource_tracker, "_pid", None)


def _server_log_on_stdout(verbose: bool) -> None:
    """PyTriton echoes every line tritonserver writes (its startup tables, CUDA and NVML probes that fail on a
    CPU machine, shutdown notes) to stdout, where `kiln serve` prints the URLs; its server class takes a
    ``verbose`` flag that PyTriton never sets, and its module-level name is the one place to set it."""
    import functools

    import pytriton.triton
    from pytriton.server.triton_server import TritonServer

    pytriton.triton.TritonServer = functools.partial(TritonServer, verbose=verbose)


def _server_said(triton: Any) -> str:
    """The last error line of the log PyTriton captured from its server ("" without one)."""
    server = getattr(triton, "_triton_server", None)
    try:
        return _last_error_line(server.logs() if server is not None else "")
    except Exception:  # a log that cannot be read: the error stands without it
        return ""


def _use_stub_python(stub_python: Path) -> None:
    """PyTriton puts ``sys.exec_prefix/bin`` first on the server's PATH (its way of choosing the stub's
    interpreter), in front of ours; its module-level lookup is the one place to say which environment to use."""
    from pytriton.server import triton_server

    triton_server.get_triton_python_backend_python_env = lambda: stub_python


def _wait(triton: Any, stop: _StopRequest) -> None:
    """Until a signal asks to stop (returns; the `with` block stops the server) or the server dies (raises)."""
    while not stop.requested:
        if not triton.is_alive():
            raise ServerDied("the Triton server exited unexpectedly", hint="rerun with --verbose to see why")
        time.sleep(0.5)


def prepared_tritonserver(scratch: Path) -> Path:
    """A copy of PyTriton's bundled ``tritonserver`` tree whose Python backend has the stub built for this
    interpreter (the wheel ships one per Python version; PyTriton prepares its workspace the same way).
    Returns the tree's root (``bin/tritonserver``, ``backends/``)."""
    distribution = _distribution()
    root = scratch / "tritonserver"
    if not root.is_dir():
        shutil.copytree(
            distribution.get_root_module_path() / "tritonserver",
            root,
            ignore=shutil.ignore_patterns("python_backend_stubs"),
        )
        version = f"{sys.version_info[0]}.{sys.version_info[1]}"
        stub = distribution.get_stub_path(version)
        shutil.copy2(stub, root / "backends" / "python" / "triton_python_backend_stub")
    return root


def tritonserver_process(
    repository: Path,
    scratch: Path,
    http_port: int,
    grpc_port: int,
    metrics_port: int,
    log_file: Path | None = None,
    address: str = "127.0.0.1",
    echo: bool = False,
    reloadable: bool = False,
    http_threads: int | None = None,
) -> subprocess.Popen[bytes]:
    """Start the bundled ``tritonserver --model-repository REPOSITORY`` on ``address``. The caller stops it
    (``terminate()`` = SIGTERM, which Triton handles by draining, unloading its models and exiting).
    ``reloadable``: every model loaded at start as usual, and reloadable through Triton's repository API
    (explicit model control), as :class:`StubWatch` does when a stub dies. ``http_threads``: the HTTP frontend's
    threads, which read requests and write responses for every connection (Triton's default without it).
    The server ends with this process, or with the thread that calls this (:func:`server_popen`): call it from the
    thread that waits on the server."""
    # absolute: the server starts in ``scratch``, where paths relative to this process's folder mean nothing
    repository, scratch = repository.resolve(), scratch.resolve()
    root = prepared_tritonserver(scratch)
    check_ports(address, http_port, grpc_port, metrics_port)
    env = server_env(stub_python_env(scratch))
    cmd = [
        str(root / "bin" / "tritonserver"),
        f"--model-repository={repository}",
        f"--backend-directory={root / 'backends'}",
        f"--http-address={address}",
        f"--http-port={http_port}",
        f"--grpc-address={address}",
        f"--grpc-port={grpc_port}",
        f"--metrics-port={metrics_port}",
        f"--exit-timeout-secs={EXIT_TIMEOUT_S}",
        # every config.pbtxt Kiln writes is complete: without this Triton first starts a stub per Python-backend
        # model only to ask it for a config (1.5 s of a 3 s start on the demo)
        "--disable-auto-complete-config",
        # Triton's exit waits for its metrics thread's next poll of the CPU and GPU gauges (every 2 s by default):
        # a shorter period is a shorter stop; request counters and Kiln's stub timings are kept per request anyway
        "--metrics-interval-ms=250",
    ]
    if reloadable:
        cmd += ["--model-control-mode=explicit", "--load-model=*"]
    if http_threads is not None:
        cmd += [f"--http-thread-count={http_threads}"]
    # In the scratch folder: the Python stubs it starts look for modules in their working folder first, where a
    # folder named like one of the engine's packages (a `kiln/` checkout) would shadow the installed one.
    if log_file is None:  # ``echo``: its log on this process's stderr (--verbose)
        return server_popen(cmd, env, scratch, sys.stderr if echo else subprocess.DEVNULL)
    with open(log_file, "wb") as out:  # the child keeps its own copy of the descriptor
        return server_popen(cmd, env, scratch, out)


def server_popen(cmd: list[str], env: dict[str, str] | None, cwd: Path, out: Any) -> subprocess.Popen[bytes]:
    """Start a long-lived server process (``tritonserver``) that ends with this process however this one ends.

    On Linux the child asks for SIGTERM when its parent dies (:func:`kiln.core.child_processes.die_with_parent`): a
    ``kiln serve`` killed with SIGKILL left its ``tritonserver`` (and the stubs under it) serving on, from a scratch
    folder the next command removed, and holding the ports. SIGTERM, as PyTriton asks for its own server: Triton
    drains for ``EXIT_TIMEOUT_S`` and exits. The signal comes when the *thread* that started the child ends: call
    this from the thread that waits on the server (``kiln serve``'s main thread)."""
    return subprocess.Popen(cmd, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, preexec_fn=die_with_parent())


def wait_ready(
    url: str,
    models: list[str],
    timeout_s: float = 60.0,
    process: subprocess.Popen[bytes] | None = None,
    listening: tuple[int, ...] = (),
    check: Callable[[], None] | None = None,
) -> None:
    """Poll Triton's readiness endpoints until the server and ``models`` are ready and every port in
    ``listening`` (on the URL's host) accepts connections. Triton opens its metrics port after its HTTP one, so
    a ready HTTP endpoint alone leaves a moment, longer on a busy machine, where the metrics are refused.
    ``check`` is called after each poll that finds the server not ready: it ends the wait by raising (a stop asked
    meanwhile). A server found ready returns, whatever came meanwhile: it answers from then on (a client or a
    readiness probe polling it may have been answered already), so a stop from then on is its normal end."""
    deadline = time.monotonic() + timeout_s
    address = url.removeprefix("http://")
    host = address.rsplit(":", 1)[0].strip("[]")
    paths = ["/v2/health/ready", *(f"/v2/models/{urllib.parse.quote(m)}/ready" for m in models)]

    def ready() -> bool:
        try:
            answers = all(triton_http(address, p, timeout_s=5.0)[0] == 200 for p in paths)
            return answers and all(_accepts(host, port) for port in listening)
        except OSError:  # connection refused while it starts: keep polling until the deadline
            return False

    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise KilnError(
                f"tritonserver exited with code {process.returncode} before it was ready", hint="see its log"
            )
        if ready():
            return
        if check is not None:
            try:
                check()
            except BaseException:  # a stop: unless the server became ready while the poll above ran
                if ready():
                    return
                raise
        time.sleep(0.1)
    raise KilnError(f"Triton at {url} was not ready within {timeout_s:.0f} s", hint="see the server's log")


def _accepts(host: str, port: int) -> bool:
    """Whether something listens on ``host:port`` (a TCP connect, closed at once)."""
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def parse_gpus(spec: str, visible: int | None = None) -> list[int]:
    """``all`` or ``0,1`` -> GPU ids, checked against the GPUs this machine shows (``visible``: their count,
    by default CUDA's)."""
    if visible is None:
        visible = _visible_gpus()
    if spec.strip().lower() == "all":
        ids = list(range(visible))
    else:
        try:
            ids = [int(v) for v in spec.split(",") if v.strip()]
        except ValueError:
            raise ConfigError(
                f"--gpus '{spec}' is not 'all' or GPU ids", hint="e.g. --gpus all or --gpus 0,1"
            ) from None
    if not ids:
        raise BackendUnavailable("--gpus: no CUDA GPU is visible on this machine", hint="serve without --gpus")
    wrong = [i for i in ids if not 0 <= i < visible] + [i for i in set(ids) if ids.count(i) > 1]
    if wrong:
        raise ConfigError(
            f"--gpus {spec}: GPU {wrong[0]} is {'listed twice' if ids.count(wrong[0]) > 1 else 'not visible'} "
            f"(this machine shows {visible} GPU{'s' * (visible != 1)})",
            hint=f"give distinct ids from 0 to {visible - 1}, or --gpus all" if visible else "serve without --gpus",
        )
    return ids


def _visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def default_instances(gpus: list[int] | None, cores: int | None = None) -> int:
    """Model instances per GPU when none are asked for: 8 on each GPU, fewer where the host has under 2 cores per
    stub (stubs time-share their GPU, so more of them serve more requests only while the host's cores keep up;
    docs/serving.md has the measurements); 1 for engines on the CPU (one stub already uses every core)."""
    if not gpus:
        return 1
    cores = cores or os.cpu_count() or 1
    return max(1, min(8, cores // (2 * len(gpus))))


GPU_STUB_MAX_BATCH = 8
CPU_MAX_BATCH = 32


def default_max_batch(gpus: list[int] | None) -> int:
    """The largest batch Triton forms when none is asked for. Engines on GPUs are served by several stubs to a
    GPU, which time-share it, and a stub's execution grows with every request in its batch: a large batch buys no
    throughput there, while a backlog taken whole by one stub (the dynamic batcher hands the next free instance
    everything queued, up to this size) waits behind that one long execution as the other stubs idle. So
    :data:`GPU_STUB_MAX_BATCH` with ``gpus``, spreading a backlog over the stubs (docs/serving.md has the
    measurements); one instance on the CPU gains from large batches: :data:`CPU_MAX_BATCH`."""
    return GPU_STUB_MAX_BATCH if gpus else CPU_MAX_BATCH


def write_repository(
    repository: Path,
    served: list[ServedEngine],
    gpus: list[int] | None,
    instances: int,
    max_batch: int,
    queue_delay_us: int,
) -> list[str]:
    """A Python-backend model repository serving each engine with ``instances`` instances on every GPU in ``gpus``
    (Triton's ``instance_group.gpus``), or on the engine's device kind without ``gpus``: what ``kiln serve``
    starts. Returns the model names."""
    not_cuda = [s.meta.name for s in served if s.meta.device != "cuda"]
    if gpus is not None and not_cuda:
        raise ConfigError(
            f"--gpus serves CUDA engines; {', '.join(not_cuda)} run{'s' * (len(not_cuda) == 1)} on the CPU",
            hint="serve a CUDA engine folder with --gpus, or serve these without it",
        )
    for s in served:
        write_python_model(repository / s.model_name, s.engine_dir, s.meta, max_batch, gpus, instances, queue_delay_us)
    return [s.model_name for s in served]


def serve_python_backend(
    served: list[ServedEngine],
    gpus: list[int] | None,
    instances: int,
    ports: tuple[int, int, int],
    max_batch: int = CPU_MAX_BATCH,
    queue_delay_us: int = 100,
    address: str = "127.0.0.1",
    on_ready: Callable[[list[ServedEngine]], None] | None = None,
    exit_on_overrun: bool = False,
    verbose: bool = False,
    http_threads: int | None = None,
    *,
    stop: _StopRequest,
) -> None:
    """Every engine behind one endpoint: plain ``tritonserver`` on a Python-backend repository (each instance a
    stub process that loads the engine; with ``gpus``, instance groups over those GPUs, each stub pinned to its
    own). PyTriton runs every model in this one process, where a runner cannot be pinned to a GPU of its own.
    Serves until ``stop`` is asked (the signal handler :func:`serve` installs); asked before the server is ready,
    the start ends at its next step (:class:`_Stopped`)."""
    _bundled()  # the bundled server, and a stub that works with this numpy
    check_ports(address, *ports)
    stop.check()
    scratch = _scratch()
    reaper = _Reaper(stop, STOP_DEADLINE_S, exit_on_overrun, scratch)
    proc: subprocess.Popen[bytes] | None = None
    log_file = scratch / "tritonserver.log"
    try:
        repository = scratch / "repository"
        models = write_repository(repository, served, gpus, instances, max_batch, queue_delay_us)
        stop.check()
        proc = tritonserver_process(
            repository,
            scratch,
            *ports,
            None if verbose else log_file,
            address,
            verbose,
            reloadable=True,
            http_threads=http_threads,
        )
        try:
            url = f"http://{address}:{ports[0]}"
            wait_ready(url, models, STARTUP_TIMEOUT_S, proc, ports[1:], check=stop.check)
        except KilnError as exc:  # the scratch folder goes with the server: its log's error, said now
            stop.check()  # Ctrl-C while it started reached Triton too (one process group): a stop, not a death
            reason = _last_error_line(log_file.read_text(errors="replace")) if log_file.is_file() else ""
            if proc.poll() is not None:
                raise _died_while_starting(reason) from None
            raise ServerDied(f"{exc.message}{f': {reason}' if reason else ''}", hint=exc.hint) from None
        watch = StubWatch(proc, f"{address}:{ports[0]}", models)  # before "ready": stubs seen alive are named
        _declare_ready(stop, on_ready, served)
        while not stop.requested:
            if proc.poll() is not None:
                raise ServerDied(f"tritonserver exited with code {proc.returncode}", hint="rerun with --verbose")
            watch.check()
            time.sleep(0.5)
        stop.stopping = True
        log.info("stopping: draining requests in flight (up to %d s)", EXIT_TIMEOUT_S)
        drain_models(f"{address}:{ports[0]}", models, EXIT_TIMEOUT_S)
    finally:
        stop.stopping = True
        if proc is not None and proc.poll() is None:
            proc.terminate()  # drained already on a stop (drain_models); the reaper bounds the rest
            try:
                proc.wait(timeout=STOP_DEADLINE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
        reaper.close()
        shutil.rmtree(scratch, ignore_errors=True)


STUB = "triton_python_backend_stub"


class StubWatch:
    """Watches the Python-backend stubs of a running ``tritonserver``. A stub that dies (killed, out of memory, a
    crash in the engine) leaves its model instance answering every request with Triton's "Stub process ... is not
    healthy" error and never comes back on its own; :meth:`check` finds a model with fewer live stubs than its
    config's instances, says so on the log (model, instance, process where it was seen alive) and reloads the model
    through Triton's repository API, which starts new stubs and retires the dead one; a reload that fails is said
    and tried again after ``RETRY_S``. Counting against the config, not against the stubs first seen, also catches
    a stub that died before the watch started. Requests sent to the dead instance meanwhile get that error: nothing
    restarts silently."""

    RETRY_S = 10.0

    def __init__(self, server: subprocess.Popen[bytes], http_address: str, models: list[str]) -> None:
        self.server, self.http_address = server, http_address
        self.stubs = self._stubs()  # first: a stub that dies from here on is named
        self.expected = {model: self._instances(model) for model in models}
        self.failed: dict[str, float] = {}  # model -> when its last reload failed

    def _instances(self, model: str) -> int:
        """Stub processes the model's config asks for: each instance group's count, once per GPU it names."""
        path = f"/v2/models/{urllib.parse.quote(model)}/config"
        status, config = triton_http(self.http_address, path, timeout_s=STARTUP_TIMEOUT_S)
        if status != 200:  # counted as one instance: a stub that dies is still said and its model reloaded
            log.warning("model %s: its config could not be read (HTTP %d); watching it as one instance", model, status)
        groups = (config or {}).get("instance_group", [])
        return sum(int(g.get("count", 1)) * max(1, len(g.get("gpus", []))) for g in groups) or 1

    def _stubs(self) -> dict[Any, tuple[str, str]]:
        """The server's live stub processes -> (model, instance), read from their command lines (the model's
        ``<repository>/<model>/<version>/model.py`` and the instance name); a dead one has none to read."""
        import psutil

        found = {}
        for child in psutil.Process(self.server.pid).children():
            try:
                cmd = child.cmdline()
            except psutil.Error:  # gone, or a zombie Triton has not reaped
                continue
            if len(cmd) > 8 and cmd[0].endswith(STUB):
                found[child] = (Path(cmd[1]).parent.parent.name, cmd[8])
        return found

    def check(self) -> list[str]:
        """Reload the models with fewer live stubs than their instances; returns the models it reloaded."""
        live = self._stubs()
        dead = {p: m for p, m in self.stubs.items() if p not in live}
        short = sorted(m for m, n in self.expected.items() if sum(1 for x, _ in live.values() if x == m) < n)
        for process, (model, instance) in dead.items():
            log.error("model %s: instance %s died (stub process %d); reloading the model", model, instance, process.pid)
        named = {model for model, _ in dead.values()}
        self.stubs = live
        now = time.monotonic()
        reloaded = []
        for model in short:
            if now - self.failed.get(model, -self.RETRY_S) < self.RETRY_S:
                continue  # said when its last reload failed; tried again after RETRY_S
            if model not in named and model not in self.failed:
                log.error("model %s: an instance's stub process is gone; reloading the model", model)
            if self._reload(model):
                self.failed.pop(model, None)
                reloaded.append(model)
            else:
                self.failed[model] = now
        if reloaded:
            self.stubs = self._stubs()
        return reloaded

    def _reload(self, model: str) -> bool:
        path = f"/v2/repository/models/{urllib.parse.quote(model)}/load"
        try:
            status, body = triton_http(self.http_address, path, "POST", timeout_s=STARTUP_TIMEOUT_S)
            why = f"HTTP {status}: {(body or {}).get('error', '')}" if status != 200 else ""
        except OSError as exc:
            why = str(exc)
        if why:  # the server goes on for its other models; the error is said, the reload retried
            log.error(
                "model %s could not be reloaded (tried again in %.0f s): %s", model, self.RETRY_S, first_line(why)
            )
            return False
        log.warning("model %s reloaded: new instances serve it", model)
        return True


def _died_while_starting(reason: str) -> KilnError:
    """The error for a ``tritonserver`` that exited before it was ready, from its log's last error line: a model it
    could not load is named with the exception its stub raised."""
    failed = re.match(r"\"?failed to load '([^']+)' version \d+: (?:\w+: )?(.*)", reason)
    if failed is None:
        return ServerDied(
            f"the Triton server exited while starting{f': {reason}' if reason else ''}",
            hint="rerun with --verbose to see the server's log",
        )
    model, why = failed[1], failed[2].split("\\n")[0].strip()
    stub_import = "No module named" in why
    return ServerDied(
        f"Triton could not load model {model}: {why}",
        hint="the Python backend stub imports what this process imports: install the module into this environment"
        if stub_import
        else "rerun with --verbose to see the server's log",
    )


def iter_urls(address: str, http_port: int, grpc_port: int, served: list[ServedEngine]) -> Iterator[str]:
    yield f"HTTP  http://{address}:{http_port}   gRPC  grpc://{address}:{grpc_port}"
    yield f"health: http://{address}:{http_port}/v2/health/live   ready: http://{address}:{http_port}/v2/health/ready"
    for s in served:
        yield (
            f"model {s.model_name}: POST http://{address}:{http_port}/v2/models/{s.model_name}/infer "
            f"({s.meta.backend} {s.meta.device} {s.meta.precision})"
        )
