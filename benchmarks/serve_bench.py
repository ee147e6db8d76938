"""Throughput and latency of a Kiln engine served by `kiln serve` (Triton + dynamic batcher) against concurrency,
next to the same engine called in-process: the server's overhead.

Served: `kiln serve` in a subprocess, `kiln.serve.loadtest` sending single-sample requests from ``c`` client threads
for ``--duration`` seconds per level (every answer checked against the engine's own output). In-process: the
engine's runner called from this process with a batch of ``c`` samples (perfect batching, no transport: an
upper bound on what serving ``c`` concurrent callers can reach), timed before the server starts so the two
never share the device.

    python benchmarks/serve_bench.py --demo --duration 3                            # CPU: the demo's FP32 engine
    python benchmarks/serve_bench.py --workdir kiln-out --engine onnxruntime-cpu-fp32 # an existing run's engine
    python benchmarks/serve_bench.py --resnet18-fp16 --concurrency 1,2,4,8,16,32,64 --duration 10  # GPU host

``--resnet18-fp16`` builds a ResNet-18 (random weights, 3x224x224) ONNX Runtime CUDA FP16 engine for batches up
to the largest concurrency; ``--resnet18-torch`` its torch FP16 engine on CUDA, compiled flavour with
max-autotune off (the servers compile it at each padded batch size before they say ready; an AOTInductor package
of it crashed its loader on the H200 host). `kiln serve` runs the engine in plain ``tritonserver``'s Python-backend
stubs (``--gpus``, ``--instances-per-gpu N``: N stubs per GPU); ``--pytriton`` serves it from the server's own
process through PyTriton instead. ``--processes 8,14`` and ``--protocol grpc,http`` load-test one server with each
client setting in turn (N client processes); ``--transport net,shm`` also with the tensors in system shared memory
(`kiln loadtest --shared-memory`: the server without the cost of moving tensors through HTTP/gRPC in Python).
Results: ``benchmarks/results/serve_<label>.{json,md}``.

    python benchmarks/serve_bench.py --resnet18-torch --gpus 0 --instances-per-gpu 2 --processes 8 \
        --concurrency 1,16,64 --duration 5                                             # GPU host, issue 34
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kiln.core.inputs import random_inputs  # noqa: E402
from kiln.pipeline.config import KilnConfig, load_config  # noqa: E402
from kiln.serve import stub_times  # noqa: E402
from kiln.serve.loadtest import loadtest, split_table  # noqa: E402
from kiln.serve.server import find_engines, free_ports, wait_ready  # noqa: E402
from kiln.stages.engines.registry import load_engine  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def demo_workdir(work: Path) -> tuple[Path, KilnConfig]:
    from kiln.pipeline.api import run_pipeline

    config = load_config(None, {"build.backends": ["onnxruntime"]})
    result, _ = run_pipeline(config, work / "demo")
    if not result.ok:
        raise SystemExit(f"demo run failed: {result.error}")
    return work / "demo", config


def resnet18_fp16_engine(work: Path, max_batch: int) -> Path:
    import torch

    from kiln.models.registry import build_model
    from kiln.stages.engines.config import BuildConfig
    from kiln.stages.engines.stage import build_engine
    from kiln.stages.export.torch_export import export_onnx

    onnx32 = work / "resnet18.onnx"
    export_onnx(build_model("resnet18", {}).eval(), torch.randn(2, 3, 224, 224), onnx32)
    folder = work / "resnet18-onnxruntime-cuda-fp16"
    meta = build_engine(
        onnx32,
        folder,
        "onnxruntime",
        "cuda",
        "fp16",
        BuildConfig(backends=["onnxruntime"]),
        work / "cache",
        max_batch=max_batch,
    )
    say(f"built {meta.name} in {meta.build_seconds:.1f}s")
    return folder


def resnet18_torch_engine(work: Path, max_batch: int) -> Path:
    """ResNet-18's torch FP16 engine on CUDA, compiled flavour without max-autotune (minutes less at start)."""
    import torch

    from kiln.models.registry import build_model
    from kiln.stages.engines.config import BuildConfig
    from kiln.stages.engines.stage import build_engine
    from kiln.stages.engines.torch.config import TorchConfig
    from kiln.stages.export.torch_export import export_onnx

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return build_model("resnet18", {}).eval()

    folder = work / "resnet18-torch-cuda-fp16"
    if (folder / "kiln-engine.json").is_file():  # built by an earlier run with the same --work
        from kiln.stages.engines.backend import read_metadata

        built = read_metadata(folder).max_batch()
        if built is None or built >= max_batch:
            say(f"engine {folder} built before: reused")
            return folder
        raise SystemExit(f"{folder} was built for batches up to {built}, not {max_batch}: give another --work")
    onnx32 = work / "resnet18.onnx"
    export_onnx(model(), torch.randn(2, 3, 224, 224), onnx32)
    cfg = BuildConfig(backends=["torch"], torch=TorchConfig(devices=["cuda"], flavour="compiled", max_autotune="off"))
    meta = build_engine(
        onnx32, folder, "torch", "cuda", "fp16", cfg, work / "cache", max_batch=max_batch, torch_model=model
    )
    say(f"built {meta.name} in {meta.build_seconds:.1f}s")
    return folder


def in_process(engine_dir: Path, batches: list[int], warmup: int, iterations: int) -> list[dict[str, Any]]:
    rows = []
    with load_engine(engine_dir) as runner:
        for b in batches:
            times = runner.time_ms(random_inputs(runner.meta.inputs, b, seed=b), warmup, iterations)
            p50, p99 = np.percentile(times, [50, 99])
            rows.append({"batch": b, "p50_ms": float(p50), "p99_ms": float(p99), "samples_per_s": b / p50 * 1e3})
            say(f"in-process batch {b}: p50 {p50:.3f} ms, {rows[-1]['samples_per_s']:.0f} samples/s")
    return rows


def served(
    path: Path,
    model: str,
    config: KilnConfig | None,
    args: argparse.Namespace,
    out: Path,
    report: Callable[[str, int, str, dict[str, Any], int], None],
    report_legs: Callable[[dict[str, Any] | None], None],
) -> None:
    """One `kiln serve` of ``model``, load-tested once per (protocol, client processes, transport, client switch
    interval) asked for, in that order, each result handed to ``report`` as it comes (with the switch interval's
    index). The server's start (compiles, warm-up) is paid once. With ``--stamped``, each measured request's legs
    (to the stub, in it, back: :func:`kiln.serve.stub_times.join_stamps`) go to ``report_legs`` once the server has
    stopped and its stubs have written their records."""
    ports = free_ports(3)
    cmd = [
        sys.executable,
        "-P",  # the installed kiln, not this checkout's kiln/ folder (which holds only the CLI and the API)
        "-m",
        "kiln.cli",
        "serve",
        str(path),
        "--http-port",
        str(ports[0]),
        "--grpc-port",
        str(ports[1]),
        "--metrics-port",
        str(ports[2]),
        "--max-queue-delay-us",
        str(args.max_queue_delay_us),
    ]
    if args.gpus is not None:
        cmd += ["--gpus", args.gpus]
    if args.instances_per_gpu is not None:
        cmd += ["--instances-per-gpu", str(args.instances_per_gpu)]
    if args.max_batch is not None:
        cmd += ["--max-batch", str(args.max_batch)]
    if args.http_threads is not None:
        cmd += ["--http-threads", str(args.http_threads)]
    if args.pytriton:
        cmd += ["--pytriton"]
    out.mkdir(parents=True, exist_ok=True)
    clients_on, server_on = args.cpu_split or (None, None)
    publish = args.stub_metrics_s is not None
    env = os.environ | ({"KILN_STUB_METRICS_S": str(args.stub_metrics_s)} if publish else {})
    stamps = out / "stub_stamps"
    if args.stamped:  # the stubs write each stamped request's execution times there as they unload
        shutil.rmtree(stamps, ignore_errors=True)
        env[stub_times.STAMPS_ENV] = str(stamps)
    started = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=open(out / "serve.log", "wb"),
        stderr=subprocess.STDOUT,
        preexec_fn=(lambda: os.sched_setaffinity(0, server_on)) if server_on else None,  # Triton and stubs inherit
    )
    urls = {"grpc": f"grpc://127.0.0.1:{ports[1]}", "http": f"http://127.0.0.1:{ports[0]}"}
    everywhere = os.sched_getaffinity(0)
    try:
        if clients_on:  # the client processes are spawned from this one and inherit its CPUs (this thread's;
            # threads started earlier, such as the in-process timing's, keep theirs)
            os.sched_setaffinity(0, clients_on)
        wait_ready(urls["http"], [model], 300, proc, tuple(ports[1:]))
        args.ready_s = time.monotonic() - started  # `kiln serve` started to every model ready (stubs' warm-up too)
        say(f"server ready in {args.ready_s:.1f} s")
        # One short level first, the way the first measured level sends its requests (protocol, client processes,
        # transport, client): first-call costs (allocations, CUDA graph capture per shape, the server's first reads
        # of shared memory) are not measured.
        warm = [max(args.concurrency)]
        loadtest(
            urls[args.protocol[0]],
            model,
            path,
            out / "warmup",
            warm,
            min(args.duration, 3.0),
            config=config,
            processes=args.processes[0],
            inprocess=False,
            shared_memory=args.transport[0] == "shm",
            metrics_port=ports[2],
            client=args.client[0],
            stamped=args.stamped,
        )
        for protocol in args.protocol:
            for n in args.processes:
                for transport in args.transport:
                    for k, (switch, client) in enumerate(zip(args.client_switch_us, args.client)):
                        say(
                            f"load test: {protocol}, {n} client process(es), tensors {transport}, switch {switch} us, "
                            f"client {client}"
                        )
                        folder = out / f"{protocol}_p{n}_{transport}_{k}"
                        # with the engine's host-to-host time at each level's batch (inputs copied in, outputs out)
                        result = loadtest(
                            urls[protocol],
                            model,
                            path,
                            folder,
                            args.concurrency,
                            args.duration,
                            config=config,
                            processes=n,
                            shared_memory=transport == "shm",
                            metrics_port=ports[2],
                            switch_interval_s=switch * 1e-6 or None,
                            client=client,
                            stamped=args.stamped,
                        )
                        report(protocol, n, transport, result, k)
    finally:
        os.sched_setaffinity(0, everywhere)
        stop_server(proc)
    if args.stamped:
        report_legs(legs(out, stamps))


def zip_longest_last(*lists: list[Any]) -> list[list[Any]]:
    """Per-server settings as lists of one length: each shorter list repeats its last entry."""
    n = max(len(values) for values in lists)
    return [list(values) + list(values[-1:]) * (n - len(values)) for values in lists]


def cpu_split(text: str) -> tuple[set[int], set[int]] | None:
    """``none`` (clients and server anywhere), or ``CLIENTS:SERVER`` as two CPU lists (``0-5:6-15``): the load
    test's processes held to the first, Triton and its stubs to the second, so neither preempts the other."""
    if text == "none":
        return None
    clients, sep, server = text.partition(":")
    if not sep:
        raise ValueError(f"--cpu-split entry '{text}' is not CLIENTS:SERVER (e.g. 0-5:6-15) or none")
    split = cpu_list(clients), cpu_list(server)
    if not all(split) or split[0] & split[1]:
        raise ValueError(f"--cpu-split entry '{text}' needs two lists of CPUs, neither empty, none in both")
    return split


def cpu_list(text: str) -> set[int]:
    """CPUs written as taskset does (``0-5,8``); ValueError for anything else."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        if int(last or first) < int(first):
            raise ValueError(f"CPU range '{part}' runs backwards")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def legs(out: Path, stamps: Path) -> dict[str, Any] | None:
    """The measured levels' requests (not the warm-up's) met with the stubs' records of their executions."""
    client = [np.load(f) for f in sorted(out.glob("*/stamps-c*.npy")) if f.parent.name != "warmup"]
    stub = [np.load(f) for f in sorted(stamps.glob("stub-*.npy"))]
    if not client or not stub:
        return None
    client, stub = np.concatenate(client), np.concatenate(stub)
    rows = stub_times.joined(client, stub)
    np.save(out / "requests.npy", rows)  # per request: sent, latency, started, finished
    found = stub_times.summary(rows, len(client))  # the rows joined once, for the file and the figures
    if found is not None:
        found["by_batch"] = stub_times.by_batch(rows)
    return found


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, as a user stops `kiln serve` (it drains and takes its processes with it); killed after 60 s."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


def markdown(report: dict[str, Any]) -> str:
    s, env = report["served"], report["env"]
    inproc = {r["batch"]: r for r in report["in_process"]}
    lines = [
        f"# Serving {s['engine']} ({s['precision']}) with `kiln serve`",
        "",
        f"{env['device']} (1-minute load average {env['load_avg_1m_at_start']:.1f} at start); `{env['command']}`",
        "",
        f"Served: {_server(report, env)}"
        + (f" (ready {report['ready_s']} s after `kiln serve` started)" if "ready_s" in report else "")
        + " + dynamic batcher (max queue delay "
        f"{report['max_queue_delay_us']} us), {report['protocol']} single-sample requests from c client "
        f"threads in {report.get('client_processes', 1)} process(es) on the same machine"
        + (", tensors in system shared memory" if s.get("transport") == "system shared memory" else "")
        + (", sent by Kiln's HTTP client" if s.get("client") == "kiln" else ", sent by tritonclient")
        + (
            f", their thread switch interval {round(s['client_switch_interval_s'] * 1e6)} us"
            if "client_switch_interval_s" in s
            else ""
        )
        + f", {s['duration_s']} s "
        f"per level, inputs: {s['inputs']}; every answer "
        "checked against the engine's direct output. On device: the engine timed on a batch of c samples already "
        "on its device (no server, no transport, no copies); host to host: the same called from this process with "
        "host arrays in and out (the copies every server pays), batch capped by the server's limit.",
        "",
        "| c | served req/s | p50 ms | p90 ms | p99 ms | wrong | on device: samples/s | served / on device "
        "| host to host: samples/s (batch) | served / host to host |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for lv in s["levels"]:
        c, lat = lv["concurrency"], lv["latency_ms"]
        ip, host = inproc.get(c, {}), lv.get("inprocess")
        ratio = lv["throughput_rps"] / ip["samples_per_s"] if ip else float("nan")
        hosted = "- | -"
        if host:
            hosted = f"{host['throughput_rps']:.0f} ({host['batch']}) | {lv['served_vs_inprocess']:.2f}"
        lines.append(
            f"| {c} | {lv['throughput_rps']:.0f} | {lat['p50']:.2f} | {lat['p90']:.2f} | {lat['p99']:.2f} | "
            f"{lv['mismatches']} | {ip.get('samples_per_s', float('nan')):.0f} | {ratio:.2f} | {hosted} |"
        )
    if s.get("mean_batch"):
        lines += [
            "",
            f"Server statistics: {s['server']['inference_count']} requests in "
            f"{s['server']['execution_count']} engine calls (mean batch {s['mean_batch']:.2f}).",
        ]
    return "\n".join(lines + split_table(s["levels"])) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--demo", action="store_true", help="run the demo pipeline (CPU) and serve its FP32 engine")
    src.add_argument("--workdir", type=Path, help="a `kiln run` workdir (serve its validated engine --engine)")
    src.add_argument("--resnet18-fp16", action="store_true", help="build and serve ResNet-18 ORT CUDA FP16 (GPU)")
    src.add_argument("--resnet18-torch", action="store_true", help="build and serve ResNet-18 torch FP16 (GPU)")
    p.add_argument(
        "--gpus",
        help="kiln serve --gpus (e.g. 0,1; default: GPU 0 for CUDA engines); entries split by '/' (0/0,1) start one "
        "server per entry, zipped with --instances-per-gpu: one GPU against two in one run",
    )
    p.add_argument(
        "--instances-per-gpu",
        help="stub processes per GPU (default: kiln serve's); a list (2,8,2,8) starts one server per entry in turn",
    )
    p.add_argument("--pytriton", action="store_true", help="kiln serve --pytriton: the engine in the server's process")
    p.add_argument(
        "--processes", default="1", help="client processes per concurrency level; a list (8,14) tests each in turn"
    )
    p.add_argument("--engine", default="onnxruntime-cpu-fp32", help="engine name in the workdir")
    p.add_argument(
        "--config",
        help="with --workdir: the run's config, whose validation data are the requests "
        "(default: the demo's, as `kiln loadtest`)",
    )
    p.add_argument("--concurrency", default="1,2,4,8,16,32")
    p.add_argument("--duration", type=float, default=5.0, help="seconds per concurrency level")
    p.add_argument("--protocol", default="grpc", help="grpc, http or both (grpc,http), tested in turn")
    p.add_argument(
        "--transport", default="net", help="net (tensors in the requests), shm (system shared memory) or net,shm"
    )
    p.add_argument("--max-queue-delay-us", type=int, default=100)
    p.add_argument(
        "--client-switch-us",
        default="200",
        help="the client processes' thread switch interval in us (kiln loadtest's 200; 0: Python's 5,000); a list "
        "runs each in turn, repeats allowed (5000,200,5000,200 interleaves an A/B)",
    )
    p.add_argument(
        "--client",
        default="auto",
        help="kiln loadtest --client (auto, kiln, tritonclient); a list alternates like --client-switch-us (the "
        "shorter of the two lists repeats its last entry)",
    )
    p.add_argument(
        "--cpu-split",
        default="none",
        help="CLIENTS:SERVER CPU ranges (0-5:6-15: the load test's processes on CPUs 0-5, Triton and its stubs on "
        "6-15) or none; a list (none,0-5:6-15) starts one server per entry, zipped with --instances-per-gpu",
    )
    p.add_argument(
        "--stub-metrics-s",
        help="the stubs' KILN_STUB_METRICS_S (seconds between publishing their timings to Triton; 3600: none "
        "within a run); a list starts one server per entry, zipped with --instances-per-gpu",
    )
    p.add_argument(
        "--max-batch",
        help="kiln serve --max-batch (largest batch Triton forms; default: kiln serve's); a list starts "
        "one server per entry, zipped with --instances-per-gpu",
    )
    p.add_argument(
        "--http-threads",
        help="kiln serve --http-threads (Triton's HTTP threads); a list starts one server per entry, zipped with "
        "--instances-per-gpu",
    )
    p.add_argument(
        "--stamped",
        action="store_true",
        help="requests carry their send time; the stubs report the wait before their execution and record each "
        "one's execution, met with the client's record after the server stops (serve_<label>_legs_<server>.md)",
    )
    p.add_argument("--iterations", type=int, default=50, help="in-process timed calls per batch")
    p.add_argument("--label", help="results file suffix (default: demo_cpu / resnet18_fp16 / the engine's name)")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument(
        "--work", type=Path, help="folder for the built engine (reused when it holds one; default: a new one)"
    )
    args = p.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.processes = [int(n) for n in args.processes.split(",")]
    args.protocol = args.protocol.split(",")
    if not set(args.protocol) <= {"grpc", "http"}:
        p.error("--protocol takes grpc, http or grpc,http")
    args.transport = args.transport.split(",")
    args.client_switch_us = [int(v) for v in args.client_switch_us.split(",")]
    args.client = args.client.split(",")
    if not set(args.client) <= {"auto", "kiln", "tritonclient"}:
        p.error("--client takes auto, kiln or tritonclient (a comma-separated list)")
    runs = max(len(args.client_switch_us), len(args.client))
    args.client_switch_us += args.client_switch_us[-1:] * (runs - len(args.client_switch_us))
    args.client += args.client[-1:] * (runs - len(args.client))
    if not set(args.transport) <= {"net", "shm"}:
        p.error("--transport takes net, shm or net,shm")
    stubs = [int(n) for n in args.instances_per_gpu.split(",")] if args.instances_per_gpu else [None]
    try:
        splits = [cpu_split(entry) for entry in args.cpu_split.split(",")] if args.cpu_split != "none" else [None]
    except ValueError as exc:
        p.error(str(exc))
    if any(split and not (split[0] | split[1]) <= os.sched_getaffinity(0) for split in splits):
        p.error(f"--cpu-split names CPUs this process cannot use (it has {sorted(os.sched_getaffinity(0))})")
    publish = [float(v) for v in args.stub_metrics_s.split(",")] if args.stub_metrics_s is not None else [None]
    threads = [int(v) for v in args.http_threads.split(",")] if args.http_threads else [None]
    batches = [int(v) for v in args.max_batch.split(",")] if args.max_batch else [None]
    gpu_sets = args.gpus.split("/") if args.gpus else [None]
    stubs, splits, publish, threads, batches, gpu_sets = zip_longest_last(
        stubs, splits, publish, threads, batches, gpu_sets
    )
    servers = len(stubs)
    work = args.work or Path(tempfile.mkdtemp(prefix="serve-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    load_at_start = os.getloadavg()[0]  # this script shares its machine: say how busy it was
    config: KilnConfig | None = None
    if args.demo:
        path, config = demo_workdir(work)
        label = "demo_cpu"
    elif args.workdir:
        path, label = args.workdir, args.engine.replace("-", "_")
        config = load_config(args.config)
    elif args.resnet18_torch:
        path, label = resnet18_torch_engine(work, max(args.concurrency)), "resnet18_torch_fp16"
    else:
        path, label = resnet18_fp16_engine(work, max(args.concurrency)), "resnet18_fp16"
    built = args.resnet18_fp16 or args.resnet18_torch
    engine = next((e for e in find_engines(path) if built or e.meta.name == args.engine), None)
    if engine is None:
        raise SystemExit(f"no validated engine {args.engine} under {path}")
    say(f"engine {engine.meta.name} served as {engine.model_name}")
    inproc = in_process(engine.engine_dir, args.concurrency, warmup=10, iterations=args.iterations)
    from importlib.metadata import version

    import onnxruntime

    env = {
        "device": _device(engine.meta),
        "command": " ".join(["python", *sys.argv]),
        "python": platform.python_version(),
        "pytriton": version("nvidia-pytriton"),
        "onnxruntime": onnxruntime.__version__,
        "load_avg_1m_at_start": load_at_start,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    several = len(args.protocol) * len(args.processes) * len(args.transport) > 1
    switches = len(args.client_switch_us) > 1
    clients = len(set(args.client)) > 1

    def write(protocol: str, processes: int, transport: str, result: dict[str, Any], k: int) -> None:
        n, run = args.instances_per_gpu, args.server_run
        report = {
            "env": env,
            "protocol": protocol,
            "max_queue_delay_us": args.max_queue_delay_us,
            "gpus": args.gpus,
            "instances_per_gpu": n,
            "cpu_split": {"clients": sorted(args.cpu_split[0]), "server": sorted(args.cpu_split[1])}
            if args.cpu_split
            else None,
            "stub_metrics_s": args.stub_metrics_s,
            "http_threads": args.http_threads,
            "ready_s": round(args.ready_s, 1),
            "max_batch": args.max_batch,
            "pytriton": args.pytriton,
            "client_processes": processes,
            "transport": transport,
            "served": result,
            "in_process": inproc,
        }
        tail = f"_{protocol}_p{processes}" + ("_shm" if transport == "shm" else "")
        if switches:
            tail += f"_sw{args.client_switch_us[k]}_{k}"
        if clients:
            tail += f"_{args.client[k]}_{k}"
        tail += "_pinned" if args.cpu_split else ""
        tail += f"_pub{args.stub_metrics_s:g}" if args.stub_metrics_s is not None else ""
        tail += f"_h{args.http_threads}" if args.http_threads is not None else ""
        tail += f"_b{args.max_batch}" if args.max_batch is not None else ""
        tail += f"_g{args.gpus.replace(',', '-')}" if args.gpus is not None and len(set(gpu_sets)) > 1 else ""
        if servers > 1:  # one server per entry of --instances-per-gpu / --cpu-split: its set-up and place in order
            tail += f"_i{n}_{run}" if n is not None else f"_{run}"
        tagged = several or switches or clients or servers > 1 or args.cpu_split
        tagged = tagged or args.stub_metrics_s is not None or args.http_threads is not None
        tagged = tagged or args.max_batch is not None
        name = f"serve_{args.label or label}" + (tail if tagged else "")
        (args.out / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
        (args.out / f"{name}.md").write_text(markdown(report))
        print(markdown(report), flush=True)

    def write_legs(found: dict[str, Any] | None) -> None:
        name = f"serve_{args.label or label}_legs_{args.server_run}"
        lines = [f"# Each request's legs, server {args.server_run + 1} ({args.instances_per_gpu} stubs)", ""]
        lines += [f"`{env['command']}`; {env['device']}", ""]
        if found:
            lines += [
                f"{found['met']} of {found['requests']} measured requests met with their stub's record; the slowest "
                f"{found['slowest']} by latency (mean {found['latency']['slowest_mean']:.2f} ms, p50 of all "
                f"{found['latency']['p50']:.2f} ms).",
                "",
                "| leg | p50 ms | p99 ms | mean ms in the slowest |",
                "|---|---:|---:|---:|",
            ]
            lines += [
                f"| {leg} | {found[leg]['p50']:.2f} | {found[leg]['p99']:.2f} | {found[leg]['slowest_mean']:.2f} |"
                for leg in stub_times.LEGS
            ]
            lines += ["", "By the batch of the execution that answered them:", ""]
            lines += ["| batch | share of requests | executions | p50 ms | p99 ms |", "|---|---:|---:|---:|---:|"]
            lines += [
                f"| {g['batches']} | {100 * g['requests_share']:.1f} % | {g['executions']} | {g['p50_ms']:.2f} | "
                f"{g['p99_ms']:.2f} |"
                for g in found.get("by_batch", [])
            ]
        else:
            lines.append("no request met with a stub's record")
        (args.out / f"{name}.json").write_text(json.dumps({"env": env, "legs": found}, indent=2) + "\n")
        (args.out / f"{name}.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines), flush=True)

    for run, (n, split, every, http, batch, gpus) in enumerate(zip(stubs, splits, publish, threads, batches, gpu_sets)):
        args.instances_per_gpu, args.server_run, args.cpu_split, args.stub_metrics_s = n, run, split, every
        args.http_threads, args.max_batch, args.gpus = http, batch, gpus
        if servers > 1:
            where = f", clients on CPUs {_cpus(split[0])}, server on {_cpus(split[1])}" if split else ""
            where += f", stub timings published every {every:g} s" if every is not None else ""
            where += f", {http} HTTP threads" if http is not None else ""
            where += f", batches up to {batch}" if batch is not None else ""
            where += f", GPU(s) {gpus}" if gpus is not None else ""
            say(f"server {run + 1} of {servers}: {n} instance(s) per GPU{where}")
        served(path, engine.model_name, config, args, work / f"loadtest{run}", write, write_legs)


def _cpus(cpus: set[int]) -> str:
    """A CPU set as a range where it is one (6-15), else listed."""
    return f"{min(cpus)}-{max(cpus)}" if len(cpus) == max(cpus) - min(cpus) + 1 else ",".join(map(str, sorted(cpus)))


def _server(report: dict[str, Any], env: dict[str, Any]) -> str:
    if report.get("pytriton"):
        return f"Triton through PyTriton {env.get('pytriton')} (the engine in the `kiln serve` process)"
    where = f"on GPU(s) {report['gpus']}" if report.get("gpus") is not None else "(kiln serve's default placement)"
    count = report.get("instances_per_gpu") or "kiln serve's default number of"
    split = report.get("cpu_split")
    pinned = ""
    if split:
        pinned = f"; server on CPUs {_cpus(set(split['server']))}, clients on {_cpus(set(split['clients']))}"
    if report.get("stub_metrics_s") is not None:
        pinned += f"; the stubs publish their timings every {report['stub_metrics_s']:g} s"
    if report.get("max_batch") is not None:
        pinned += f"; batches up to {report['max_batch']}"
    if report.get("http_threads") is not None:
        pinned += f"; {report['http_threads']} HTTP threads"
    return f"plain tritonserver, Python backend {where} with {count} instance(s) (the engine in Triton's stubs){pinned}"


def _device(meta: dict[str, Any]) -> str:
    if meta.device == "cuda":
        import torch

        return torch.cuda.get_device_name(0)
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


if __name__ == "__main__":
    main()
