"""Seconds of the build stage when a rerun changes one engine's inputs only: engines kept from the previous build
against every engine built again.

The built-in demo (a CNN on scikit-learn's digits) with FP32 and INT8 variants and two backends, ONNX Runtime and the
torch backend's Inductor engine on the CPU (`build.torch.devices: [cpu]`, where an engine takes tens of seconds to
compile). It is run once into a workdir; then, round by round, the INT8 gate is toggled between the default and a
stricter one (the precision stage drops INT8, then makes it again), so that every run reruns precision and build
while the FP32 engines' inputs stay as they were. Each round runs the build twice, interleaved (a busy machine slows
both alike, in alternating order, so that each sees the INT8 engine made and dropped as often): as `kiln run` does
it (the FP32 engines kept from the previous build) and with `--force build` (every engine built again, as before
per-engine reuse). Medians, spread and a 95% interval of the median (bootstrap over
the rounds), the load average before and after.

    python benchmarks/rebuild_bench.py --rounds 4 --out benchmarks/results
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

CONFIG = """model: {name: cnn}
data: {name: digits}
train: {epochs: 1}
precision: {variants: [fp32, int8]}
build: {backends: [onnxruntime, torch], torch: {devices: [cpu]}}
"""
STRICT = "validate.gates.per_precision.int8.min_cosine=0.999999"


def kiln_run(kiln: str, folder: Path, extra: list[str]) -> dict:
    """One `kiln run --until build` in ``folder``: its wall seconds, the build stage's seconds and which engines it
    kept (from the stage's manifest)."""
    started = time.perf_counter()
    cmd = [kiln, "run", "cfg.yaml", "-w", "out", "-q", "--until", "build", *extra]
    subprocess.run(cmd, cwd=folder, check=True, capture_output=True)
    wall = time.perf_counter() - started
    manifest = json.loads((folder / "out" / "build" / "manifest.json").read_text())
    engines = manifest["summary"]["engines"]
    return {
        "wall_s": wall,
        "build_s": manifest["seconds"],
        "built": sorted(e["name"] for e in engines if not e.get("reused")),
        "kept": sorted(e["name"] for e in engines if e.get("reused")),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args(argv)
    kiln = shutil.which("kiln") or str(Path(sys.executable).parent / "kiln")
    runs: dict[str, list[dict]] = {"kept": [], "force": []}
    with tempfile.TemporaryDirectory(prefix="kiln-rebuild-") as tmp:
        folder = Path(tmp)
        (folder / "cfg.yaml").write_text(CONFIG)
        load_before = os.getloadavg()
        fresh = kiln_run(kiln, folder, [])
        strict = False
        for i in range(args.rounds):
            for name in ("kept", "force") if i % 2 == 0 else ("force", "kept"):  # each sees either gate as often
                strict = not strict  # every run changes the INT8 gate: precision and build rerun
                gate = ["--set", STRICT] if strict else []
                runs[name].append(kiln_run(kiln, folder, gate + (["--force", "build"] if name == "force" else [])))
        load_after = os.getloadavg()
    rows = {}
    for name, xs in runs.items():
        build = [r["build_s"] for r in xs]
        rows[name] = {
            "build_median_s": median(build),
            "build_interval_s": interval(build),
            "build_min_max_s": [min(build), max(build)],
            "wall_median_s": median([r["wall_s"] for r in xs]),
            "runs": xs,
        }
    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "load_average_before_after": [load_before[0], load_after[0]],
        "fresh_run": fresh,
        "rounds": args.rounds,
        "rerun": rows,
        "build_speedup_median": rows["force"]["build_median_s"] / max(rows["kept"]["build_median_s"], 1e-9),
    }
    lines = [
        "# The build stage when a rerun changes the INT8 variant only: engines kept against all built again",
        "",
        f"{result['machine']}; load average {load_before[0]:.2f} before, {load_after[0]:.2f} after; "
        f"{args.rounds} interleaved rounds; the first run's build took {fresh['build_s']:.1f} s.",
        "",
        "| rerun | build stage median | 95% interval | min-max | `kiln run` median | engines built (kept) |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for name, r in rows.items():
        lo, hi = r["build_interval_s"]
        first = r["runs"][0]
        lines.append(
            f"| {'kept (`kiln run`)' if name == 'kept' else '`--force build`'} | {r['build_median_s']:.2f} s | "
            f"{lo:.2f}-{hi:.2f} s | {r['build_min_max_s'][0]:.2f}-{r['build_min_max_s'][1]:.2f} s | "
            f"{r['wall_median_s']:.1f} s | {', '.join(first['built']) or '-'} ({', '.join(first['kept']) or '-'}) |"
        )
    lines += ["", f"Build stage median, all built / kept: {result['build_speedup_median']:.0f}x."]
    write_report(args.out, "rebuild", result, "\n".join(lines) + "\n")
    return result


if __name__ == "__main__":
    main()
