"""What checking the cache by content costs: a fully cached `kiln run` on a workdir holding a BERT-base-sized
artifact, with content checks (sha256 of every output, once per run) and with the old size-only check.

The workdir is a real tiny pipeline run (the test config, one epoch) plus one extra file of ``--mb`` MB (418 MB
is BERT-base's FP32 weights) recorded in the build stage's manifest as if the stage had written it, so every
stage is `cached` and the difference between the two timings is the hashing. Size-only is timed by standing
in the recorded hashes for the computed ones (what `outputs_intact` did before issue 14).

    python benchmarks/cache_check_bench.py --out benchmarks/results            # 418 MB, 3 reruns each
    python benchmarks/cache_check_bench.py --mb 8 --repeats 1 --out /tmp/b     # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from kiln.core.artifacts import hash_file  # noqa: E402
from kiln.pipeline import runner as runner_module  # noqa: E402
from kiln.pipeline.api import run_pipeline  # noqa: E402
from kiln.pipeline.config import config_from_dict  # noqa: E402


def add_artifact(workdir: Path, mb: int) -> Path:
    """A BERT-sized weights file in build/, recorded in its manifest (hash and size) as the stage's own."""
    path = workdir / "build" / "weights.bin"
    block = os.urandom(1 << 20)
    with open(path, "wb") as f:
        for _ in range(mb):
            f.write(block)
    manifest_path = workdir / "build" / "manifest.json"
    m = json.loads(manifest_path.read_text())
    m["outputs"]["weights.bin"], m["sizes"]["weights.bin"] = hash_file(path), path.stat().st_size
    manifest_path.write_text(json.dumps(m))
    return path


def cached_run_seconds(cfg, workdir: Path, content: bool) -> float:
    real = runner_module.hash_tree
    if not content:  # size-only: trust the manifest's hashes, as the old check did
        runner_module.hash_tree = lambda root, exclude=(): runner_module.read_manifest(Path(root))["outputs"]
    try:
        t0 = time.perf_counter()
        result, _ = run_pipeline(cfg, workdir)
        seconds = time.perf_counter() - t0
    finally:
        runner_module.hash_tree = real
    assert {r.status for r in result.records} == {"cached"}, [(r.name, r.status) for r in result.records]
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=418, help="size of the extra artifact (418: BERT-base FP32)")
    ap.add_argument("--repeats", type=int, default=3, help="cached reruns timed per mode (median reported)")
    ap.add_argument("--out", type=Path, required=True, help="folder for cache_check.json / .md")
    args = ap.parse_args()
    cfg = config_from_dict(
        {
            "name": "tiny",
            "model": {"name": "cnn", "params": {"width": 8, "depth": 2}},
            "train": {"epochs": 1, "batch_size": 128},
            "signature": {"batch_sizes": [1, 8]},
            "validate": {"warmup": 1, "iterations": 3, "max_samples": 128},
            "build": {"backends": ["onnxruntime"]},
        }
    )
    with tempfile.TemporaryDirectory(prefix="kiln-cache-bench-") as tmp:
        workdir = Path(tmp)
        run_pipeline(cfg, workdir)
        add_artifact(workdir, args.mb)
        run_pipeline(cfg, workdir)  # build's outputs changed: validate and package take that in once
        total = sum(p.stat().st_size for p in workdir.rglob("*") if p.is_file())
        times = {mode: [] for mode in ("content", "size_only")}
        for _ in range(args.repeats):
            for mode in times:
                times[mode].append(cached_run_seconds(cfg, workdir, mode == "content"))
    med = {mode: statistics.median(t) for mode, t in times.items()}
    res = {
        "artifact_mb": args.mb,
        "workdir_mb": round(total / 2**20, 1),
        "repeats": args.repeats,
        "seconds": times,
        "median_seconds": med,
        "content_check_cost_s": med["content"] - med["size_only"],
        "hash_mb_per_s": round(total / 2**20 / max(med["content"] - med["size_only"], 1e-9), 1),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} (load avg "
        f"{os.getloadavg()[0]:.1f} at the end)",
        "python": platform.python_version(),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    name = "cache_check" if args.mb >= 400 else f"cache_check-{args.mb}mb"
    (args.out / f"{name}.json").write_text(json.dumps(res, indent=2) + "\n")
    (args.out / f"{name}.md").write_text(
        f"# Cached rerun: content check vs size-only\n\nWorkdir {res['workdir_mb']} MB (tiny pipeline + a "
        f"{args.mb} MB artifact), {args.repeats} cached `kiln run`s per mode, median; {res['machine']}.\n\n"
        "| check | cached rerun s |\n|---|---|\n"
        f"| size only (before) | {med['size_only']:.2f} |\n| sha256 of every output, once per run | "
        f"{med['content']:.2f} |\n\nContent checking costs {res['content_check_cost_s']:.2f} s "
        f"(~{res['hash_mb_per_s']} MB/s of hashing).\n"
    )
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
