"""Whether cuDNN's benchmark mode (``torch.backends.cudnn.benchmark``) speeds up Kiln's torch CUDA engines of a model
with convolutions. With the mode on, cuDNN times its algorithms for each convolution at its first call (before the
engine's CUDA graphs are captured) instead of taking its heuristic's pick. Each engine is loaded in fresh
processes, alternately with the mode off and on, and timed at each batch size on device-resident inputs
(``TorchRunner.time_ms``: CUDA events); the table gives the median over rounds of each process's median.

    PYTHONPATH=/tmp/site python3 -P benchmarks/cudnn_benchmark_probe.py --workdir wd-resnet18 --out "$OUT"
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_report  # noqa: E402


def child(engine: Path, mode: str, batches: list[int], iterations: int) -> dict[str, float]:
    """One process: the engine loaded with the mode set, the median ms per batch size."""
    import torch

    from kiln.core.inputs import random_inputs
    from kiln.stages.engines.registry import load_engine

    torch.backends.cudnn.benchmark = mode == "on"
    out = {}
    with load_engine(engine) as runner:
        for batch in batches:
            feed = random_inputs(runner.meta.inputs, batch)
            out[str(batch)] = statistics.median(runner.time_ms(feed, 20, iterations))
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, help="a `kiln run` workdir with torch CUDA engines")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=["off", "on"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    if args.child:
        print(json.dumps(child(args.child, args.mode, batches, args.iterations)))
        return {}
    engines = sorted(p for p in (args.workdir / "build").iterdir() if p.name.startswith("torch-cuda"))
    runs: dict[str, dict[str, list[dict[str, float]]]] = {e.name: {"off": [], "on": []} for e in engines}
    for _ in range(args.rounds):
        for engine in engines:
            for mode in ("off", "on"):
                cmd = [sys.executable, "-P", __file__, "--child", str(engine), "--mode", mode]
                cmd += ["--batches", args.batches, "--iterations", str(args.iterations)]
                done = subprocess.run(cmd, capture_output=True, text=True, check=True)
                runs[engine.name][mode].append(json.loads(done.stdout.strip().splitlines()[-1]))
    lines = ["# cuDNN benchmark mode on Kiln's torch CUDA engines", "", f"`{' '.join(sys.argv)}`", ""]
    lines += ["| engine | batch | off ms (per round) | on ms (per round) | on / off |", "|---|---:|---|---|---:|"]
    for name, modes in runs.items():
        for b in map(str, batches):
            off, on = ([r[b] for r in modes[m]] for m in ("off", "on"))
            ratio = statistics.median(on) / statistics.median(off)
            cells = [" / ".join(f"{x:.3f}" for x in xs) for xs in (off, on)]
            lines.append(f"| {name} | {b} | {cells[0]} | {cells[1]} | {ratio:.3f} |")
    result = {"benchmark": "cudnn_benchmark_probe", "command": " ".join(sys.argv), "runs": runs}
    print("\n".join(lines))
    if args.out:
        write_report(args.out, "cudnn_benchmark_probe", result, "\n".join(lines) + "\n")
    return result


if __name__ == "__main__":
    main()
