"""Where an FP8 engine's GELU can go: BERT-base's MLP block (Linear 768->3072, GELU, Linear 3072->768) as the FP8
engine runs it (Kiln's ``LowbitLinear``, static scales), compiled by Inductor under several GEMM settings, beside
the FP16 engine's form (GELU in cuBLASLt's epilogue, ``torch._addmm_activation``). GPU host.

The FP8 engine's GEMMs are ``torch._scaled_mm`` (cuBLASLt), whose epilogue takes a bias but not GELU or the
next layer's FP8 cast, so Inductor runs GELU + scale + cast as a kernel of its own. Under ``max_autotune_gemm``
Inductor can instead choose its Triton FP8 GEMM template and fuse that pointwise tail into the template's epilogue.
This measures whether it does (the kernels of one call: ``triton_tem`` are template GEMMs, ``triton_poi`` pointwise
kernels, the rest cuBLAS) and what it is worth, per form: compile seconds and the median ms of one call replayed
from a CUDA graph, the forms interleaved round by round.

    PYTHONPATH=/tmp/site python3 benchmarks/fp8_epilogue_probe.py --out $OUT/fp8ep
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import graphed, write_report
from torch import nn

from kiln.stages.engines.torch.lowbit import LowbitLinear

HIDDEN, INNER = 768, 3072
GEMM_TRITON = {"max_autotune_gemm": True, "max_autotune_gemm_backends": "TRITON"}
GEMM_BOTH = {"max_autotune_gemm": True, "max_autotune_gemm_backends": "ATEN,TRITON"}


class MLP(nn.Module):
    """BERT's feed-forward block, in FP16 (``fused``: GELU in the first GEMM's epilogue, as Kiln's FP16 engine)."""

    def __init__(self, fused: bool = False) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fused = nn.Linear(HIDDEN, INNER), nn.Linear(INNER, HIDDEN), fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            h = torch._addmm_activation(self.fc1.bias, x, self.fc1.weight.t(), use_gelu=True)
        else:
            h = nn.functional.gelu(self.fc1(x))
        return self.fc2(h)


def fp8_mlp(mlp: MLP, x: torch.Tensor) -> nn.Module:
    """``mlp`` with both layers as the FP8 engine's static-scale layers, scales from ``x`` passed through it."""
    amax: dict[str, float] = {}
    hooks = [
        getattr(mlp, n).register_forward_pre_hook(lambda m, a, n=n: amax.__setitem__(n, a[0].abs().max().item()))
        for n in ("fc1", "fc2")
    ]
    with torch.no_grad():
        mlp(x)
    for h in hooks:
        h.remove()
    out = MLP()
    for n in ("fc1", "fc2"):
        setattr(out, n, LowbitLinear(getattr(mlp, n), "fp8", torch.float16, "static", amax[n]))
    return out


def forms(mlp: MLP, x: torch.Tensor) -> dict[str, tuple[nn.Module, dict[str, Any]]]:
    """Each form's module and the Inductor settings it is compiled under."""
    fused = MLP(fused=True).to(x.device, x.dtype)
    fused.load_state_dict(mlp.state_dict())
    eight = fp8_mlp(mlp, x)
    return {
        "fp16 gelu in cuBLASLt epilogue (FP16 engine)": (fused, {}),
        "fp8 default (FP8 engine)": (eight, {}),
        "fp8 gemm autotune ATEN,TRITON": (eight, GEMM_BOTH),
        "fp8 gemm autotune TRITON": (eight, GEMM_TRITON),
        "fp16 gemm autotune TRITON": (mlp, GEMM_TRITON),
    }


def compiled(module: nn.Module, options: dict[str, Any], x: torch.Tensor) -> tuple[Callable[[], Any], float]:
    """``module`` compiled for ``x`` under ``options`` (frozen, as Kiln's engines); the call and compile seconds."""
    torch._dynamo.reset()
    options = {"freezing": True, **options}
    fn = torch.compile(module, options=options, dynamic=False)
    start = time.perf_counter()
    with torch.inference_mode(), torch._inductor.config.patch(options):
        fn(x)
    torch.cuda.synchronize()
    return (lambda: fn(x)), time.perf_counter() - start


def kernels(call: Callable[[], Any]) -> list[tuple[str, float]]:
    """The GPU kernels of one call: (name, microseconds)."""
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode():
        call()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
    return [(e.name, e.device_time) for e in prof.events() if e.device_type.name == "CUDA"]


def kind(name: str) -> str:
    """A kernel's kind from its name: Inductor's Triton GEMM templates, its other kernels, or a library's."""
    if name.startswith("triton_tem"):
        return "template"
    if name.startswith("triton"):
        return "pointwise"
    return "library"


def interleaved(graphs: dict[str, torch.cuda.CUDAGraph], calls: int, rounds: int) -> dict[str, list[float]]:
    """Per form, ms of one call in each round; every round replays each form once, in turn."""
    times: dict[str, list[float]] = {k: [] for k in graphs}
    for _ in range(rounds):
        for name, graph in graphs.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) / calls)
    return times


def probe(rows: int, calls: int, rounds: int) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    x = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.float16)
    mlp = MLP().to("cuda", torch.float16).eval()
    reference = mlp(x).float()
    graphs, results = {}, []
    for name, (module, options) in forms(mlp, x).items():
        call, seconds = compiled(module.eval(), options, x)
        with torch.inference_mode():
            cos = torch.nn.functional.cosine_similarity(call().float().flatten(), reference.flatten(), dim=0)
        ks = kernels(call)
        kinds = {k: sum(1 for n, _ in ks if kind(n) == k) for k in ("library", "template", "pointwise")}
        with torch.inference_mode():  # as the engine runs
            graphs[name] = graphed(call, calls)
        results.append(
            {
                "rows": rows,
                "form": name,
                "compile_s": round(seconds, 1),
                "cosine_to_fp16": round(float(cos), 5),
                "kernels": kinds,
                "kernel_names": [f"{n[:60]} {us:.1f}us" for n, us in ks],
            }
        )
        print(results[-1], flush=True)
    times = interleaved(graphs, calls, rounds)
    flops = 2 * rows * HIDDEN * INNER * 2
    for r in results:
        t = times[r["form"]]
        r["median_ms"] = round(statistics.median(t), 5)
        r["spread_ms"] = [round(min(t), 5), round(max(t), 5)]
        r["tflops"] = round(flops / (r["median_ms"] / 1e3) / 1e12)
        print(r["rows"], r["form"], r["median_ms"], r["spread_ms"], r["tflops"], flush=True)
    return results


def report(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [
        f"# FP8 MLP block: where the GELU goes ({torch.cuda.get_device_name()}, torch {torch.__version__})",
        "",
        f"`python benchmarks/fp8_epilogue_probe.py --rows {args.rows} --calls {args.calls} --rounds {args.rounds}` "
        f"on {platform.node()}",
        "",
        "| rows | form | compile s | median ms (min-max) | TFLOP/s | kernels: library / template / pointwise | "
        "cosine to FP16 |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        k = r["kernels"]
        lines.append(
            f"| {r['rows']} | {r['form']} | {r['compile_s']} | {r['median_ms']} ({r['spread_ms'][0]}-"
            f"{r['spread_ms'][1]}) | {r['tflops']} | {k['library']} / {k['template']} / {k['pointwise']} | "
            f"{r['cosine_to_fp16']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rows", default="4096,128", help="token rows (batch x 128): 4096 = batch 32, 128 = batch 1")
    p.add_argument("--calls", type=int, default=20, help="calls per CUDA graph")
    p.add_argument("--rounds", type=int, default=50)
    args = p.parse_args()
    results = []
    for rows in [int(r) for r in args.rows.split(",")]:
        results += probe(rows, args.calls, args.rounds)
        write_report(args.out, "fp8_epilogue_probe", {"results": results}, report(results, args))


if __name__ == "__main__":
    main()
