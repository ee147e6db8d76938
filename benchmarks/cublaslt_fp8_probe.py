"""An FP8 GEMM with its bias, GELU and FP8 output cast in cuBLASLt's epilogue, against the FP8 engine's form.

The FP8 torch engine runs BERT-base's first FFN layer as ``torch._scaled_mm`` (FP8 in, FP16 out, bias in the
epilogue) and then an Inductor kernel for the GELU and the cast of its output to FP8 for the next GEMM; at batch 32
that kernel takes about as long as the GEMM (benchmarks/README.md, "FP8 and INT8 GPU engines"). cuBLASLt can do
both in the GEMM's epilogue (``CUBLASLT_EPILOGUE_GELU_BIAS`` with an E4M3 output and a D scale), which
``torch._scaled_mm`` does not expose. This probe calls cuBLASLt directly (ctypes on the ``libcublasLt`` torch has
loaded, through ``kiln.stages.engines.torch.cublaslt``, which the FP8 engine uses) and times, at BERT-base's FFN
shape (K 768, N 3,072) and each ``--rows``:

- ``fp16``: the FP16 engine's form, ``torch._addmm_activation(..., use_gelu=True)`` (cuBLASLt, GELU epilogue);
- ``fp8 engine``: ``torch._scaled_mm`` + the GELU-and-cast kernel Inductor compiles (torch.compile);
- ``lt bias``: this binding's FP8 GEMM with the bias epilogue and an FP16 output (the first half of the engine's
  form, so the binding is checked against torch's own call of the same library);
- ``lt gelu fp16 + cast``: bias and GELU (cuBLASLt's tanh form) in the epilogue, FP16 out, the cast a kernel;
- ``lt gelu fp8``: the whole block in one cuBLASLt call: bias, GELU and the FP8 output.

Each form is captured in a CUDA graph of ``--calls`` calls and replayed; forms interleaved over ``--rounds``
rounds; medians per call. Answers are checked against FP32 arithmetic on the same FP8 inputs.

    python benchmarks/cublaslt_fp8_probe.py --rows 4096,128 --rounds 30     # on the GPU host
    python benchmarks/cublaslt_fp8_probe.py --rows 4096,128 --rounds 20 --algos 16   # + each GEMM's algorithms

Writes ``benchmarks/results/cublaslt_fp8_probe.{json,md}`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/common.py, also under python -P
from common import graphed, write_report  # noqa: E402

from kiln.stages.engines.torch.cublaslt import (  # noqa: E402
    CUDA_R_8F_E4M3,
    CUDA_R_16BF,
    CUDA_R_16F,
    EPILOGUE_BIAS,
    EPILOGUE_GELU_BIAS,
    LtGemm,
    Unavailable,
)

K, N = 768, 3072


def forms(m: int) -> tuple[dict[str, Any], dict[str, Any], dict[str, str]]:
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
    out16 = torch.empty(m, N, dtype=torch.float16, device="cuda")
    out8 = torch.empty(m, N, dtype=fp8, device="cuda")
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
        bias_gemm = LtGemm(m, N, K, CUDA_R_16F, EPILOGUE_BIAS, CUDA_R_16F)

        def lt_bias() -> Any:
            bias_gemm(x8, w8, sx, sw, b16, None, out16)
            return out16

        calls["lt bias"] = lt_bias
    except Unavailable as exc:
        missing["lt bias"] = str(exc)
    try:
        gelu16 = LtGemm(m, N, K, CUDA_R_16F, EPILOGUE_GELU_BIAS, CUDA_R_16F)

        @torch.compile(dynamic=False)
        def cast(y: torch.Tensor) -> torch.Tensor:
            return (y.float() * inv_out).clamp(-448, 448).to(fp8)

        def lt_gelu16() -> Any:
            gelu16(x8, w8, sx, sw, b16, None, out16)
            return cast(out16)

        calls["lt gelu fp16 + cast"] = lt_gelu16
    except Unavailable as exc:
        missing["lt gelu fp16 + cast"] = str(exc)
    for bias_type, bias, name in ((CUDA_R_16F, b16, "fp16"), (CUDA_R_16BF, b16.bfloat16(), "bf16")):
        try:
            gelu_gemm = LtGemm(m, N, K, CUDA_R_8F_E4M3, EPILOGUE_GELU_BIAS, bias_type)
        except Unavailable as exc:
            missing[f"lt gelu fp8 (bias {name})"] = str(exc)
            continue

        def lt_gelu(g: LtGemm = gelu_gemm, bias: torch.Tensor = bias) -> Any:
            g(x8, w8, sx, sw, bias, inv_out, out8)
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

    graphs = {name: graphed(call, reps) for name, call in calls.items()}
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


# BERT-base's FP8 GEMMs per layer: (name, n, k, epilogue); Q/K/V merged, the first FFN with its GELU and FP8 output
GEMMS = (("qkv", 2304, 768, "bias"), ("attention out", 768, 768, "bias"), ("ffn up", 3072, 768, "gelu fp8"),
         ("ffn down", 768, 3072, "bias"))  # fmt: skip


def _algorithm(g: LtGemm, i: int, x: Any, w: Any, b: Any, scale_d: Any, out: Any, scale: Any) -> Any:
    """One call of ``g`` with its ``i``-th algorithm (unit scales, or none for float16)."""
    g.use(i)
    g(x, w, scale, scale, b, scale_d, out)
    return out


def _torch_form(precision: str, epilogue: str, x: Any, w: Any, bias: Any, one: Any) -> Any:
    """The call each engine makes for the GEMM now: ``torch._scaled_mm`` (FP8) or the FP16 engine's
    ``torch._addmm_activation`` with the GELU / ``torch.addmm``."""
    import torch

    if precision == "fp8":
        return lambda: torch._scaled_mm(
            x, w.t(), scale_a=one, scale_b=one, bias=bias, out_dtype=torch.float16, use_fast_accum=True
        )
    if epilogue == "gelu fp8":
        return lambda: torch._addmm_activation(bias, x, w.t(), use_gelu=True)
    return lambda: torch.addmm(bias, x, w.t())


def algorithms(m: int, most: int, reps: int, rounds: int, precision: str) -> list[dict[str, Any]]:
    """Per GEMM of :data:`GEMMS` at ``m`` rows and ``precision`` (fp8 or fp16): the call the engine makes now and each
    of cuBLASLt's first ``most`` heuristic algorithms for the binding's call, timed side by side: how much a choice
    by measurement (as TensorRT's builder makes) would buy over the heuristic's first."""
    import torch

    fp8, rows = precision == "fp8", []
    one = torch.tensor(1.0, device="cuda")
    in_dtype = torch.float8_e4m3fn if fp8 else torch.float16
    for name, n, k, epilogue in GEMMS:
        x = torch.randn(m, k, device="cuda").to(in_dtype)
        w = (torch.randn(n, k, device="cuda") / 4).to(in_dtype)
        bias = torch.zeros(n, dtype=torch.float16, device="cuda")
        gelu = epilogue == "gelu fp8"
        fused = fp8 and gelu  # FP8 output only from FP8 GEMMs
        out = torch.empty(m, n, dtype=torch.float8_e4m3fn if fused else torch.float16, device="cuda")
        g = LtGemm(m, n, k, CUDA_R_8F_E4M3 if fused else CUDA_R_16F, EPILOGUE_GELU_BIAS if gelu else EPILOGUE_BIAS,
                    CUDA_R_16F, CUDA_R_8F_E4M3 if fp8 else CUDA_R_16F)  # fmt: skip
        found = g.candidates(most)
        engine = "_scaled_mm" if fp8 else ("_addmm_activation" if gelu else "addmm")
        calls = {engine: _torch_form(precision, epilogue, x, w, bias, one)}
        scale = one if fp8 else None
        for i in range(found):
            call = partial(_algorithm, g, i, x, w, bias, one if fused else None, out, scale)
            try:
                call()
                calls[f"algo {i}"] = call
            except Unavailable:
                continue
        try:  # the engine's way
            picked: int | str = g.tune(partial(g, x, w, scale, scale, bias, one if fused else None, out), most=most)
        except Unavailable as exc:
            picked = f"none ({exc})"
        times = timed(calls, reps, rounds)
        ours = sorted((t["median_ms"], c) for c, t in times.items() if c != engine)
        best = ours[0] if ours else (float("nan"), "none")
        rows.append({"precision": precision, "gemm": name, "m": m, "n": n, "k": k,
                     "epilogue": epilogue if fp8 else epilogue.replace("gelu fp8", "gelu"), "candidates": found,
                     "engine_call": engine, "engine_ms": times[engine]["median_ms"],
                     "heuristic_ms": times.get("algo 0", {}).get("median_ms"), "best_ms": best[0], "best": best[1],
                     "tune_pick": f"algo {picked}" if isinstance(picked, int) else picked,
                     "tune_pick_ms": times.get(f"algo {picked}", {}).get("median_ms"),
                     "all_ms": {c: t["median_ms"] for c, t in times.items()},
                     "tflops_best": 2 * m * n * k / best[0] / 1e9})  # fmt: skip
        print(json.dumps({key: v for key, v in rows[-1].items() if key != "all_ms"}), flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="4096,128", help="GEMM rows (batch x sequence), comma-separated")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--calls", type=int, default=20, help="calls per CUDA graph")
    p.add_argument("--algos", type=int, default=0, help="also time up to N cuBLASLt algorithms per BERT-base GEMM")
    p.add_argument("--algo-precisions", default="fp8,fp16", help="the GEMMs --algos times: fp8, fp16 or both")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = p.parse_args()
    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        print("skip: needs a CUDA GPU with FP8 (compute capability 8.9 or newer)", file=sys.stderr)
        return
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "command": "python benchmarks/cublaslt_fp8_probe.py " + " ".join(f"--{k} {v}" for k, v in vars(args).items()),
        "shape": {"K": K, "N": N},
        "rows": {},
    }
    for m in (int(r) for r in args.rows.split(",")):
        calls, checks, missing = forms(m)
        report["rows"][m] = {"times": timed(calls, args.calls, args.rounds), "checks": checks, "missing": missing}
        print(json.dumps({m: report["rows"][m]}, indent=1), flush=True)
    if args.algos:
        rows = [int(r) for r in args.rows.split(",")]
        report["algorithms"] = [
            r
            for p in args.algo_precisions.split(",")
            for m in rows
            for r in algorithms(m, args.algos, args.calls, args.rounds, p)
        ]
    write_report(args.out, "cublaslt_fp8_probe", report, markdown(report))


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
    if report.get("algorithms"):
        lines += [
            "",
            "Each BERT-base GEMM (Q/K/V merged; in FP8 the FFN's first with GELU and FP8 output) as the engine calls "
            "it now and with each of cuBLASLt's first algorithms through the binding, timed side by side:",
            "",
            "| precision | rows | GEMM (n x k) | epilogue | engine's call: ms | heuristic's first ms | "
            "best ms (which) | best / engine's | TFLOP/s at best | `LtGemm.tune`'s pick ms (which) |",
            "|---|---:|---|---|---|---:|---:|---:|---:|---:|",
        ]
        for r in report["algorithms"]:
            first = f"{r['heuristic_ms']:.4f}" if r["heuristic_ms"] is not None else "-"
            lines.append(
                f"| {r['precision']} | {r['m']} | {r['gemm']} ({r['n']} x {r['k']}) | {r['epilogue']} | "
                f"`{r['engine_call']}` {r['engine_ms']:.4f} | {first} | {r['best_ms']:.4f} ({r['best']} of "
                f"{r['candidates']}) | {r['best_ms'] / r['engine_ms']:.2f} | {r['tflops_best']:.0f} | "
                f"{r['tune_pick_ms'] or float('nan'):.4f} ({r['tune_pick']}) |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
