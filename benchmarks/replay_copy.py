"""What a Kiln torch engine's call costs around its CUDA graph (issue 12: ResNet-18 batch 1 at most 0.25 ms).

A call of the torch engine on the GPU (:class:`kiln.stages.engines.torch.build.GraphReplays`) copies its inputs into
the graph's input tensors, replays the graph and clones the outputs. Each call is timed from an idle GPU (CUDA
events, synchronized after the call, as ``engine_bench.py`` times), so the host work before the replay is on the
clock. This script builds the engine once and times, alternating in rounds on the same graph:

* ``engine``: the runner's own call (``TorchRunner.prepared``), what ``engine_bench.py`` reports as ``kiln_torch``;
* ``copy_``: the replay with one ``Tensor.copy_`` per input (what ``GraphReplays.copy_inputs`` does);
* ``foreach``: the replay with one ``torch._foreach_copy_`` of all inputs (the code before);
* ``no_copy``: the replay and output clone with no input copy: the floor for any input copy.

Kernel time (what no host change removes) is in ``engine_bench.py --profile``. Writes <out>/replay_copy.json/.md.

    PYTHONPATH=/tmp/site:$PWD python benchmarks/replay_copy.py --out $OUT        # GPU host
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/common.py
from common import write_report  # noqa: E402
from engine_bench import make_inputs, make_model, model_specs  # noqa: E402

from kiln.core.timing import time_calls  # noqa: E402
from kiln.stages.engines.config import BuildConfig  # noqa: E402
from kiln.stages.engines.registry import load_engine  # noqa: E402
from kiln.stages.engines.stage import build_engine  # noqa: E402
from kiln.stages.engines.torch.config import TorchConfig  # noqa: E402
from kiln.stages.engines.torch.program import GraphReplays, _signature  # noqa: E402
from kiln.stages.export.torch_export import export_onnx  # noqa: E402

MODES = ("engine", "copy_", "foreach", "no_copy")


def build_runner(name: str, work: Path, batch: int) -> Any:
    """Kiln's torch engine of a zoo model (FP16, the default build.torch settings), activated."""
    params, shape = model_specs(False, 12)[name]
    torch.manual_seed(0)
    model = make_model(name, params).eval()
    onnx32 = work / f"{name}.onnx"
    export_onnx(model, torch.randn(2, *shape), onnx32)
    cfg = BuildConfig(backends=["torch"], torch=TorchConfig(devices=["cuda"]))
    folder = work / f"{name}-torch"
    state = model.state_dict()

    def load() -> torch.nn.Module:  # a fresh module per request, as the build stage loads the user's model
        fresh = make_model(name, params).eval()
        fresh.load_state_dict(state)
        return fresh

    build_engine(onnx32, folder, "torch", "cuda", "fp16", cfg, work / "cache", max_batch=batch, torch_model=load)
    return load_engine(folder).activate()


def calls(runner: Any, xs: tuple[torch.Tensor, ...]) -> dict[str, Callable[[], Any]]:
    """One zero-argument call per mode, all on the graph the runner captured for these inputs' shape."""
    engine, graphed = runner.prepared({n: x.numpy() for n, x in zip(runner.input_names, xs)})
    assert graphed, "the engine does not replay CUDA graphs (build.torch.cuda_graphs off?)"
    engine()  # captures the shape's graph
    replays: GraphReplays = runner.package
    args = [x.cuda() for x in xs]
    graph, inputs, outputs = replays.graphs[_signature(tuple(args))]

    def replay(copy: Callable[[], None]) -> Callable[[], Any]:
        def call() -> Any:
            copy()
            graph.replay()
            return [o.clone() for o in outputs]

        return call

    return {
        "engine": engine,
        "copy_": replay(lambda: GraphReplays.copy_inputs(inputs, tuple(args))),
        "foreach": replay(lambda: torch._foreach_copy_(inputs, args)),
        "no_copy": replay(lambda: None),
    }


def measure(fns: dict[str, Callable[[], Any]], rounds: int, iterations: int) -> dict[str, list[float]]:
    """Per mode, the median ms of each round; the modes alternate within every round."""
    got: dict[str, list[float]] = {m: [] for m in fns}
    with torch.inference_mode():  # as the runner calls: the graph's tensors are inference tensors
        for fn in fns.values():
            time_calls(fn, 20)  # warm-up
        for _ in range(rounds):
            for mode, fn in fns.items():
                got[mode].append(statistics.median(time_calls(fn, iterations)))
    return got


def markdown(res: dict[str, Any]) -> str:
    lines = [
        f"# Torch engine call around its CUDA graph ({res['device']})",
        "",
        f"torch {res['torch']}; median ms of {res['iterations']} calls per round, {res['rounds']} rounds, modes "
        "alternating; each call from an idle GPU (CUDA events, synchronized).",
        "",
        "| model | batch | " + " | ".join(MODES) + " | foreach - copy_ | copy_ - no_copy |",
        "|---|---|" + "---|" * (len(MODES) + 2),
    ]
    for r in res["rows"]:
        med = {m: statistics.median(r["rounds"][m]) for m in MODES}
        lines.append(
            f"| {r['model']} | {r['batch']} | "
            + " | ".join(f"{med[m]:.4f}" for m in MODES)
            + f" | {med['foreach'] - med['copy_']:+.4f} | {med['copy_'] - med['no_copy']:+.4f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--models", default="resnet18", help="comma-separated zoo models (resnet18, bert_base)")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--iterations", type=int, default=200)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: replay_copy.py times CUDA graphs and needs a GPU\nfix: run it on the GPU host")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    args.out.mkdir(parents=True, exist_ok=True)
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="replay-copy-") as tmp:
        for name in args.models.split(","):
            runner = build_runner(name, Path(tmp), max(batches))
            _, shape = model_specs(False, 12)[name]
            for batch in batches:
                xs = make_inputs(name, {}, shape, batch, seed=0)
                rows.append(
                    {"model": name, "batch": batch, "rounds": measure(calls(runner, xs), args.rounds, args.iterations)}
                )
    res = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "host": platform.node(),
        "rounds": args.rounds,
        "iterations": args.iterations,
        "rows": rows,
    }
    write_report(args.out, "replay_copy", res, markdown(res))


if __name__ == "__main__":
    main()
