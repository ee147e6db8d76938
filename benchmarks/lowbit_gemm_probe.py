"""The GEMMs of the torch engine's low-precision linear layers alone, at a BERT-base's shapes (GPU host): FP16
``F.linear`` against FP8 ``torch._scaled_mm`` with rowwise or tensorwise scales, with and without fast accumulation,
and INT8 ``torch._int_mm``; what each form can give an engine before quantizing activations costs anything.

Per (rows, in, out): the median of ``--rounds`` rounds, each one replay of a CUDA graph of ``--calls`` calls between
CUDA events, the forms interleaved round by round; TFLOP/s beside each.

    PYTHONPATH=/tmp/site python3 benchmarks/lowbit_gemm_probe.py --out $OUT     # GPU host
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
from common import graphed

# BERT-base: Q/K/V/output projections 768x768 (Q, K and V merged: 768x2304), the MLP 768x3072 and 3072x768;
# rows: 128 tokens at batch 1 and 32
SHAPES = [(rows, k, n) for rows in (128, 4096) for k, n in ((768, 768), (768, 2304), (768, 3072), (3072, 768))]


def forms(rows: int, k: int, n: int) -> dict[str, Callable[[], torch.Tensor]]:
    """Each form's call on random operands of this shape (quantized ahead: the GEMM alone is timed)."""
    x = torch.randn(rows, k, device="cuda", dtype=torch.float16)
    w = torch.randn(n, k, device="cuda", dtype=torch.float16)
    b = torch.randn(n, device="cuda", dtype=torch.float16)
    x8, w8 = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    row_a, row_b = torch.ones(rows, 1, device="cuda"), torch.ones(1, n, device="cuda")
    bb = b.to(torch.bfloat16)
    xi, wi = x.clamp(-127, 127).to(torch.int8), w.clamp(-127, 127).to(torch.int8)

    def fp8(sa: torch.Tensor, sb: torch.Tensor, fast: bool) -> Callable[[], torch.Tensor]:
        return lambda: torch._scaled_mm(
            x8, w8.t(), scale_a=sa, scale_b=sb, bias=bb, out_dtype=torch.bfloat16, use_fast_accum=fast
        )

    return {
        "fp16 linear": lambda: torch.nn.functional.linear(x, w, b),
        "fp8 tensorwise fast": fp8(one, one, True),
        "fp8 tensorwise": fp8(one, one, False),
        "fp8 rowwise fast": fp8(row_a, row_b, True),
        "fp8 rowwise": fp8(row_a, row_b, False),
        "int8 _int_mm": lambda: torch._int_mm(xi, wi.t()),
    }


def timed(graph: torch.cuda.CUDAGraph, calls: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=50)
    a = p.parse_args()
    rows_out, lines = (
        [],
        ["| rows | in | out | form | median ms | spread (min-max) ms | TFLOP/s | vs fp16 |", "|" + "---|" * 8],
    )
    for rows, k, n in SHAPES:
        calls = forms(rows, k, n)
        ok = {}
        for name, fn in calls.items():
            try:
                ok[name] = graphed(fn, a.calls)
            except RuntimeError as exc:  # a form this GPU/torch does not run: said, not hidden
                rows_out.append({"rows": rows, "in": k, "out": n, "form": name, "error": str(exc)[:200]})
                lines.append(f"| {rows} | {k} | {n} | {name} | failed: {str(exc)[:60]} | | | |")
        samples: dict[str, list[float]] = {name: [] for name in ok}
        for _ in range(a.rounds):
            for name, fn in ok.items():
                samples[name].append(timed(fn, a.calls))
        base = statistics.median(samples["fp16 linear"])
        for name, ms in samples.items():
            med = statistics.median(ms)
            tflops = 2 * rows * k * n / (med / 1e3) / 1e12
            rows_out.append({"rows": rows, "in": k, "out": n, "form": name, "median_ms": med, "tflops": tflops})
            lines.append(
                f"| {rows} | {k} | {n} | {name} | {med:.4f} | {min(ms):.4f}-{max(ms):.4f} | {tflops:.0f} | "
                f"{base / med:.2f}x |"
            )
    head = f"# Low-precision GEMMs ({torch.cuda.get_device_name()}, torch {torch.__version__})\n\n"
    text = head + "\n".join(lines) + "\n"
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "lowbit_gemm_probe.md").write_text(text)
    (a.out / "lowbit_gemm_probe.json").write_text(json.dumps(rows_out, indent=2))
    print(text)


if __name__ == "__main__":
    main()
