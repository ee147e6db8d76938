"""Training on the CPU three ways, interleaved: one eager process, one process with ``train.compile: true``, and
DDP over ``--nproc`` processes (``train.distributed.nproc_per_node``, torchrun + gloo), each a fresh
``kiln run --until train`` on the same config (the built-in demo by default).

What a user waits for is the run's wall time (the process, start to exit); beside it the train stage's own
seconds (report.json), the last epoch's training samples/s as the loop measures it (every process's samples over
their mean time; validation excluded) and the final validation accuracy, so a faster mode that learns less shows.
Rounds rotate which mode goes first; the table gives medians and the spread (min-max) over rounds, the JSON every
round and the machine's load average before and after each run: a shared machine's load moves every figure.

    python benchmarks/cpu_train_modes.py --rounds 3 --out benchmarks/results
    python benchmarks/cpu_train_modes.py --rounds 1 --epochs 1 --out /tmp/ctm     # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_report  # noqa: E402


def modes(nproc: int) -> dict[str, list[str]]:
    """Each mode's ``--set`` overrides."""
    return {
        "eager, 1 process": [],
        "compile, 1 process": ["train.compile=true"],
        f"DDP, {nproc} processes": [f"train.distributed.nproc_per_node={nproc}"],
    }


def run_once(config: str | None, sets: list[str], epochs: int | None, folder: Path) -> dict[str, Any]:
    """One fresh ``kiln run --until train``: its wall time and what its report says of the train stage."""
    work = folder / "wd"
    shutil.rmtree(work, ignore_errors=True)
    args = [sys.executable, "-m", "kiln.cli", "run", *([config] if config else []), "-w", str(work), "--quiet"]
    args += ["--until", "train"] + [a for s in sets for a in ("--set", s)]
    args += ["--set", f"train.epochs={epochs}"] if epochs else []
    load = os.getloadavg()[0]
    start = time.perf_counter()
    done = subprocess.run(args, capture_output=True, text=True)
    wall = time.perf_counter() - start
    row: dict[str, Any] = {"wall_s": round(wall, 2), "load_before": load, "load_after": os.getloadavg()[0]}
    if done.returncode != 0:
        return row | {"error": done.stderr.strip().splitlines()[-2:]}
    train = json.loads((work / "report.json").read_text())["stages"]["train"]
    last = train["summary"]["epochs"][-1]
    compiled = train["summary"].get("compile") or {}
    return row | {
        "train_s": train["seconds"],
        "samples_per_s": round(last["samples_per_s"], 1),
        "val_accuracy": last["val_accuracy"],
        "compile_s": compiled.get("compile_s"),
    }


def spread(values: list[float]) -> str:
    """``median (min-max)``."""
    if not values:
        return "-"
    med = statistics.median(values)
    return f"{med:.1f} ({min(values):.1f}-{max(values):.1f})" if len(values) > 1 else f"{med:.1f}"


def table(rows: dict[str, list[dict[str, Any]]]) -> str:
    """The Markdown table: one line per mode, medians and spread over rounds."""
    lines = [
        "| mode | wall s | train stage s | samples/s (last epoch) | val accuracy | failed rounds |",
        "|---|---|---|---|---|---|",
    ]
    for mode, runs in rows.items():
        ok = [r for r in runs if "error" not in r]
        acc = [r["val_accuracy"] for r in ok if r.get("val_accuracy") is not None]
        accuracy = f"{min(acc):.3f}-{max(acc):.3f}" if acc else "-"
        cells = [spread([r[k] for r in ok]) for k in ("wall_s", "train_s", "samples_per_s")] if ok else ["-"] * 3
        lines.append(f"| {mode} | {' | '.join(cells)} | {accuracy} | {len(runs) - len(ok)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="a run config (default: the built-in demo)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, help="train.epochs (default: the config's)")
    parser.add_argument("--nproc", type=int, default=2, help="DDP processes")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    each = modes(args.nproc)
    rows: dict[str, list[dict[str, Any]]] = {m: [] for m in each}
    names = list(each)
    with tempfile.TemporaryDirectory(prefix="kiln-ctm-") as tmp:
        for r in range(args.rounds):
            for mode in names[r % len(names) :] + names[: r % len(names)]:
                row = run_once(args.config, each[mode], args.epochs, Path(tmp))
                rows[mode].append(row | {"round": r})
                print(f"round {r} {mode}: {row}", file=sys.stderr)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    command = "python benchmarks/cpu_train_modes.py " + " ".join(sys.argv[1:])
    machine = f"{platform.processor() or platform.machine()}, {cores} cores, {platform.system()}"
    result = {"command": command, "machine": machine, "config": args.config or "built-in demo", "rows": rows}
    markdown = (
        f"# CPU training: eager, compiled, DDP\n\n`{command}` on {machine} (shared with other jobs; load average"
        f" per run in the JSON). `kiln run --until train` from a fresh workdir on {result['config']}; medians"
        f" (min-max) over {args.rounds} interleaved rounds.\n\n{table(rows)}\n"
    )
    write_report(args.out, "cpu_train_modes", result, markdown)


if __name__ == "__main__":
    main()
