"""What the FP8 engine's GELU-and-quantize kernel costs against the memory floor (GPU host).

Between an FP8 engine's two MLP GEMMs Inductor fuses GELU, the input scale and the cast to E4M3 into one pointwise
kernel (the FP16 engine runs its GELU in the GEMM's epilogue instead). This times that kernel, compiled by Inductor
as in the engine, at BERT-base's shape per batch, beside forms of it: the tanh GELU, and the cast alone (the kernel's
memory floor: it reads and writes the same bytes). CUDA-graph replay, median of ``--iterations``.

    PYTHONPATH=/tmp/site python benchmarks/gelu_quant_probe.py --out $OUT/gq
"""

from __future__ import annotations

import argparse
import platform
from pathlib import Path

import torch
from common import write_report

FORMS = {
    "gelu erf + scale + cast": lambda x, s: (torch.nn.functional.gelu(x.float()) * s).clamp(-448, 448),
    "gelu tanh + scale + cast": lambda x, s: (torch.nn.functional.gelu(x.float(), approximate="tanh") * s).clamp(
        -448, 448
    ),
    "scale + cast (floor)": lambda x, s: (x.float() * s).clamp(-448, 448),
}


def timed(fn, x: torch.Tensor, s: torch.Tensor, iterations: int) -> float:
    """Median ms of one call, replayed from a CUDA graph (as the engine runs it)."""
    for _ in range(3):
        fn(x, s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(x, s)
    times = []
    for _ in range(iterations):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rows", default="128,4096", help="token rows (batch x 128): 128 = batch 1, 4096 = batch 32")
    p.add_argument("--width", type=int, default=3072)
    p.add_argument("--iterations", type=int, default=200)
    args = p.parse_args()
    s = torch.tensor(0.5, device="cuda")
    results = []
    for rows in [int(r) for r in args.rows.split(",")]:
        x = torch.randn(rows, args.width, device="cuda", dtype=torch.float16)
        for name, form in FORMS.items():
            fn = torch.compile(lambda a, b, f=form: f(a, b).to(torch.float8_e4m3fn), dynamic=False)
            ms = timed(fn, x, s, args.iterations)
            gbs = rows * args.width * 3 / (ms / 1e3) / 1e9  # 2 bytes read, 1 written per element
            results.append({"rows": rows, "form": name, "median_ms": round(ms, 5), "gb_per_s": round(gbs)})
            print(results[-1], flush=True)
    lines = [
        f"# GELU + FP8 quantize kernel ({torch.cuda.get_device_name()}, torch {torch.__version__})",
        "",
        f"`python benchmarks/gelu_quant_probe.py --rows {args.rows} --width {args.width}` on {platform.node()}",
        "",
        "| rows | form | median ms | GB/s |",
        "|---|---|---|---|",
    ]
    lines += [f"| {r['rows']} | {r['form']} | {r['median_ms']} | {r['gb_per_s']} |" for r in results]
    write_report(args.out, "gelu_quant_probe", {"results": results}, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
