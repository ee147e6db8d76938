"""What a served execution costs outside Triton: the Python-backend stub's path for one batch (join the requests'
arrays, pad to the engine's batch size, ``runner.infer``: a pageable upload, the engine, the download), run by 1, 2
or 8 processes at once on one GPU as 1, 2 or 8 stubs would, beside two cheaper paths: the rows written straight
into a kept page-locked buffer and uploaded from there, and the inputs already on the device (the engine and the
download only). Tells whether a stub's engine call is slower than the same call in one process because of the
stub's copies or because several processes share the GPU, and what a page-locked upload would give back.
"stub" is the stub's path as it was when this probe was written; "pinned" is, by hand, what the stub does since
(``kiln.serve.batching.batched_infer`` into ``Runner.host_inputs``); the recorded results came from this code.

    python benchmarks/stub_path_probe.py --processes 1,2,8 --batches 4,16 --duration 3 [--mps]

Results: ``benchmarks/results/stub_path_probe<label>.{json,md}``. GPU host only.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from common import write_report

MODES = ("stub", "pinned", "device", "copy1", "copy4")


def _worker(
    engine_dir: str, batches: list[int], duration: float, barrier: Any, out: Any, rank: int, modes: list[str]
) -> None:
    """One process: the engine loaded as a stub loads it, then each (mode, batch) run for ``duration`` seconds in
    step with the other processes (a barrier before each), per-call times sent back."""
    import torch

    from kiln import load_engine
    from kiln.serve.batching import batch_buckets, batched_infer, padded_infer

    runner = load_engine(Path(engine_dir)).activate()
    spec = runner.meta.inputs[0]
    shape, dtype = tuple(spec.shape[1:]), np.dtype(spec.dtype)
    buckets = batch_buckets(max(batches))
    rng = np.random.default_rng(rank)
    # single-sample requests as Triton hands them to a stub: views into one shared buffer
    pool = rng.standard_normal((max(batches), *shape)).astype(dtype)
    for b in buckets:  # each padded size compiled and captured before timing, as the stub's warm-up does
        runner.infer({spec.name: np.zeros((b, *shape), dtype)})
    pinned = {b: torch.empty((b, *shape), dtype=torch.from_numpy(pool[:1]).dtype).pin_memory() for b in buckets}
    on_device = {b: torch.from_numpy(pool[:b]).to(runner.device) for b in batches}

    def stub(b: int) -> None:
        batch = np.concatenate([pool[i : i + 1] for i in range(b)])
        padded_infer(runner, {spec.name: batch}, buckets)

    def page_locked(b: int) -> None:
        size = next(s for s in buckets if s >= b)
        buf = pinned[size]
        view = buf.numpy()
        for i in range(b):
            view[i] = pool[i]
        view[b:] = pool[b - 1]
        out = runner._call([buf.to(runner.device, non_blocking=True)])
        [o.cpu().numpy() for o in out]

    def device(b: int) -> None:
        [o.cpu().numpy() for o in runner._call([on_device[b]])]

    def served(threads: int) -> Any:  # the stub's path now: batched_infer, its copies by ``threads`` threads
        def call(b: int) -> None:
            batched_infer(runner, [{spec.name: pool[i : i + 1]} for i in range(b)], buckets, threads=threads)

        return call

    calls = {"stub": stub, "pinned": page_locked, "device": device, "copy1": served(1), "copy4": served(4)}
    for mode in modes:
        for b in batches:
            for _ in range(5):
                calls[mode](b)
            barrier.wait()
            times = []
            end = time.perf_counter() + duration
            while (t0 := time.perf_counter()) < end:
                calls[mode](b)
                times.append(time.perf_counter() - t0)
            out.put((rank, mode, b, times))
    runner.deactivate()


def run_level(
    engine_dir: Path, processes: int, batches: list[int], duration: float, modes: list[str]
) -> list[dict[str, Any]]:
    """``processes`` workers at once; per (mode, batch): samples/s of all together and the per-call spread."""
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(processes), ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(str(engine_dir), batches, duration, barrier, out, r, modes))
        for r in range(processes)
    ]
    for p in procs:
        p.start()
    got: dict[tuple[str, int], list[list[float]]] = {}
    for _ in range(processes * len(modes) * len(batches)):
        _, mode, b, times = out.get(timeout=900)
        got.setdefault((mode, b), []).append(times)
    for p in procs:
        p.join(timeout=60)
    rows = []
    for (mode, b), per_proc in sorted(got.items(), key=lambda kv: (MODES.index(kv[0][0]), kv[0][1])):
        all_ms = np.asarray([t for times in per_proc for t in times]) * 1e3
        p50, p99 = np.percentile(all_ms, [50, 99])
        calls = sum(len(t) for t in per_proc)
        rows.append(
            {
                "processes": processes,
                "mode": mode,
                "batch": b,
                "calls": calls,
                "p50_ms": float(p50),
                "p99_ms": float(p99),
                "samples_per_s": calls * b / duration,
            }
        )
        print(f"{processes} proc, {mode:6s} b{b}: p50 {p50:.3f} ms p99 {p99:.3f} ms, {rows[-1]['samples_per_s']:.0f}/s")
    return rows


def start_mps(folder: Path) -> None:
    """A private CUDA MPS daemon; processes started after this (which inherit the environment) are its clients."""
    os.environ["CUDA_MPS_PIPE_DIRECTORY"] = str(folder / "pipe")
    os.environ["CUDA_MPS_LOG_DIRECTORY"] = str(folder / "log")
    for sub in ("pipe", "log"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    subprocess.run(["nvidia-cuda-mps-control", "-d"], check=True)


def stop_mps() -> None:
    subprocess.run(["nvidia-cuda-mps-control"], input=b"quit\n", check=False)


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "# A stub's engine call, one GPU shared by several processes",
        "",
        f"{report['env']['device']}; `{report['env']['command']}`; MPS {'on' if report['mps'] else 'off'}.",
        "",
        "stub: requests joined, padded, `runner.infer` (pageable upload, engine, download); pinned: rows written "
        "into a kept page-locked buffer, uploaded from it; device: inputs already on the GPU (engine + download); "
        "copyN: the stub's path now (`batched_infer`), a large batch's rows copied by N threads.",
        "",
        "| processes | mode | batch | p50 ms | p99 ms | samples/s (all processes) |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['processes']} | {r['mode']} | {r['batch']} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} "
            f"| {r['samples_per_s']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--processes", default="1,2,8")
    p.add_argument("--batches", default="4,16")
    p.add_argument("--duration", type=float, default=3.0)
    p.add_argument("--mps", action="store_true", help="run the processes as clients of a private CUDA MPS daemon")
    p.add_argument("--modes", default="stub,pinned,device", help=f"of {', '.join(MODES)}")
    p.add_argument("--engine-dir", type=Path, help="an engine folder of the same ResNet-18 (serve_bench.py --work)")
    p.add_argument("--label", default="")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = p.parse_args()
    import torch
    from serve_bench import resnet18_torch_engine

    batches = [int(b) for b in args.batches.split(",")]
    work = Path(tempfile.mkdtemp(prefix="stub-probe-"))
    modes = args.modes.split(",")
    if not set(modes) <= set(MODES):
        p.error(f"--modes takes {', '.join(MODES)}")
    engine_dir = args.engine_dir or resnet18_torch_engine(work, max(batches))
    if args.mps:
        start_mps(work / "mps")
    try:
        rows = [
            r for n in args.processes.split(",") for r in run_level(engine_dir, int(n), batches, args.duration, modes)
        ]
    finally:
        if args.mps:
            stop_mps()
    report = {
        "env": {
            "device": torch.cuda.get_device_name(0),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "command": " ".join(["python", *sys.argv]),
        },
        "mps": args.mps,
        "rows": rows,
        "modes": modes,
    }
    write_report(args.out, f"stub_path_probe{args.label}", report, markdown(report))


if __name__ == "__main__":
    main()
