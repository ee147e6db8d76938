"""Would cuDNN's fused convolution epilogues make a batch-1 ResNet faster than Inductor's kernels? (issue 12)

The probe that led to ``build.torch.conv_epilogues``. Before it, on the H200 a Kiln torch engine of ResNet-18 at
batch 1 ran about 40 kernels (20 convolutions, ~18 BatchNorm/ReLU/add kernels, pooling, the classifier) and took
0.28-0.34 ms per call, 0.24-0.28 of it kernel time (``benchmarks/results/gpu_session11.md``). Folding each BatchNorm
into its convolution and running convolution + bias (+ residual) + ReLU as one cuDNN call
(``torch.cudnn_convolution_relu`` / ``torch.cudnn_convolution_add_relu``) leaves about one kernel per convolution;
this measures whether cuDNN's kernels are as fast as the ones Inductor's autotuner picks, variant by variant. The
folding and fusing are Kiln's own (:mod:`kiln.stages.engines.torch.conv_epilogues`) on the torch.export graph. The
results
in ``conv_epilogue_probe_h200_s12.md`` came from this script's first version (commit 809bbb2), which folded with
``torch.fx.experimental.optimization.fuse`` and fused with a copy of the same ATen calls of its own.

Variants (FP16, ``channels_last``, each call one CUDA graph replay; torchvision's ``resnet18``, random weights):

* ``compiled``: ``torch.compile(mode="max-autotune-no-cudagraphs")`` of the model as it is (Kiln's engine, less
  coordinate descent);
* ``folded_compiled``: BatchNorm folded first, then the same compile;
* ``cudnn_eager``: folded, conv+bias(+add)+ReLU as cuDNN's fused calls, the rest eager;
* ``cudnn_compiled``: that, compiled (Inductor compiles around the fused calls, which are custom ops to it).

Timing: CUDA events around each replay from an idle GPU (as ``engine_bench.py``), ``--rounds`` rounds of ``--calls``
calls with the variants alternating; the median of the round medians. Kernels: torch.profiler over 20 replays.
Accuracy: against the FP32 model on the same inputs (max |diff| of the logits, top-1 agreement).

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/conv_epilogue_probe.py --out $OUT          # GPU host
    python benchmarks/conv_epilogue_probe.py --smoke --out /tmp/cep                          # CPU: the rewrite only
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling benchmark scripts
from engine_bench import kernel_profile  # noqa: E402

from kiln.core.cuda_graphs import capture  # noqa: E402
from kiln.core.timing import time_calls  # noqa: E402
from kiln.stages.engines.torch.conv_epilogues import fold_batch_norms, fuse_conv_epilogues  # noqa: E402


def exported(model: nn.Module, x: torch.Tensor) -> fx.GraphModule:
    """The model as torch.export's ATen graph, batch dynamic: what Kiln's torch engine rewrites and compiles."""
    batch = torch.export.Dim("batch", min=1, max=64)
    with torch.inference_mode():
        return torch.export.export(model, (x,), dynamic_shapes=({0: batch},)).module()


def graphed(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> Callable[[], torch.Tensor]:
    """``fn(x)`` captured as one CUDA graph (:func:`kiln.core.cuda_graphs.capture`, as Kiln's torch engine does)."""
    graph, out = capture(lambda: fn(x), x.device, warmups=3)

    def call() -> torch.Tensor:
        graph.replay()
        return out

    return call


def variants(model32: nn.Module, x: torch.Tensor) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """The four variants of the module docstring, from the FP32 model cast to FP16 channels_last; the folding and
    fusing are Kiln's own (:mod:`kiln.stages.engines.torch.conv_epilogues`, which folds in FP32)."""
    half = copy.deepcopy(model32).half().to(memory_format=torch.channels_last)
    fold = exported(half, x)
    fold_batch_norms(fold)
    fold.graph.lint()
    fold.recompile()
    fused = exported(half, x)
    print("fused:", fuse_conv_epilogues(fused), flush=True)
    opts = dict(mode="max-autotune-no-cudagraphs")
    return {
        "compiled": torch.compile(half, **opts),
        "folded_compiled": torch.compile(fold, **opts),
        "cudnn_eager": fused,
        "cudnn_compiled": torch.compile(fused, **opts),
    }


def resnet18() -> tuple[nn.Module, str]:
    """torchvision's ResNet-18 (a model nobody here wrote), or Kiln's own where torchvision is missing (this VM)."""
    try:
        import torchvision
    except ImportError:
        from kiln.models.registry import build_model

        return build_model("resnet18", {}).eval(), "kiln resnet18"
    return torchvision.models.resnet18().eval(), f"torchvision {torchvision.__version__} resnet18"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--smoke", action="store_true", help="CPU: check the rewrite against the model, no timing")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=200)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    ref32, source = resnet18()
    if args.smoke:
        x = torch.randn(2, 3, 64, 64)
        fused = exported(ref32, x)
        counts = fuse_conv_epilogues(fused)
        with torch.no_grad():
            diff = (fused(x) - ref32(x)).abs().max().item()
        print(json.dumps({"model": source, "fused": counts, "max_abs_diff": diff}))
        assert diff < 1e-3 and counts["conv_bias_relu"] + counts["conv_bias_add_relu"] == 17
        return
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    dev = torch.device("cuda")
    ref32 = ref32.to(dev)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "model": source,
        "cudnn": torch.backends.cudnn.version(),
        "rows": [],
    }
    with torch.no_grad():
        example = torch.randn(2, 3, 224, 224, device=dev).half().contiguous(memory_format=torch.channels_last)
        fns = variants(ref32, example)
        for batch in [int(b) for b in args.batches.split(",")]:
            x = torch.randn(batch, 3, 224, 224, device=dev).half().contiguous(memory_format=torch.channels_last)
            calls, row = {}, {"batch": batch}
            for name, fn in fns.items():
                t0 = time.perf_counter()
                try:
                    calls[name] = graphed(fn, x)
                except Exception as exc:  # a probe: report the variant that cannot run, measure the rest
                    row[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
                    continue
                row[name] = {"setup_s": round(time.perf_counter() - t0, 1)}
            evalx = torch.randn(64, 3, 224, 224, device=dev)
            want = torch.cat([ref32(evalx[i : i + batch]) for i in range(0, 64, batch)])
            for name, call in calls.items():
                got = []
                for i in range(0, 64, batch):
                    x.copy_(evalx[i : i + batch].half())
                    got.append(call().float().clone())
                got_t = torch.cat(got)
                row[name]["max_abs_diff"] = round((got_t - want).abs().max().item(), 4)
                row[name]["top1"] = (got_t.argmax(1) == want.argmax(1)).float().mean().item()
            rounds: dict[str, list[float]] = {n: [] for n in calls}
            for r in range(args.rounds):
                order = list(calls)[r % len(calls) :] + list(calls)[: r % len(calls)]
                for name in order:
                    for _ in range(20):
                        calls[name]()
                    rounds[name].append(statistics.median(time_calls(calls[name], args.calls, cuda=True)))
            for name, call in calls.items():
                row[name]["ms"] = round(statistics.median(rounds[name]), 4)
                row[name]["round_ms"] = [round(v, 4) for v in rounds[name]]
                row[name]["kernels"] = kernel_profile(call, 20)
            result["rows"].append(row)
            print(
                json.dumps(
                    {
                        k: (
                            v
                            if not isinstance(v, dict)
                            else {kk: vv for kk, vv in v.items() if kk not in ("kernels", "round_ms")}
                        )
                        for k, v in row.items()
                    }
                ),
                flush=True,
            )
    (args.out / "conv_epilogue_probe.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        f"# cuDNN fused convolution epilogues vs Inductor, ResNet-18 FP16 ({result['device']}, torch "
        f"{result['torch']}, cuDNN {result['cudnn']})",
        "",
        "| batch | variant | ms (median of round medians) | kernel ms | kernels | max abs diff vs FP32 | top-1 |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        for name, v in row.items():
            if name == "batch":
                continue
            if "error" in v:
                lines.append(f"| {row['batch']} | {name} | failed: {v['error']} | | | | |")
                continue
            k = v["kernels"]
            lines.append(
                f"| {row['batch']} | {name} | {v['ms']:.4f} | {k['kernel_ms']:.4f} | {k['kernels']:.0f} | "
                f"{v['max_abs_diff']} | {v['top1']:.3f} |"
            )
    (args.out / "conv_epilogue_probe.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
