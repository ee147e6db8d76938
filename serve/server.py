"""``kiln serve``: the validated engines of a workdir (or one engine folder) behind a real Triton server.

PyTriton starts the ``tritonserver`` bundled in its wheel and binds each engine's runner as a Python model with
Triton's dynamic batcher: the server queues single requests for up to ``max_queue_delay_us`` and hands the
runner one concatenated batch. Names, dtypes and shapes come from ``kiln-engine.json``. Health and readiness are
Triton's own ``/v2/health/live`` and ``/v2/health/ready``. SIGINT and SIGTERM stop the server and its Python
stubs (PyTriton's ``stop``), so nothing outlives ``kiln serve``.

:func:`tritonserver_process` runs the same bundled binary on a plain repository (``package/triton-python``).
"""

from __future__ import annotations

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
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import numpy as np

from kiln.core.errors import BackendUnavailable, GateFailure, InputFileError, KilnError
from kiln.core.records import EngineMetadata, ValidationResult
from kiln.core.text import first_line
from kiln.stages.engines.backend import SIDECAR, read_metadata
from kiln.stages.engines.registry import load_engine
from kiln.stages.package.triton import served_max_batch

log = logging.getLogger("kiln.serve.server")
INSTALL_HINT = 'pip install "kiln[serve]"'
# Triton waits this long for in-flight requests at shutdown, then exits anyway (its default is 30 s).
EXIT_TIMEOUT_S = 5


class PortInUse(KilnError):
    """A port the server must listen on is taken."""


@dataclass
class ServedEngine:
    model_name: str
    engine_dir: Path
    meta: EngineMetadata


def _validation_verdicts(workdir: Path) -> dict[str, Any] | None:
    path = workdir / "validate" / "validation.json"
    if not path.is_file():
        return None
    result = ValidationResult.read(path, hint="rerun `kiln run --force validate`")
    return {e.name: e.passed for e in result.engines}


def _refuse(name: str, verdict: Any) -> None:
    if verdict is not True:
        state = "failed validation" if verdict is False else "was not validated on a machine that can run it"
        raise GateFailure(
            f"engine {name} {state}: Kiln serves only engines proven against PyTorch",
            hint="fix the engine and `kiln run` again (see report.md), or serve another engine",
        )


def find_engines(path: str | Path) -> list[ServedEngine]:
    """The engines to serve under ``path``: one engine folder (refused if its workdir's validation failed it),
    or a workdir's ``package/engines`` (all validated), else its ``build/*`` that ``validate`` passed."""
    path = Path(path)
    if (path / SIDECAR).is_file():
        meta = read_metadata(path)
        verdicts = _validation_verdicts(path.parent.parent) if path.parent.name == "build" else None
        if verdicts is not None:
            _refuse(meta.name, verdicts.get(meta.name))
        return [ServedEngine(model_name(meta.name), path, meta)]
    if not path.is_dir():
        raise InputFileError(
            f"{path} is neither a Kiln workdir nor an engine folder",
            hint="pass the --workdir of a `kiln run`, or a folder holding kiln-engine.json",
        )
    packaged = sorted(p.parent for p in (path / "package" / "engines").glob(f"*/{SIDECAR}"))
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
            served.append(ServedEngine(model_name(meta.name), d, meta))
    if not served:
        _refuse(", ".join(d.name for d in built), False)
    return served


def model_name(engine_name: str) -> str:
    """The name an engine is served under: its folder's name in Triton's alphabet (onnxruntime_cpu_fp32)."""
    return re.sub(r"[^A-Za-z0-9_]", "_", engine_name)


def check_ports(address: str, *ports: int) -> None:
    """Fail before starting anything if a port is taken (Triton would only log it and exit)."""
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((address, port))
            except OSError as exc:
                raise PortInUse(
                    f"port {port} on {address} is in use ({exc.strerror})",
                    hint="stop what listens there, or choose other ports with --http-port/--grpc-port/--metrics-port",
                ) from None


def free_port() -> int:
    """An ephemeral port free right now on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env(stub_python: Path, env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a ``tritonserver`` process. Its Python backend stub loads the first ``libpython3.X``
    the loader finds; with an interpreter not installed by the system (pyenv, conda) that is the system's, two
    interpreters mix and the model fails to load ('_thread.RLock' object has no attribute '_recursion_count').
    The running interpreter's LIBDIR goes first on LD_LIBRARY_PATH. ``stub_python`` (:func:`stub_python_env`)
    goes first on PATH: the stub's embedded interpreter takes its prefix from the ``python3`` it finds there."""
    from pytriton.utils.distribution import get_libs_path

    env = dict(os.environ if env is None else env)
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    # PyTriton's bundled libraries (its CUDA runtime among them): tritonserver runs from a copy in a workspace,
    # where its relative RPATH no longer reaches them (libcudart-*.so not found).
    import pytriton

    # ... and the libraries auditwheel bundled beside the package (nvidia_pytriton.libs: libcudart and others).
    wheel_libs = Path(pytriton.__file__).resolve().parent.parent / "nvidia_pytriton.libs"
    bundled = [str(get_libs_path())] + ([str(wheel_libs)] if wheel_libs.is_dir() else [])
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
    try:
        import pytriton.triton
    except ImportError:
        raise BackendUnavailable(
            "kiln serve needs PyTriton (nvidia-pytriton), which is not installed", hint=INSTALL_HINT
        ) from None
    try:
        pytriton_version = version("nvidia-pytriton")
    except PackageNotFoundError:  # importable without its distribution's metadata (vendored): nothing to compare
        return pytriton
    check_stub_numpy(np.__version__, pytriton_version)
    return pytriton


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


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, ... up to ``max_batch`` (included): the batch sizes a shape-specialised engine is run at."""
    sizes = [1 << i for i in range(max_batch.bit_length()) if 1 << i < max_batch]
    return [*sizes, max_batch]


def pad_rows(inputs: dict[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
    """Each input grown to ``rows`` rows by repeating its last row (rows are independent at inference)."""
    return {
        k: np.concatenate([v, np.repeat(v[-1:], rows - len(v), axis=0)]) if rows > len(v) else v
        for k, v in inputs.items()
    }


def _infer_func(
    runner: Any, outputs: dict[str, np.dtype], buckets: list[int] | None, meta: EngineMetadata | None = None
) -> Callable[..., dict[str, np.ndarray]]:
    """``buckets``: pad every batch to the next of these sizes (engines that build a session and capture a CUDA
    graph per input shape: without it each new batch size the dynamic batcher forms costs a session build).
    ``meta``: inputs outside the sizes the engine was validated for are answered with an error naming them."""
    from pytriton.decorators import batch

    @batch  # PyTriton's: the dynamic batcher's requests arrive as one batch of numpy arrays
    def infer(**inputs: np.ndarray) -> dict[str, np.ndarray]:
        outside = meta.outside_range({k: v.shape for k, v in inputs.items()}) if meta is not None else None
        if outside is not None:
            raise ValueError(outside)
        rows = len(next(iter(inputs.values())))
        size = next((b for b in buckets if b >= rows), rows) if buckets else rows
        result = runner.infer(pad_rows(inputs, size))
        return {name: np.asarray(result[name][:rows], dtype=dtype) for name, dtype in outputs.items()}

    return infer


def warm_buckets(runner: Any, meta: EngineMetadata, buckets: list[int]) -> bool:
    """Build the engine's per-shape sessions for every bucket before the server says ready. Only for inputs whose
    other dimensions are fixed (a dynamic sequence axis has no one size to warm)."""
    if any(not all(isinstance(d, int) and d > 0 for d in s.shape[1:]) for s in meta.inputs):
        return False
    for size in buckets:
        runner.infer({s.name: np.zeros((size, *s.shape[1:]), dtype=np.dtype(s.dtype)) for s in meta.inputs})
    return True


def _bind(triton: Any, served: ServedEngine, runner: Any, max_batch: int, queue_delay_us: int) -> None:
    from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor

    mbs = served_max_batch(served.meta, max_batch)
    batched = mbs > 0

    def tensors(specs: list[dict[str, Any]]) -> list[Any]:
        return [
            Tensor(
                name=s.name,
                dtype=np.dtype(s.dtype),
                shape=tuple(d if isinstance(d, int) and d > 0 else -1 for d in (s.shape[1:] if batched else s.shape)),
            )
            for s in specs
        ]

    outputs = {s.name: np.dtype(s.dtype) for s in served.meta.outputs}
    buckets = batch_buckets(mbs) if batched and getattr(runner, "per_shape_sessions", False) else None
    if buckets and warm_buckets(runner, served.meta, buckets):
        log.info("%s: batches padded to %s rows, each size warmed", served.model_name, buckets)
    config = ModelConfig(
        max_batch_size=mbs,
        batching=batched,
        batcher=DynamicBatcher(max_queue_delay_microseconds=queue_delay_us, preferred_batch_size=buckets or []),
    )
    triton.bind(
        model_name=served.model_name,
        infer_func=_infer_func(runner, outputs, buckets, served.meta),
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
        raise KilnError(
            f"Triton could not load model {served.model_name}: {reason}",
            hint="a 'No module named ...' comes from the Python backend stub, which imports what this "
            "process imports: install the module into this environment",
        ) from None


class _StopRequest:
    """SIGINT/SIGTERM handler: the first signal asks the serving loop to stop (:func:`_wait` looks every 0.5 s),
    a second one raises KeyboardInterrupt (a startup that hangs can still be interrupted).

    Why not raise from the first signal (Python's SIGINT default): an exception raised by a signal lands in
    whatever the main thread runs at that moment, and inside a finalizer (``__del__`` of a multiprocessing
    connection, seen in CI) Python prints "Exception ignored" and drops it: the server then never stopped."""

    def __init__(self) -> None:
        self.requested = False  # a plain flag: a handler must not take a lock its own thread may hold

    def __call__(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True


def serve(
    path: str | Path,
    http_port: int = 8000,
    grpc_port: int = 8001,
    metrics_port: int = 8002,
    max_batch: int = 32,
    max_queue_delay_us: int = 100,
    address: str = "127.0.0.1",
    on_ready: Callable[[list[ServedEngine]], None] | None = None,
    verbose: bool = False,
) -> None:
    """Serve until SIGINT or SIGTERM. ``on_ready`` is called once every model answers. The server's own log
    is printed with ``verbose`` only; otherwise it is kept, and its path named, when the server fails."""
    served = find_engines(path)
    pytriton = _pytriton()
    _server_log_on_stdout(verbose)
    check_ports(address, http_port, grpc_port, metrics_port)
    scratch = Path(tempfile.mkdtemp(prefix="kiln-serve-"))
    stub_python = stub_python_env(scratch)
    os.environ.update(server_env(stub_python))  # PyTriton starts tritonserver with a copy of os.environ
    _use_stub_python(stub_python)
    config = pytriton.triton.TritonConfig(
        http_address=address,
        http_port=http_port,
        grpc_address=address,
        grpc_port=grpc_port,
        metrics_port=metrics_port,
        exit_timeout_secs=EXIT_TIMEOUT_S,
        log_verbose=0,
    )
    # Statistics stay readable without PyTriton's token (they show batching at work; `kiln loadtest` reads them);
    # model loading, shared memory, tracing and logging stay restricted.
    security = pytriton.triton.TritonSecurityConfig(
        restricted_endpoints=["shared-memory", "model-repository", "trace", "logging"]
    )
    stop = _StopRequest()
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    runners: list[Any] = []
    triton: Any = None
    try:
        for s in served:  # before the server starts: an engine this machine cannot run fails fast
            runners.append(load_engine(s.engine_dir).activate())
        with pytriton.triton.Triton(config=config, security_config=security) as triton:
            for s, runner in zip(served, runners):
                _bind_or_explain(triton, s, runner, max_batch, max_queue_delay_us)
            triton.run()  # returns once the server and every model are ready
            if on_ready is not None and not stop.requested:
                on_ready(served)
            _wait(triton, stop)
            log.info("stopping")
    except KeyboardInterrupt:
        log.info("stopping")
    except KilnError as exc:
        kept = None if verbose or triton is None else _keep_server_log(triton)
        if kept is not None:
            exc.hint = f"{exc.hint}; the server's log: {kept}" if exc.hint else f"the server's log: {kept}"
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for r in runners:
            r.deactivate()
        shutil.rmtree(scratch, ignore_errors=True)


def _server_log_on_stdout(verbose: bool) -> None:
    """PyTriton echoes every line tritonserver writes (its startup tables, CUDA and NVML probes that fail on a
    CPU machine, shutdown notes) to stdout, where `kiln serve` prints the URLs; its server class takes a
    ``verbose`` flag that PyTriton never sets, and its module-level name is the one place to set it."""
    import functools

    import pytriton.triton
    from pytriton.server.triton_server import TritonServer

    pytriton.triton.TritonServer = functools.partial(TritonServer, verbose=verbose)


def _keep_server_log(triton: Any) -> Path | None:
    """Write the server's captured log to a file of its own (outside the scratch folder, which is removed)."""
    server = getattr(triton, "_triton_server", None)
    text = server.logs() if server is not None else ""
    if not text:
        return None
    fd, name = tempfile.mkstemp(prefix="kiln-serve-", suffix=".log")
    with os.fdopen(fd, "w") as out:
        out.write(text)
    return Path(name)


def _use_stub_python(stub_python: Path) -> None:
    """PyTriton puts ``sys.exec_prefix/bin`` first on the server's PATH (its way of choosing the stub's
    interpreter), in front of ours; its module-level lookup is the one place to say which environment to use."""
    from pytriton.server import triton_server

    triton_server.get_triton_python_backend_python_env = lambda: stub_python


def _wait(triton: Any, stop: _StopRequest) -> None:
    """Until a signal asks to stop (returns; the `with` block stops the server) or the server dies (raises)."""
    while not stop.requested:
        if not triton.is_alive():
            raise KilnError("the Triton server exited unexpectedly", hint="rerun with --verbose to see why")
        time.sleep(0.5)


def prepared_tritonserver(scratch: Path) -> Path:
    """A copy of PyTriton's bundled ``tritonserver`` tree whose Python backend has the stub built for this
    interpreter (the wheel ships one per Python version; PyTriton prepares its workspace the same way).
    Returns the tree's root (``bin/tritonserver``, ``backends/``)."""
    _pytriton()
    from pytriton.utils.distribution import get_root_module_path, get_stub_path

    root = scratch / "tritonserver"
    if not root.is_dir():
        shutil.copytree(
            get_root_module_path() / "tritonserver", root, ignore=shutil.ignore_patterns("python_backend_stubs")
        )
        version = f"{sys.version_info[0]}.{sys.version_info[1]}"
        shutil.copy2(get_stub_path(version), root / "backends" / "python" / "triton_python_backend_stub")
    return root


def tritonserver_process(
    repository: Path, scratch: Path, http_port: int, grpc_port: int, metrics_port: int, log_file: Path | None = None
) -> subprocess.Popen[bytes]:
    """Start the bundled ``tritonserver --model-repository REPOSITORY`` (loopback only). The caller stops it
    (``terminate()`` = SIGTERM, which Triton handles by unloading its models and exiting)."""
    root = prepared_tritonserver(scratch)
    check_ports("127.0.0.1", http_port, grpc_port, metrics_port)
    env = server_env(stub_python_env(scratch))
    cmd = [
        str(root / "bin" / "tritonserver"),
        f"--model-repository={repository}",
        f"--backend-directory={root / 'backends'}",
        "--http-address=127.0.0.1",
        f"--http-port={http_port}",
        "--grpc-address=127.0.0.1",
        f"--grpc-port={grpc_port}",
        f"--metrics-port={metrics_port}",
        f"--exit-timeout-secs={EXIT_TIMEOUT_S}",
    ]
    if log_file is None:
        return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    with open(log_file, "wb") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)


def wait_ready(
    url: str, models: list[str], timeout_s: float = 60.0, process: subprocess.Popen[bytes] | None = None
) -> None:
    """Poll Triton's readiness endpoints until the server and ``models`` are ready."""
    import tritonclient.http as httpclient

    deadline = time.monotonic() + timeout_s
    client = httpclient.InferenceServerClient(url.removeprefix("http://"))
    try:
        while time.monotonic() < deadline:
            if process is not None and process.poll() is not None:
                raise KilnError(
                    f"tritonserver exited with code {process.returncode} before it was ready", hint="see its log"
                )
            try:
                if client.is_server_ready() and all(client.is_model_ready(m) for m in models):
                    return
            except Exception:  # connection refused while it starts: keep polling until the deadline
                pass
            time.sleep(0.2)
    finally:
        client.close()
    raise KilnError(f"Triton at {url} was not ready within {timeout_s:.0f} s", hint="see the server's log")


def iter_urls(address: str, http_port: int, grpc_port: int, served: list[ServedEngine]) -> Iterator[str]:
    yield f"HTTP  http://{address}:{http_port}   gRPC  grpc://{address}:{grpc_port}"
    yield f"health: http://{address}:{http_port}/v2/health/live   ready: http://{address}:{http_port}/v2/health/ready"
    for s in served:
        yield (
            f"model {s.model_name}: POST http://{address}:{http_port}/v2/models/{s.model_name}/infer "
            f"({s.meta.backend} {s.meta.device} {s.meta.precision})"
        )
