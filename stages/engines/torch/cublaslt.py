"""FP8 GEMMs through cuBLASLt with an epilogue ``torch._scaled_mm`` does not expose: bias, GELU and an FP8 output.

The FP8 engine's linear layers are ``torch._scaled_mm`` calls (FP8 in, FP16 out, bias in cuBLASLt's epilogue).
Where one is followed by a GELU and the next FP8 layer, the GELU and the cast of its output to FP8 are a kernel of
their own that moves the whole activation twice; cuBLASLt computes both in the GEMM's epilogue
(``CUBLASLT_EPILOGUE_GELU_BIAS`` with an E4M3 ``D`` and a ``D`` scale), one call instead of two
(``benchmarks/cublaslt_fp8_probe.py``). PyTorch binds no such call, so this module calls the ``libcublasLt`` torch
has already loaded through ctypes: nothing to build, the same library and version as torch's own GEMMs.

The same binding runs float16 GEMMs, and any of them can run the fastest of the heuristic's first algorithms,
timed on the layer's own tensors (:meth:`LtGemm.tune`, :func:`measured`; ``build.torch.gemm_algorithms:
measured``) instead of its first, as TensorRT's builder times its tactics.

cuBLASLt's GELU is the tanh approximation (at most 4.7e-4 from the exact one, far inside FP8's steps); the
engine's accuracy gates judge the result as for every engine.
"""

from __future__ import annotations

import ctypes
import logging
import statistics
import threading
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

log = logging.getLogger("kiln.build")

# cuBLASLt's enums (cublasLt.h, CUDA 12 and 13)
CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF, CUDA_R_8F_E4M3 = 0, 2, 14, 28
CUBLAS_COMPUTE_32F = 68
OP_N, OP_T = 0, 1
TRANSA, TRANSB, EPILOGUE, BIAS_POINTER = 3, 4, 7, 8
A_SCALE, B_SCALE, D_SCALE, FAST_ACCUM, BIAS_DATA_TYPE = 17, 18, 20, 25, 26
EPILOGUE_BIAS, EPILOGUE_GELU_BIAS = 4, 36
PREF_MAX_WORKSPACE_BYTES = 1
WORKSPACE_BYTES = 32 << 20  # what cuBLASLt suggests for Hopper
MIN_VERSION = 120000  # cuBLASLt of CUDA 12.0
SLEEP_CYCLES = 4_000_000  # ~2 ms of GPU sleep while :meth:`LtGemm.tune` queues its timed calls
TUNE_CANDIDATES = 16  # the heuristic's first algorithms :meth:`LtGemm.tune` times
TUNE_CALLS, TUNE_ROUNDS = 10, 3  # calls per timing, interleaved rounds per candidate
TUNE_MARGIN = 0.03  # how much faster than the heuristic's first another algorithm must be to be chosen
ALIGNMENT = 256  # what the heuristic assumes of every matrix's address without alignment preferences


class Unavailable(RuntimeError):
    """cuBLASLt cannot run this GEMM here (no library loaded, or no algorithm for the shape and types)."""


class HeuristicResult(ctypes.Structure):
    _fields_ = [
        ("algo", ctypes.c_uint64 * 8),
        ("workspace_size", ctypes.c_size_t),
        ("state", ctypes.c_int),
        ("waves_count", ctypes.c_float),
        ("reserved", ctypes.c_int * 4),
    ]


@cache
def library() -> ctypes.CDLL:
    """The libcublasLt this process's torch loaded (after one CUDA matmul), found in /proc/self/maps, with the
    argument types of the functions used (sizes and pointers passed as 64-bit values)."""
    import torch

    torch.ones(16, 16, device="cuda") @ torch.ones(16, 16, device="cuda")
    maps = Path("/proc/self/maps")
    paths = [line.split()[-1] for line in maps.read_text().splitlines() if "libcublasLt.so" in line]
    if not paths:
        raise Unavailable("torch has not loaded libcublasLt")
    lib = ctypes.CDLL(paths[0])
    lib.cublasLtGetVersion.restype = ctypes.c_size_t
    if lib.cublasLtGetVersion() < MIN_VERSION:  # the attribute numbers above are CUDA 12's and 13's
        raise Unavailable(f"cuBLASLt {lib.cublasLtGetVersion()} is older than {MIN_VERSION}")
    ptr, i32, u64, i64, size = ctypes.c_void_p, ctypes.c_int32, ctypes.c_uint64, ctypes.c_int64, ctypes.c_size_t
    lib.cublasLtCreate.argtypes = [ptr]
    lib.cublasLtMatmulDescCreate.argtypes = [ptr, i32, i32]
    lib.cublasLtMatmulDescSetAttribute.argtypes = [ptr, i32, ptr, size]
    lib.cublasLtMatrixLayoutCreate.argtypes = [ptr, i32, u64, u64, i64]
    lib.cublasLtMatmulPreferenceCreate.argtypes = [ptr]
    lib.cublasLtMatmulPreferenceSetAttribute.argtypes = [ptr, i32, ptr, size]
    lib.cublasLtMatmulAlgoGetHeuristic.argtypes = [ptr] * 7 + [ctypes.c_int, ptr, ptr]
    lib.cublasLtMatmul.argtypes = [ptr] * 14 + [size, ptr]
    return lib


def _check(status: int, what: str) -> None:
    if status != 0:
        raise Unavailable(f"cuBLASLt {what}: status {status}")


class LtGemm:
    """One cuBLASLt GEMM, ``D[m, n] = epilogue(scale_x * scale_w * X[m, k] @ W[n, k]^T + bias) * scale_d`` with X
    and W in E4M3 (or ``in_type``: float16 / bfloat16, without scales), for one shape and set of types: cuBLASLt's
    descriptors and the algorithm its heuristic picks (or :meth:`tune` measures), made once. The pointers
    (tensors, scales, bias) are set at each call, so one object serves every layer of its shape. In the TN layout
    FP8 needs: column-major, ``D^T = W . X^T``."""

    def __init__(
        self, m: int, n: int, k: int, out_type: int, epilogue: int, bias_type: int, in_type: int = CUDA_R_8F_E4M3
    ) -> None:
        self.lib = lib = library()
        self.handle, self.desc = ctypes.c_void_p(), ctypes.c_void_p()
        _check(lib.cublasLtCreate(ctypes.byref(self.handle)), "create")
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), CUBLAS_COMPUTE_32F, CUDA_R_32F), "descriptor")
        self._set(TRANSA, ctypes.c_int32(OP_T))
        self._set(TRANSB, ctypes.c_int32(OP_N))
        self._set(EPILOGUE, ctypes.c_uint32(epilogue))
        if in_type == CUDA_R_8F_E4M3:
            self._set(FAST_ACCUM, ctypes.c_int8(1))
        self._set(BIAS_DATA_TYPE, ctypes.c_int32(bias_type))
        self.layouts = [
            self._layout(in_type, k, n, k),  # W stored [n, k] row-major: k x n column-major, transposed
            self._layout(in_type, k, m, k),  # X [m, k] row-major: k x m column-major
            self._layout(bias_type, n, m, n),  # C: beta is 0, never read
            self._layout(out_type, n, m, n),  # D [m, n] row-major
        ]
        self.pref = pref = ctypes.c_void_p()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "preference")
        limit = ctypes.c_uint64(WORKSPACE_BYTES)
        _check(lib.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE_BYTES, ctypes.byref(limit), 8), "pref")
        if not self.candidates(1):
            raise Unavailable(f"cuBLASLt has no algorithm for {m}x{n}x{k} (type {in_type}) here")
        self.result = self.results[0]
        self.key = (m, n, k, out_type, epilogue, bias_type, in_type)
        self.tuned = False  # :func:`measured` has chosen the algorithm
        self.choice: int | None = None  # the index it chose
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self.lock = threading.Lock()  # the pointers are set on the shared descriptor right before each call

    def candidates(self, most: int) -> int:
        """Ask cuBLASLt's heuristic for up to ``most`` algorithms, its best first (for :meth:`use`); how many came."""
        results, found = (HeuristicResult * most)(), ctypes.c_int(0)
        status = self.lib.cublasLtMatmulAlgoGetHeuristic(
            self.handle, self.desc, *self.layouts, self.pref, most, results, ctypes.byref(found)
        )
        self.results = list(results)[: found.value] if status == 0 else []
        return len(self.results)

    def tune(self, call: Callable[[], None], device: Any = None, most: int = TUNE_CANDIDATES) -> int:
        """Keep the fastest of up to ``most`` of the heuristic's algorithms, timed on ``call`` (this GEMM on the
        layer's own tensors on ``device``), as TensorRT's builder times its tactics; returns its index. Each
        candidate is timed in :data:`TUNE_ROUNDS` interleaved rounds (median), and the heuristic's first is kept
        unless another is :data:`TUNE_MARGIN` faster: a choice inside the noise is no choice. The calls are queued
        behind a GPU sleep, so the CUDA events time the GPU's work, not the Python calls that queue it (at a few
        microseconds per GEMM they take longer than the GEMM). Not while a CUDA graph is being captured: it
        synchronizes. On any failure the algorithm in use before stays."""
        import torch

        first = self.result
        try:
            with torch.cuda.device(device):
                best = self._fastest(call, self._runnable(call, most))
        except BaseException:
            self.result = first
            raise
        self.use(best)
        self.choice = best
        return best

    def _runnable(self, call: Callable[[], None], most: int) -> list[int]:
        """The indices of the heuristic's first ``most`` algorithms that run ``call`` (each run once: its setup)."""
        ready = []
        for i in range(self.candidates(most)):
            self.use(i)
            try:
                call()
            except Unavailable:
                continue
            ready.append(i)
        if not ready:
            raise Unavailable("no algorithm of cuBLASLt's heuristic ran")
        return ready

    def _fastest(self, call: Callable[[], None], ready: list[int]) -> int:
        import torch

        times: dict[int, list[float]] = {i: [] for i in ready}
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(TUNE_ROUNDS):
            for i in ready:
                self.use(i)
                torch.cuda._sleep(SLEEP_CYCLES)
                start.record()
                for _ in range(TUNE_CALLS):
                    call()
                end.record()
                end.synchronize()
                times[i].append(start.elapsed_time(end) / TUNE_CALLS)
        median = {i: statistics.median(t) for i, t in times.items()}
        best = min(median, key=median.__getitem__)
        if 0 in median and median[best] > median[0] * (1 - TUNE_MARGIN):
            return 0
        return best

    def use(self, index: int) -> None:
        """Run with the ``index``-th of the algorithms :meth:`candidates` found (0: the heuristic's choice)."""
        self.result = self.results[index]

    def _set(self, attr: int, value: Any) -> None:
        size = ctypes.sizeof(value)
        _check(self.lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(value), size), f"attr {attr}")

    def _layout(self, dtype: int, rows: int, cols: int, ld: int) -> ctypes.c_void_p:
        layout = ctypes.c_void_p()
        _check(self.lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), dtype, rows, cols, ld), "layout")
        return layout

    def __call__(self, x: Any, weight: Any, scale_x: Any, scale_w: Any, bias: Any, scale_d: Any, out: Any) -> None:
        """``out`` [m, n] from ``x`` [m, k] and ``weight`` [n, k] (both E4M3, contiguous), on the current stream."""
        import torch

        if any(t.data_ptr() % ALIGNMENT for t in (x, weight, out)) or bias.data_ptr() % 16:
            raise Unavailable("a matrix not aligned as the chosen algorithm needs (a view at an offset)")
        c = _scratch(out.device, out.numel() * 2)
        a, b, c_layout, d_layout = self.layouts
        with self.lock:
            for attr, t in ((A_SCALE, scale_w), (B_SCALE, scale_x), (BIAS_POINTER, bias), (D_SCALE, scale_d)):
                self._set(attr, ctypes.c_void_p(None if t is None else t.data_ptr()))
            status = self._matmul(x, weight, c, c_layout, out, a, b, d_layout, torch.cuda.current_stream(out.device))
        _check(status, "matmul")

    def _matmul(self, x: Any, weight: Any, c: Any, c_layout: Any, out: Any, a: Any, b: Any, d: Any, stream: Any) -> int:
        return self.lib.cublasLtMatmul(
            self.handle,
            self.desc,
            ctypes.byref(self.alpha),
            weight.data_ptr(),
            a,
            x.data_ptr(),
            b,
            ctypes.byref(self.beta),
            c.data_ptr(),
            c_layout,
            out.data_ptr(),
            d,
            ctypes.byref(self.result.algo),
            _workspace(out.device).data_ptr(),
            WORKSPACE_BYTES,
            stream.cuda_stream,
        )


_lock = threading.Lock()
_gemms: dict[tuple[Any, ...], LtGemm | Unavailable] = {}
_adopted: dict[str, int] = {}  # :func:`adopt`: shape and types (:func:`_name`) -> the index an engine's build chose
_buffers: dict[tuple[Any, ...], Any] = {}
_retired: list[Any] = []


def _workspace(device: Any) -> Any:
    """cuBLASLt's workspace, one per device: the engine's calls run on one stream at a time (two streams calling
    at once would share it); made at the first call, which runs before any CUDA graph capture."""
    return _buffer(("workspace", device), WORKSPACE_BYTES, device)


def _scratch(device: Any, nbytes: int) -> Any:
    """A buffer for cuBLASLt's ``C`` (beta 0: never read), per device, grown to the largest asked for; a smaller one
    is kept, not freed, since CUDA graphs captured earlier hold its address."""
    held = _buffers.get(("c", device))
    if held is None or held.numel() < nbytes:
        with _lock:
            if held is not None:
                _retired.append(held)
            _buffers.pop(("c", device), None)
        return _buffer(("c", device), nbytes, device)
    return held


def _buffer(key: tuple[Any, ...], nbytes: int, device: Any) -> Any:
    import torch

    with _lock:
        if key not in _buffers:
            _buffers[key] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return _buffers[key]


def gemm(
    m: int,
    n: int,
    k: int,
    out_type: int,
    epilogue: int,
    bias_type: int,
    device: Any,
    in_type: int = CUDA_R_8F_E4M3,
    measure: bool = False,
) -> LtGemm:
    """The (cached) :class:`LtGemm` of a shape and set of types on ``device``; a shape cuBLASLt has no algorithm
    for raises :class:`Unavailable` at every call without asking it again. ``measure``: the object whose algorithm
    :func:`measured` chooses, apart from the heuristic's (an engine built with ``gemm_algorithms: heuristic`` runs
    the heuristic's first even where another engine in the process measures)."""
    key = (m, n, k, out_type, epilogue, bias_type, device, in_type, measure)
    with _lock:
        found = _gemms.get(key)
    if isinstance(found, Unavailable):
        raise Unavailable(str(found))
    if found is None:
        try:
            found = LtGemm(m, n, k, out_type, epilogue, bias_type, in_type)
        except Unavailable as exc:
            found = exc
        with _lock:
            _gemms[key] = found
        if isinstance(found, Unavailable):
            raise Unavailable(str(found))
    return found


def measured(g: LtGemm, call: Callable[[], None], device: Any) -> None:
    """Choose ``g``'s algorithm on its first call outside a CUDA graph capture (the compiled flavour's warm-up call of
    each batch size): the one the engine's build chose for this shape where it recorded one made on this GPU model
    and cuBLASLt (:func:`adopt`; the build warms batch 1 and the largest), else by :meth:`LtGemm.tune`. Later
    calls, and calls being captured, run what was chosen; a failed timing keeps the heuristic's first and is not
    retried. A shape the build did not time (another batch size) is timed in each process that meets it, where its
    answers may differ from another process's in rounding (a split-K algorithm sums in another order), which the
    gates allow for, and where processes loading at once (a server's stubs) time against each other."""
    import torch

    if g.tuned or torch.cuda.is_current_stream_capturing():
        return
    with _lock:
        if g.tuned:
            return
        g.tuned = True
        index = _adopted.get(_name(g.key))
    if index is not None and g.candidates(TUNE_CANDIDATES) > index:
        g.use(index)
        try:
            call()
        except Unavailable:
            g.use(0)  # the heuristic's first until the timing chooses
        else:
            g.choice = index
            return
    g.tune(call, device)


def _name(key: tuple[int, ...]) -> str:
    return ",".join(str(v) for v in key)


def choices() -> dict[str, Any]:
    """The algorithms :func:`measured` chose in this process, per GEMM shape and types, with the GPU model and
    cuBLASLt version they were timed on: what an engine's build records (``gemm_algorithm_choices``) for
    :func:`adopt`. A choice belongs to the shape on that GPU and library, not to one engine."""
    with _lock:
        chosen = {_name(g.key): g.choice for g in _gemms.values() if isinstance(g, LtGemm) and g.choice is not None}
    return {**_here(), "algorithms": chosen}


def _here() -> dict[str, Any]:
    """This process's GPU model and cuBLASLt version (None without a cuBLASLt to call)."""
    import torch

    try:
        version = library().cublasLtGetVersion()
    except Unavailable:
        version = None
    return {"gpu": torch.cuda.get_device_name(), "cublaslt": version}


def adopt(recorded: dict[str, Any]) -> bool:
    """Take an engine's recorded choices (:func:`choices`) for :func:`measured` where they were made on this GPU
    model and cuBLASLt version; elsewhere (an engine moved to another GPU) they are ignored and said so, and each
    shape is timed again. Returns whether they were taken."""
    here = _here()
    made = {key: recorded.get(key) for key in here}
    if made != here or here["cublaslt"] is None:
        log.warning("cuBLASLt algorithms chosen on %s are timed again on %s", made, here)
        return False
    with _lock:
        _adopted.update({str(k): int(v) for k, v in recorded.get("algorithms", {}).items()})
    return True


def gelu_fp8_gemm(m: int, n: int, k: int, bias_dtype: Any, device: Any, measure: bool = False) -> LtGemm:
    """The (cached) call with the bias, GELU and an E4M3 output in its epilogue for a bias of ``bias_dtype``;
    raises :class:`Unavailable` where cuBLASLt has none."""
    return gemm(m, n, k, CUDA_R_8F_E4M3, EPILOGUE_GELU_BIAS, cuda_type(bias_dtype), device, measure=measure)


def cuda_type(dtype: Any) -> int:
    """cuBLASLt's type of a float16 or bfloat16 tensor (biases, outputs, float16 GEMMs' inputs)."""
    import torch

    found = {torch.float16: CUDA_R_16F, torch.bfloat16: CUDA_R_16BF}.get(dtype)
    if found is None:
        raise Unavailable(f"a {dtype} tensor (cuBLASLt's epilogue calls here take float16 or bfloat16)")
    return found


def _fp8_inputs(x: Any, weight: Any, *scales: Any) -> None:
    import torch

    if x.dtype != torch.float8_e4m3fn or weight.dtype != torch.float8_e4m3fn:
        raise Unavailable(f"{x.dtype} x {weight.dtype} inputs (the FP8 calls take E4M3)")
    if any(s.numel() != 1 or s.dtype != torch.float32 for s in scales):
        raise Unavailable("scales other than one float32 per tensor")


def linear_bias_gelu_fp8(
    x: Any, weight: Any, scale_x: Any, scale_w: Any, bias: Any, out_inv_scale: Any, measure: bool = False
) -> Any:
    """``fp8(gelu_tanh(x @ weight.T * scale_x * scale_w + bias) * out_inv_scale)``, [m, n] in E4M3, in one cuBLASLt
    call (``measure``: with the algorithm :func:`measured` chooses). Raises :class:`Unavailable` where cuBLASLt
    cannot."""
    import torch

    _fp8_inputs(x, weight, scale_x, scale_w, out_inv_scale)
    g = gelu_fp8_gemm(x.shape[0], weight.shape[0], x.shape[1], bias.dtype, x.device, measure)
    return _run(g, x, weight, (scale_x, scale_w, bias, out_inv_scale), torch.float8_e4m3fn, measure)


def linear_bias_fp8(x: Any, weight: Any, scale_x: Any, scale_w: Any, bias: Any) -> Any:
    """``x @ weight.T * scale_x * scale_w + bias`` [m, n] in the bias's dtype from E4M3 inputs: what
    ``torch._scaled_mm`` computes, with the algorithm :func:`measured` chooses. Raises :class:`Unavailable`."""
    _fp8_inputs(x, weight, scale_x, scale_w)
    out_type = cuda_type(bias.dtype)
    g = gemm(x.shape[0], weight.shape[0], x.shape[1], out_type, EPILOGUE_BIAS, out_type, x.device, measure=True)
    return _run(g, x, weight, (scale_x, scale_w, bias, None), bias.dtype, measure=True)


def linear_bias(x: Any, weight: Any, bias: Any, gelu: bool) -> Any:
    """``x @ weight.T + bias`` (then cuBLASLt's tanh GELU) [m, n], all float16 or all bfloat16, with the algorithm
    :func:`measured` chooses: what ``torch.addmm`` (``torch._addmm_activation``) computes with the heuristic's.
    Raises :class:`Unavailable`."""
    if not x.dtype == weight.dtype == bias.dtype:
        raise Unavailable(f"{x.dtype} x {weight.dtype} + {bias.dtype} (one dtype for all three)")
    t, epilogue = cuda_type(x.dtype), EPILOGUE_GELU_BIAS if gelu else EPILOGUE_BIAS
    g = gemm(x.shape[0], weight.shape[0], x.shape[1], t, epilogue, t, x.device, in_type=t, measure=True)
    return _run(g, x, weight, (None, None, bias, None), x.dtype, measure=True)


def _run(g: LtGemm, x: Any, weight: Any, rest: tuple[Any, ...], out_dtype: Any, measure: bool) -> Any:
    """``g`` on ``x`` and ``weight`` (made contiguous) with ``rest`` (scale_x, scale_w, bias, scale_d) into a new
    [m, n] tensor of ``out_dtype``; with ``measure``, its algorithm chosen first (:func:`measured`)."""
    import torch

    out = torch.empty(x.shape[0], weight.shape[0], dtype=out_dtype, device=x.device)
    x, weight = x.contiguous(), weight.contiguous()
    if measure:
        measured(g, lambda: g(x, weight, *rest, out), x.device)
    g(x, weight, *rest, out)
    return out
