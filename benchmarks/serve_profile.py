"""Where a served request's time goes: client, transport (HTTP or gRPC), Triton's queue, the stub hop, the engine.

Starts `kiln serve` on one engine, sends single-sample requests one at a time (no batching: each request's time
is its own), and splits their mean latency with Triton's own statistics (cumulative ns per model):

- engine: the engine's latency at batch 1, timed in this process;
- stub hop: Triton's compute_infer less the engine (Triton -> the Python-backend stub running the engine; with
  ``--pytriton``, stub -> ZeroMQ -> the `kiln serve` process's infer function);
- Triton queue: Triton's queue time; Triton other: its request time less queue and compute;
- client + transport: the client's latency less Triton's request time (serialising, the socket, parsing).

    python benchmarks/serve_profile.py kiln-out --engine onnxruntime-cpu-fp32 --requests 300

Writes benchmarks/results/serve_profile.{json,md} (or -o). For the GPU host: run it there with the CUDA engine.
"""

from __future__ import annotations

import argparse
import json
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from kiln.core.inputs import random_inputs
from kiln.serve.server import free_ports, model_name, wait_ready
from kiln.stages.engines.registry import load_engine

STAGES = ("client + transport", "Triton queue", "Triton other", "stub hop", "engine")


def engine_ms(engine_dir: Path, feed: dict[str, np.ndarray], n: int) -> float:
    with load_engine(engine_dir) as runner:
        runner.infer(feed)
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            runner.infer(feed)
            times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times))


def stats(client: Any, model: str, grpc: bool) -> dict[str, float]:
    raw = client.get_inference_statistics(model, as_json=True) if grpc else client.get_inference_statistics(model)
    s = raw["model_stats"][0]["inference_stats"]
    return {k: float(s[k]["ns"]) for k in ("success", "queue", "compute_input", "compute_infer", "compute_output")}


def profile(protocol: str, port: int, model: str, feed: dict[str, np.ndarray], n: int, eng_ms: float) -> dict:
    """Mean ms per request, split by stage."""
    from tritonclient.utils import np_to_triton_dtype

    grpc = protocol == "grpc"
    if grpc:
        import tritonclient.grpc as module
    else:
        import tritonclient.http as module
    client = module.InferenceServerClient(f"127.0.0.1:{port}")

    def infer() -> None:
        tensors = []
        for name, array in feed.items():
            t = module.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
            t.set_data_from_numpy(array)
            tensors.append(t)
        client.infer(model, tensors)

    for _ in range(10):  # warm the connection and the server
        infer()
    before = stats(client, model, grpc)
    t0 = time.perf_counter()
    for _ in range(n):
        infer()
    total = (time.perf_counter() - t0) * 1e3 / n
    after = stats(client, model, grpc)
    client.close()
    d = {k: (after[k] - before[k]) / n / 1e6 for k in after}  # ms per request
    compute = d["compute_input"] + d["compute_infer"] + d["compute_output"]
    split = {
        "client + transport": total - d["success"],
        "Triton queue": d["queue"],
        "Triton other": d["success"] - d["queue"] - compute + d["compute_input"] + d["compute_output"],
        "stub hop": d["compute_infer"] - eng_ms,
        "engine": eng_ms,
    }
    return {"protocol": protocol, "requests": n, "latency_ms": total, "triton_ms": d, "split_ms": split}


def per_batch(port: int, model: str, feed: dict[str, np.ndarray], concurrency: int, n: int, eng: Any) -> list[dict]:
    """Concurrent single-sample requests over gRPC (``concurrency`` threads, ``n`` requests in all), so Triton's
    dynamic batcher forms batches; then, per batch size it executed, Triton's compute_infer per execution (its own
    ``batch_stats``) against the engine's in-process time at that batch: what the stub hop costs per batch and
    per request. A hop that grows with the batch is paid per request, and batching cannot amortise it."""
    import threading

    import tritonclient.grpc as module
    from tritonclient.utils import np_to_triton_dtype

    def worker(count: int) -> None:
        client = module.InferenceServerClient(f"127.0.0.1:{port}")
        tensors = []
        for name, array in feed.items():
            t = module.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
            t.set_data_from_numpy(array)
            tensors.append(t)
        for _ in range(count):
            client.infer(model, tensors)
        client.close()

    stats_client = module.InferenceServerClient(f"127.0.0.1:{port}")
    before = _batch_stats(stats_client, model)
    threads = [threading.Thread(target=worker, args=(n // concurrency,)) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = _batch_stats(stats_client, model)
    stats_client.close()
    rows = []
    for size, (count, ns) in sorted(after.items()):
        c0, ns0 = before.get(size, (0, 0.0))
        if count - c0 <= 0:
            continue
        infer_ms = (ns - ns0) / (count - c0) / 1e6
        batch_feed = {k: np.repeat(v, size, axis=0) for k, v in feed.items()}
        engine = float(np.median([_timed(eng, batch_feed) for _ in range(20)]))
        hop = infer_ms - engine
        rows.append(
            {
                "batch": size,
                "executions": count - c0,
                "compute_infer_ms": infer_ms,
                "engine_ms": engine,
                "hop_ms": hop,
                "hop_per_request_ms": hop / size,
            }
        )
    return rows


def _batch_stats(client: Any, model: str) -> dict[int, tuple[int, float]]:
    """Triton's executions and compute_infer ns per batch size, so far."""
    raw = client.get_inference_statistics(model, as_json=True)["model_stats"][0].get("batch_stats", [])
    return {
        int(b["batch_size"]): (int(b["compute_infer"]["count"]), float(b["compute_infer"]["ns"]))
        for b in raw
        if "compute_infer" in b
    }


def _timed(runner: Any, feed: dict[str, np.ndarray]) -> float:
    t0 = time.perf_counter()
    runner.infer(feed)
    return (time.perf_counter() - t0) * 1e3


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"# Served request profile: {result['engine']}",
        "",
        f"{result['machine']}; {result['requests']} sequential single-sample requests per protocol.",
        "",
        "| protocol | latency ms | " + " | ".join(STAGES) + " |",
        "|---|---:|" + "---:|" * len(STAGES),
    ]
    for p in result["protocols"]:
        cells = " | ".join(f"{p['split_ms'][s]:.3f} ({p['split_ms'][s] / p['latency_ms']:.0%})" for s in STAGES)
        lines.append(f"| {p['protocol']} | {p['latency_ms']:.3f} | {cells} |")
    if result.get("per_batch"):
        lines += [
            "",
            f"Concurrent: {result['concurrency']} gRPC client threads, {result['concurrent_requests']} single-sample "
            "requests; per batch size Triton's dynamic batcher executed (Triton's batch_stats):",
            "",
            "| batch | executions | compute_infer ms | engine ms (in-process) | stub hop ms | hop per request ms |",
            "|---:|---:|---:|---:|---:|---:|",
        ]
        for r in result["per_batch"]:
            lines.append(
                f"| {r['batch']} | {r['executions']} | {r['compute_infer_ms']:.3f} | {r['engine_ms']:.3f} | "
                f"{r['hop_ms']:.3f} | {r['hop_per_request_ms']:.3f} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workdir", type=Path)
    ap.add_argument("--engine", default="onnxruntime-cpu-fp32")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--concurrency", type=int, default=16, help="client threads of the concurrent part (0: skip it)")
    ap.add_argument("--pytriton", action="store_true", help="kiln serve --pytriton (the engine in its process)")
    ap.add_argument("-o", "--output", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()
    engine_dir = args.workdir / "package" / "engines" / args.engine
    model = model_name(args.engine)
    ports = free_ports(3)
    cmd = [sys.executable, "-m", "kiln.cli", "serve", str(engine_dir), "--max-queue-delay-us", "0"]
    cmd += ["--pytriton"] if args.pytriton else []
    cmd += ["--http-port", str(ports[0]), "--grpc-port", str(ports[1]), "--metrics-port", str(ports[2])]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(f"http://127.0.0.1:{ports[0]}", [model], 300, proc, tuple(ports[1:]))
        with load_engine(engine_dir) as runner:
            feed = random_inputs(runner.meta.inputs, 1, seed=0)
        eng = engine_ms(engine_dir, feed, args.requests)
        protocols = [
            profile(p, port, model, feed, args.requests, eng) for p, port in (("http", ports[0]), ("grpc", ports[1]))
        ]
        batches = []
        if args.concurrency:
            with load_engine(engine_dir) as runner:
                batches = per_batch(ports[1], model, feed, args.concurrency, 4 * args.requests, runner)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    result = {
        "engine": args.engine,
        "machine": f"{platform.node()} ({platform.processor() or platform.machine()})",
        "requests": args.requests,
        "protocols": protocols,
        "concurrency": args.concurrency,
        "concurrent_requests": 4 * args.requests,
        "per_batch": batches,
    }
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "serve_profile.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.output / "serve_profile.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
