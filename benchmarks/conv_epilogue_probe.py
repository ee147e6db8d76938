"""Would cuDNN's fused convolution epilogues make a batch-1 ResNet faster than Inductor's kernels? (issue 12)

A probe, not an engine: it answers whether a ``build.torch`` pass is worth writing. On the H200 a Kiln torch engine
of ResNet-18 at batch 1 runs about 40 kernels (20 convolutions, ~18 BatchNorm/ReLU/add kernels, pooling, the
classifier) and takes 0.28-0.34 ms per call, 0.24-0.28 of it kernel time (``benchmarks/results/gpu_session11.md``).
Folding each BatchNorm into its convolution (``torch.fx.experimental.optimization.fuse``) and running
convolution + bias (+ residual) + ReLU as one cuDNN call (``torch.cudnn_convolution_relu`` /
``torch.cudnn_convolution_add_relu``, ATen ops that take cuDNN's fused bias/activation path) would leave about
one kernel per convolution. Whether cuDNN's kernels are as fast as the ones Inductor's autotuner picks is what this
measures.

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
import operator
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import fx, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kiln.stages.engines.onnxruntime_runner import time_calls  # noqa: E402

from benchmarks.engine_bench import kernel_profile  # noqa: E402


@torch.library.custom_op("probe::conv_bias_relu", mutates_args=())
def conv_bias_relu(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, stride: list[int], padding: list[int],
                   dilation: list[int], groups: int) -> torch.Tensor:
    if x.is_cuda:
        return torch.cudnn_convolution_relu(x, w, b, stride, padding, dilation, groups)
    return torch.relu(nn.functional.conv2d(x, w, b, stride, padding, dilation, groups))


@conv_bias_relu.register_fake
def _(x, w, b, stride, padding, dilation, groups):  # noqa: ANN001, ANN202
    return torch.relu(nn.functional.conv2d(x, w, b, stride, padding, dilation, groups))


@torch.library.custom_op("probe::conv_bias_add_relu", mutates_args=())
def conv_bias_add_relu(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, z: torch.Tensor, stride: list[int],
                       padding: list[int], dilation: list[int], groups: int) -> torch.Tensor:
    if x.is_cuda:
        return torch.cudnn_convolution_add_relu(x, w, z, 1.0, b, stride, padding, dilation, groups)
    return torch.relu(nn.functional.conv2d(x, w, b, stride, padding, dilation, groups) + z)


@conv_bias_add_relu.register_fake
def _(x, w, b, z, stride, padding, dilation, groups):  # noqa: ANN001, ANN202
    return torch.relu(nn.functional.conv2d(x, w, b, stride, padding, dilation, groups) + z)


def _is_relu(gm: fx.GraphModule, n: fx.Node) -> bool:
    if n.op == "call_module":
        return isinstance(gm.get_submodule(n.target), nn.ReLU)
    return n.op == "call_function" and n.target in (torch.relu, nn.functional.relu)


def fuse_conv_epilogues(gm: fx.GraphModule) -> dict[str, int]:
    """Conv2d(bias) -> ReLU and Conv2d(bias) -> add -> ReLU, each value read once, as one fused op."""
    counts = {"conv_bias_relu": 0, "conv_bias_add_relu": 0}
    for conv in list(gm.graph.nodes):
        if conv.op != "call_module" or not isinstance(gm.get_submodule(conv.target), nn.Conv2d):
            continue
        mod = gm.get_submodule(conv.target)
        if mod.bias is None or mod.padding_mode != "zeros" or isinstance(mod.padding, str) or len(conv.users) != 1:
            continue
        user = next(iter(conv.users))
        z, relu = None, user
        if user.op == "call_function" and user.target in (operator.add, torch.add) and len(user.users) == 1:
            others = [a for a in user.args if a is not conv]
            if len(others) != 1 or not isinstance(others[0], fx.Node) or len(user.args) != 2:
                continue
            z, relu = others[0], next(iter(user.users))
        if not _is_relu(gm, relu):
            continue
        with gm.graph.inserting_before(relu):
            w = gm.graph.get_attr(f"{conv.target}.weight")
            b = gm.graph.get_attr(f"{conv.target}.bias")
            geo = (list(mod.stride), list(mod.padding), list(mod.dilation), mod.groups)
            if z is None:
                new = gm.graph.call_function(torch.ops.probe.conv_bias_relu, (conv.args[0], w, b, *geo))
            else:
                new = gm.graph.call_function(torch.ops.probe.conv_bias_add_relu, (conv.args[0], w, b, z, *geo))
        relu.replace_all_uses_with(new)
        for dead in (relu, user, conv) if z is not None else (relu, conv):
            gm.graph.erase_node(dead)
        counts["conv_bias_relu" if z is None else "conv_bias_add_relu"] += 1
    gm.graph.lint()
    gm.recompile()
    return counts


def folded(model: nn.Module) -> fx.GraphModule:
    from torch.fx.experimental.optimization import fuse

    return fuse(model, inplace=False)


def graphed(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> Callable[[], torch.Tensor]:
    """``fn(x)`` captured as one CUDA graph (after warm-up calls on a side stream, as torch's docs do)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(x)

    def call() -> torch.Tensor:
        graph.replay()
        return out
    return call


def variants(model32: nn.Module) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """The four variants of the module docstring, from the FP32 model (folded in FP32, then cast to FP16)."""
    def half(m: nn.Module) -> nn.Module:
        return copy.deepcopy(m).half().to(memory_format=torch.channels_last)

    fold = folded(model32)
    fused = folded(model32)
    counts = fuse_conv_epilogues(fused)
    print("fused:", counts, flush=True)
    opts = dict(mode="max-autotune-no-cudagraphs")
    return {"compiled": torch.compile(half(model32), **opts), "folded_compiled": torch.compile(half(fold), **opts),
            "cudnn_eager": half(fused), "cudnn_compiled": torch.compile(half(fused), **opts)}


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
        fused = folded(ref32)
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
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "model": source,
                              "cudnn": torch.backends.cudnn.version(), "rows": []}
    with torch.no_grad():
        fns = variants(ref32)
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
            want = torch.cat([ref32(evalx[i:i + batch]) for i in range(0, 64, batch)])
            for name, call in calls.items():
                got = []
                for i in range(0, 64, batch):
                    x.copy_(evalx[i:i + batch].half())
                    got.append(call().float().clone())
                got_t = torch.cat(got)
                row[name]["max_abs_diff"] = round((got_t - want).abs().max().item(), 4)
                row[name]["top1"] = (got_t.argmax(1) == want.argmax(1)).float().mean().item()
            rounds: dict[str, list[float]] = {n: [] for n in calls}
            for r in range(args.rounds):
                order = list(calls)[r % len(calls):] + list(calls)[:r % len(calls)]
                for name in order:
                    for _ in range(20):
                        calls[name]()
                    rounds[name].append(statistics.median(time_calls(calls[name], args.calls, cuda=True)))
            for name, call in calls.items():
                row[name]["ms"] = round(statistics.median(rounds[name]), 4)
                row[name]["round_ms"] = [round(v, 4) for v in rounds[name]]
                row[name]["kernels"] = kernel_profile(call, 20)
            result["rows"].append(row)
            print(json.dumps({k: (v if not isinstance(v, dict) else {kk: vv for kk, vv in v.items()
                                                                        if kk not in ("kernels", "round_ms")})
                              for k, v in row.items()}), flush=True)
    (args.out / "conv_epilogue_probe.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# cuDNN fused convolution epilogues vs Inductor, ResNet-18 FP16 ({result['device']}, torch "
             f"{result['torch']}, cuDNN {result['cudnn']})", "",
             "| batch | variant | ms (median of round medians) | kernel ms | kernels | max abs diff vs FP32 | top-1 |",
             "|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        for name, v in row.items():
            if name == "batch":
                continue
            if "error" in v:
                lines.append(f"| {row['batch']} | {name} | failed: {v['error']} | | | | |")
                continue
            k = v["kernels"]
            lines.append(f"| {row['batch']} | {name} | {v['ms']:.4f} | {k['kernel_ms']:.4f} | {k['kernels']:.0f} | "
                         f"{v['max_abs_diff']} | {v['top1']:.3f} |")
    (args.out / "conv_epilogue_probe.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
