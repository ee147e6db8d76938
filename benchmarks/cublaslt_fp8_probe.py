"""An FP8 GEMM with its bias, GELU and FP8 output cast in cuBLASLt's epilogue, against the FP8 engine's form.

The FP8 torch engine runs BERT-base's first FFN layer as ``torch._scaled_mm`` (FP8 in, FP16 out, bias in the
epilogue) and then an Inductor kernel for the GELU and the cast of its output to FP8 for the next GEMM; at batch 32
that kernel takes about as long as the GEMM (benchmarks/README.md, "FP8 and INT8 GPU engines"). cuBLASLt can do
both in the GEMM's epilogue (``CUBLASLT_EPILOGUE_GELU_BIAS`` with an E4M3 output and a D scale), which
``torch._scaled_mm`` does not expose. This probe calls cuBLASLt directly (ctypes on the ``libcublasLt`` torch has
loaded: no library of its own to build) and times, at BERT-base's FFN shape (K 768, N 3,072) and each ``--rows``:

- ``fp16``: the FP16 engine's form, ``torch._addmm_activation(..., use_gelu=True)`` (cuBLASLt, GELU epilogue);
- ``fp8 engine``: ``torch._scaled_mm`` + the GELU-and-cast kernel Inductor compiles (torch.compile);
- ``lt bias``: this binding's FP8 GEMM with the bias epilogue and an FP16 output (the first half of the engine's
  form, so the binding is checked against torch's own call of the same library);
- ``lt gelu fp16 + cast``: bias and GELU (cuBLASLt's tanh form) in the epilogue, FP16 out, the cast a kernel;
- ``lt gelu fp8``: the whole block in one cuBLASLt call: bias, GELU and the FP8 output.

Each form is captured in a CUDA graph of ``--calls`` calls and replayed; forms interleaved over ``--rounds``
rounds; medians per call. Answers are checked against FP32 arithmetic on the same FP8 inputs.

    python benchmarks/cublaslt_fp8_probe.py --rows 4096,128 --rounds 30     # on the GPU host

Writes ``benchmarks/results/cublaslt_fp8_probe.{json,md}`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import platform
import statistics
from pathlib import Path
from typing import Any

# cuBLASLt's enums (cublasLt.h, CUDA 12 and 13)
CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF, CUDA_R_8F_E4M3 = 0, 2, 14, 28
CUBLAS_COMPUTE_32F = 68
OP_N, OP_T = 0, 1
TRANSA, TRANSB, EPILOGUE, BIAS_POINTER = 3, 4, 7, 8
A_SCALE, B_SCALE, D_SCALE, FAST_ACCUM, BIAS_DATA_TYPE = 17, 18, 20, 25, 26
EPILOGUE_BIAS, EPILOGUE_GELU_BIAS = 4, 36
PREF_MAX_WORKSPACE_BYTES = 1
WORKSPACE = 32 << 20
K, N = 768, 3072


class HeuristicResult(ctypes.Structure):
    _fields_ = [
        ("algo", ctypes.c_uint64 * 8),
        ("workspace_size", ctypes.c_size_t),
        ("state", ctypes.c_int),
        ("waves_count", ctypes.c_float),
        ("reserved", ctypes.c_int * 4),
    ]


def cublaslt() -> ctypes.CDLL:
    """The libcublasLt this process's torch loaded (after a CUDA matmul), found in /proc/self/maps, with the
    argument types of the functions used (sizes and pointers passed as 64-bit values)."""
    import torch

    torch.ones(16, 16, device="cuda") @ torch.ones(16, 16, device="cuda")
    torch.cuda.synchronize()
    paths = [line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if "libcublasLt.so" in line]
    if not paths:
        raise SystemExit("torch has not loaded libcublasLt")
    lib = ctypes.CDLL(paths[0])
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
        raise RuntimeError(f"{what}: cublasStatus {status}")


class LtGemm:
    """D[M, N] = epilogue(scale_a * scale_b * X[M, K] @ W[N, K]^T + bias) * scale_d through cuBLASLt, in the TN
    layout FP8 needs (column-major: D^T = W . X^T)."""

    def __init__(
        self, lib: ctypes.CDLL, m: int, out_type: int, epilogue: int, c_type: int, scales: tuple, bias: Any
    ) -> None:
        """``scales``: device scalars (W's, X's, and D's or None), ``bias``: a device vector of ``c_type``; all
        stay where they are for every call."""
        self.lib = lib
        self.handle, self.desc = ctypes.c_void_p(), ctypes.c_void_p()
        _check(lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), CUBLAS_COMPUTE_32F, CUDA_R_32F), "desc")
        self._set(TRANSA, ctypes.c_int32(OP_T))
        self._set(TRANSB, ctypes.c_int32(OP_N))
        self._set(EPILOGUE, ctypes.c_uint32(epilogue))
        self._set(FAST_ACCUM, ctypes.c_int8(1))
        self._set(BIAS_DATA_TYPE, ctypes.c_int32(c_type))
        self._set(BIAS_POINTER, ctypes.c_void_p(bias.data_ptr()))
        for attr, scale in zip((A_SCALE, B_SCALE, D_SCALE), scales):
            if scale is not None:
                self._set(attr, ctypes.c_void_p(scale.data_ptr()))
        self.layouts = [
            self._layout(CUDA_R_8F_E4M3, K, N, K),  # A: W stored [N, K] row-major = K x N column-major, transposed
            self._layout(CUDA_R_8F_E4M3, K, m, K),  # B: X [M, K] row-major = K x M column-major
            self._layout(c_type, N, m, N),  # C (beta 0: not read)
            self._layout(out_type, N, m, N),  # D [M, N] row-major
        ]
        pref = ctypes.c_void_p()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "preference")
        size = ctypes.c_uint64(WORKSPACE)
        _check(
            lib.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE_BYTES, ctypes.byref(size), 8),
            "preference workspace",
        )
        self.result, found = HeuristicResult(), ctypes.c_int(0)
        status = lib.cublasLtMatmulAlgoGetHeuristic(
            self.handle, self.desc, *self.layouts, pref, 1, ctypes.byref(self.result), ctypes.byref(found)
        )
        if status != 0 or found.value == 0:
            raise RuntimeError(f"no cuBLASLt algorithm (status {status}, {found.value} found)")
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def _set(self, attr: int, value: Any) -> None:
        _check(
            self.lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(value), ctypes.sizeof(value)),
            f"attribute {attr}",
        )

    def _layout(self, dtype: int, rows: int, cols: int, ld: int) -> ctypes.c_void_p:
        layout = ctypes.c_void_p()
        _check(
            self.lib.cublasLtMatrixLayoutCreate(
                ctypes.byref(layout), dtype, ctypes.c_uint64(rows), ctypes.c_uint64(cols), ctypes.c_int64(ld)
            ),
            "layout",
        )
        return layout

    def __call__(self, w: Any, x: Any, c: Any, d: Any, workspace: Any, stream: int) -> None:
        a, b, c_layout, d_layout = self.layouts
        status = self.lib.cublasLtMatmul(
            self.handle,
            self.desc,
            ctypes.byref(self.alpha),
            ctypes.c_void_p(w.data_ptr()),
            a,
            ctypes.c_void_p(x.data_ptr()),
            b,
            ctypes.byref(self.beta),
            ctypes.c_void_p(c.data_ptr()),
            c_layout,
            ctypes.c_void_p(d.data_ptr()),
            d_layout,
            ctypes.byref(self.result.algo),
            ctypes.c_void_p(workspace.data_ptr()),
            WORKSPACE,
            ctypes.c_void_p(stream),
        )
        _check(status, "cublasLtMatmul")


def forms(lib: ctypes.CDLL, m: int) -> tuple[dict[str, Any], dict[str, Any], dict[str, str]]:
    """Each form as a no-argument call, its output (for the check) and why a form is missing."""
    import torch

    fp8 = torch.float8_e4m3fn
    torch.manual_seed(0)
    x32 = torch.randn(m, K, device="cuda")
    w32 = torch.randn(N, K, device="cuda") / K**0.5
    b16 = (torch.randn(N, device="cuda") * 0.1).half()
    sx = (x32.abs().max() / 448).reshape(())
    sw = (w32.abs().max() / 448).reshape(())
    x8, w8 = (x32 / sx).to(fp8), (w32 / sw).to(fp8)
    y_ref = x8.float() * sx @ (w8.float() * sw).t() + b16.float()
    gelu_ref = torch.nn.functional.gelu(y_ref)
    s_out = (gelu_ref.abs().max() / 448).reshape(())
    inv_out = (1 / s_out).reshape(())
    x16, w16 = (x8.float() * sx).half(), (w8.float() * sw).half()
    workspace = torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda")
    out16 = torch.empty(m, N, dtype=torch.float16, device="cuda")
    out8 = torch.empty(m, N, dtype=fp8, device="cuda")
    scratch16 = torch.empty(m, N, dtype=torch.float16, device="cuda")
    calls: dict[str, Any] = {}
    outputs: dict[str, Any] = {}
    missing: dict[str, str] = {}

    calls["fp16"] = lambda: torch._addmm_activation(b16, x16, w16.t(), use_gelu=True)

    @torch.compile(dynamic=False)
    def gelu_cast(y: torch.Tensor) -> torch.Tensor:
        return (torch.nn.functional.gelu(y.float()) * inv_out).clamp(-448, 448).to(fp8)

    def engine() -> Any:
        y = torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=sw, bias=b16, out_dtype=torch.float16, use_fast_accum=True)
        return gelu_cast(y)

    calls["fp8 engine"] = engine
    try:
        bias_gemm = LtGemm(lib, m, CUDA_R_16F, EPILOGUE_BIAS, CUDA_R_16F, (sw, sx, None), b16)

        def lt_bias() -> Any:
            bias_gemm(w8, x8, scratch16, out16, workspace, torch.cuda.current_stream().cuda_stream)
            return out16

        calls["lt bias"] = lt_bias
    except RuntimeError as exc:
        missing["lt bias"] = str(exc)
    try:
        gelu16 = LtGemm(lib, m, CUDA_R_16F, EPILOGUE_GELU_BIAS, CUDA_R_16F, (sw, sx, None), b16)

        @torch.compile(dynamic=False)
        def cast(y: torch.Tensor) -> torch.Tensor:
            return (y.float() * inv_out).clamp(-448, 448).to(fp8)

        def lt_gelu16() -> Any:
            gelu16(w8, x8, scratch16, out16, workspace, torch.cuda.current_stream().cuda_stream)
            return cast(out16)

        calls["lt gelu fp16 + cast"] = lt_gelu16
    except RuntimeError as exc:
        missing["lt gelu fp16 + cast"] = str(exc)
    for c_type, bias, name in ((CUDA_R_16F, b16, "fp16"), (CUDA_R_16BF, b16.bfloat16(), "bf16")):
        try:
            gelu_gemm = LtGemm(lib, m, CUDA_R_8F_E4M3, EPILOGUE_GELU_BIAS, c_type, (sw, sx, inv_out), bias)
        except RuntimeError as exc:
            missing[f"lt gelu fp8 (C and bias {name})"] = str(exc)
            continue
        c = scratch16 if c_type == CUDA_R_16F else scratch16.view(torch.bfloat16)
        keep = (gelu_gemm, bias, c)

        def lt_gelu(keep: tuple = keep) -> Any:
            keep[0](w8, x8, keep[2], out8, workspace, torch.cuda.current_stream().cuda_stream)
            return out8

        calls["lt gelu fp8"] = lt_gelu
        break
    for name, call in calls.items():
        out = call()
        outputs[name] = out.float() * s_out if out.dtype == fp8 else out.float()
    refs = {name: y_ref if name == "lt bias" else gelu_ref for name in outputs}
    checks = {
        name: {
            "max_abs_err": float((outputs[name] - refs[name]).abs().max()),
            "ref_max_abs": float(refs[name].abs().max()),
            "cosine": float(torch.nn.functional.cosine_similarity(outputs[name].flatten(), refs[name].flatten(), 0)),
        }
        for name in outputs
    }
    return calls, checks, missing


def timed(calls: dict[str, Any], reps: int, rounds: int) -> dict[str, dict[str, float]]:
    """Median ms per call of each form: CUDA graphs of ``reps`` calls, replayed in interleaved rounds."""
    import torch

    graphs = {}
    for name, call in calls.items():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                call()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                call()
        graphs[name] = graph
    times: dict[str, list[float]] = {name: [] for name in graphs}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(rounds):
        for name, graph in graphs.items():
            graph.replay()
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) / reps)
    return {name: {"median_ms": statistics.median(t), "min_ms": min(t), "max_ms": max(t)} for name, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="4096,128", help="GEMM rows (batch x sequence), comma-separated")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--calls", type=int, default=20, help="calls per CUDA graph")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = p.parse_args()
    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        raise SystemExit("skip: needs a CUDA GPU with FP8 (compute capability 8.9 or newer)")
    lib = cublaslt()
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "command": "python benchmarks/cublaslt_fp8_probe.py " + " ".join(f"--{k} {v}" for k, v in vars(args).items()),
        "shape": {"K": K, "N": N},
        "rows": {},
    }
    for m in (int(r) for r in args.rows.split(",")):
        calls, checks, missing = forms(lib, m)
        report["rows"][m] = {"times": timed(calls, args.calls, args.rounds), "checks": checks, "missing": missing}
        print(json.dumps({m: report["rows"][m]}, indent=1), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cublaslt_fp8_probe.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "cublaslt_fp8_probe.md").write_text(markdown(report))
    print(markdown(report))


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "# FP8 GEMM + bias + GELU + FP8 cast in cuBLASLt's epilogue",
        "",
        f"{report['device']}, torch {report['torch']}; `{report['command']}`; K {K}, N {N}; median ms per call "
        "(CUDA graph replay), [min-max] over rounds; answers against FP32 arithmetic on the same FP8 inputs.",
        "",
        "| rows | form | ms per call | spread | max abs error (of max) | cosine |",
        "|---:|---|---:|---|---|---:|",
    ]
    for m, row in report["rows"].items():
        for name, t in row["times"].items():
            c = row["checks"].get(name, {})
            lines.append(
                f"| {m} | {name} | {t['median_ms']:.4f} | {t['min_ms']:.4f}-{t['max_ms']:.4f} | "
                f"{c.get('max_abs_err', float('nan')):.4f} ({c.get('ref_max_abs', float('nan')):.2f}) | "
                f"{c.get('cosine', float('nan')):.6f} |"
            )
        for name, why in row["missing"].items():
            lines.append(f"| {m} | {name} | - | - | not available: {why} | - |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
