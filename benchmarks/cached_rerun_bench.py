"""Seconds of a user project's cached rerun, with and without ``data.skip_unchanged``.

The project is written as a user writes one: its own ``models/`` package (a small text classifier) and a data
function in ``data.py`` that imports torch and makes its tensors, as most data functions do. It is run once into a
workdir; then, in interleaved rounds (so a busy machine slows both alike), `kiln run` again with the config as it is
and with ``data.skip_unchanged: true`` (the same workdir: the key is in no stage's cache key). Every run must say
each stage is cached. Medians, spread and a 95% interval of the median (bootstrap over the rounds), the load average
before and after.

    python benchmarks/cached_rerun_bench.py --rounds 10 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_report  # noqa: E402
from time_to_answer import interval, median  # noqa: E402

MODEL = """import torch
from torch import nn


class TextClassifier(nn.Module):
    def __init__(self, vocab: int, width: int, classes: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.encode = nn.TransformerEncoderLayer(width, 2, 2 * width, batch_first=True)
        self.head = nn.Linear(width, classes)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encode(self.embed(input_ids)).mean(1))


def build(vocab: int = 600, width: int = 32, classes: int = 3) -> nn.Module:
    return TextClassifier(vocab, width, classes)
"""

DATA = """import torch
from kiln import DatasetSplits


def tokens(size: int = 256, length: int = 16) -> DatasetSplits:
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 3, (size,), generator=g)
    x = torch.randint(1, 199, (size, length), generator=g) + 200 * y[:, None]
    s = size * 3 // 4
    return DatasetSplits(x[:s], y[:s], x[s:], y[s:], num_classes=3)
"""

CONFIG = """model: {name: "models.text:build"}
data: {name: "data:tokens", skip_unchanged: %s}
train: {epochs: 1, batch_size: 64}
precision: {variants: [fp32]}
build: {backends: [onnxruntime]}
"""


def write_project(folder: Path) -> None:
    (folder / "models").mkdir(parents=True)
    (folder / "models" / "__init__.py").write_text("")
    (folder / "models" / "text.py").write_text(MODEL)
    (folder / "data.py").write_text(DATA)
    (folder / "off.yaml").write_text(CONFIG % "false")
    (folder / "on.yaml").write_text(CONFIG % "true")


def kiln_run(kiln: str, folder: Path, config: str) -> tuple[float, list[str]]:
    """Seconds of one `kiln run` and each stage's status (from the report it writes)."""
    started = time.perf_counter()
    subprocess.run([kiln, "run", config, "-w", "out", "-q"], cwd=folder, check=True, capture_output=True)
    seconds = time.perf_counter() - started
    report = json.loads((folder / "out" / "report.json").read_text())
    return seconds, [s["status"] for s in report["stages"].values()]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args(argv)
    kiln = shutil.which("kiln") or str(Path(sys.executable).parent / "kiln")
    with tempfile.TemporaryDirectory(prefix="kiln-cached-") as tmp:
        folder = Path(tmp)
        write_project(folder)
        load_before = os.getloadavg()
        fresh, _ = kiln_run(kiln, folder, "off.yaml")
        kiln_run(kiln, folder, "on.yaml")  # keeps what the data function read
        times: dict[str, list[float]] = {"off": [], "on": []}
        for _ in range(args.rounds):
            for name in times:
                seconds, statuses = kiln_run(kiln, folder, f"{name}.yaml")
                if set(statuses) != {"cached"}:
                    raise SystemExit(f"error: a rerun was not all cached: {statuses}")
                times[name].append(seconds)
        load_after = os.getloadavg()
    rows = {
        name: {"median_s": median(xs), "interval_s": interval(xs), "min_s": min(xs), "max_s": max(xs), "runs": xs}
        for name, xs in times.items()
    }
    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "load_average_before_after": [load_before[0], load_after[0]],
        "fresh_run_s": fresh,
        "rounds": args.rounds,
        "cached_rerun": rows,
        "speedup_median": rows["off"]["median_s"] / rows["on"]["median_s"],
    }
    lines = [
        "# A user project's cached rerun, data.skip_unchanged off and on",
        "",
        f"{result['machine']}; load average {load_before[0]:.2f} before, {load_after[0]:.2f} after; "
        f"{args.rounds} interleaved rounds; the fresh run took {fresh:.1f} s.",
        "",
        "| data.skip_unchanged | median | 95% interval | min-max |",
        "|---|---:|---:|---:|",
    ]
    for name, r in rows.items():
        lo, hi = r["interval_s"]
        lines.append(f"| {name} | {r['median_s']:.3f} s | {lo:.3f}-{hi:.3f} s | {r['min_s']:.3f}-{r['max_s']:.3f} s |")
    lines += ["", f"Median off / on: {result['speedup_median']:.2f}x."]
    write_report(args.out, "cached_rerun", result, "\n".join(lines) + "\n")
    return result


if __name__ == "__main__":
    main()
