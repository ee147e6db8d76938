"""Entropy calibration's threshold search: ONNX Runtime's ``HistogramCollector.get_entropy_threshold`` against
Kiln's vectorised one (:mod:`kiln.calibration.entropy`), on the same histograms at Kiln's 2048 bins, interleaved
round by round; the thresholds must be equal. CPU only.

    python benchmarks/entropy_bench.py --out benchmarks/results/entropy_bench --rounds 5
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np
from onnxruntime.quantization.calibrate import HistogramCollector

from kiln.calibration.entropy import entropy_threshold
from kiln.calibration.ranges import ENTROPY_BINS

SHAPES = {
    "normal": lambda rng: rng.standard_normal(20000),
    "relu": lambda rng: np.maximum(rng.standard_normal(20000), 0),
    "heavy": lambda rng: rng.standard_t(2, 20000),
}


def histogram(shape: str, seed: int) -> tuple[HistogramCollector, tuple]:
    """A histogram as ORT's collector keeps it after two batches (the second wider)."""
    rng = np.random.default_rng(seed)
    collector = HistogramCollector(
        "entropy", True, ENTROPY_BINS["num_bins"], ENTROPY_BINS["num_quantized_bins"], None, None
    )
    with contextlib.redirect_stdout(io.StringIO()):
        collector.collect({"t": [SHAPES[shape](rng).astype(np.float32)]})
        collector.collect({"t": [SHAPES[shape](rng).astype(np.float32) * 1.5]})
    return collector, collector.get_histogram_dict()["t"]


def timed(fn) -> tuple[float, tuple]:  # noqa: ANN001
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    bins = ENTROPY_BINS["num_quantized_bins"]
    times: dict[str, dict[str, list[float]]] = {s: {"ort": [], "kiln": []} for s in SHAPES}
    for r in range(args.rounds):
        for shape in SHAPES:
            collector, hist = histogram(shape, r)
            order = [
                ("ort", lambda c=collector, h=hist: c.get_entropy_threshold(h, bins)),
                ("kiln", lambda h=hist: entropy_threshold(h, bins)),
            ]
            found = {}
            for name, fn in order if r % 2 == 0 else order[::-1]:  # alternate who goes first
                seconds, found[name] = timed(fn)
                times[shape][name].append(seconds)
            assert [float(v) for v in found["ort"]] == [float(v) for v in found["kiln"]], (shape, found)
    rows = []
    for shape, t in times.items():
        ratios = [o / k for o, k in zip(t["ort"], t["kiln"])]
        rows.append(
            {
                "histogram": shape,
                "ort_median_s": statistics.median(t["ort"]),
                "kiln_median_s": statistics.median(t["kiln"]),
                "speedup_median": statistics.median(ratios),
                "speedup_min": min(ratios),
                "speedup_max": max(ratios),
            }
        )
    env = {
        "machine": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "rounds": args.rounds,
        "command": f"python benchmarks/entropy_bench.py --rounds {args.rounds}",
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "entropy_bench.json").write_text(json.dumps({"env": env, "rows": rows}, indent=2) + "\n")
    lines = [
        f"# Entropy threshold search, {ENTROPY_BINS['num_bins']} bins",
        "",
        f"`{env['command']}` on {env['machine']}, Python {env['python']}: {args.rounds} interleaved rounds, "
        "the same thresholds every time (asserted).",
        "",
        "| histogram | ORT median s | Kiln median s | speedup median (min-max) |",
        "|---|---:|---:|---:|",
    ]
    lines += [
        f"| {r['histogram']} | {r['ort_median_s']:.3f} | {r['kiln_median_s']:.4f} | "
        f"{r['speedup_median']:.1f}x ({r['speedup_min']:.1f}-{r['speedup_max']:.1f}) |"
        for r in rows
    ]
    (args.out / "entropy_bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
