"""A served ONNX Runtime engine with its thread pools busy-waiting between calls (ORT's default) and blocking
(what `kiln serve` does): the same engine, one fresh `kiln serve` per round, rounds alternated ABAB, each
load-tested with `kiln.serve.loadtest` (single-sample requests from c client threads, every answer checked).

Why: a served stub shares the machine's cores with Triton's threads, the other stubs and, in a load test, the
clients; ORT's intra-op threads spinning after every call take cores they need. ``KILN_ORT_SPINNING=1`` in the
server's environment keeps ORT's default (the "spinning" rounds).

    python benchmarks/ort_spinning_ab.py --demo --concurrency 1,8,32 --rounds 2
    python benchmarks/ort_spinning_ab.py --workdir wd --engine onnxruntime-cpu-fp32 -c kiln.yaml --label bert2

Results: ``benchmarks/results/ort_spinning_<label>.{json,md}``: per level and round, throughput, p50/p99 and the
cores the server used; the medians of each mode side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

from serve_bench import demo_workdir, stop_server  # noqa: E402

from kiln.pipeline.config import KilnConfig, load_config
from kiln.serve.loadtest import loadtest
from kiln.serve.server import free_ports, model_name, wait_ready

RESULTS = Path(__file__).resolve().parent / "results"
MODES = {"blocking": {}, "spinning": {"KILN_ORT_SPINNING": "1"}}
COLUMNS = [
    ("throughput_rps", "{:.0f}"),
    ("p50_ms", "{:.2f}"),
    ("p99_ms", "{:.2f}"),
    ("server_cores", "{:.1f}"),
    ("round_steal", "{:.0%}"),
]


def _cpu_times() -> tuple[int, int]:
    """(steal, total) jiffies of the whole machine since boot (Linux /proc/stat): time a hypervisor gave the
    machine's CPUs to someone else, which slows a round without showing in its load average."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (fields[7] if len(fields) > 7 else 0), sum(fields)


def one_round(
    engine_dir: Path, env: dict[str, str], config: KilnConfig | None, args: argparse.Namespace, out: Path
) -> list[dict[str, Any]]:
    """Start `kiln serve` on the engine with ``env`` added, load-test it at every level, stop it."""
    ports = free_ports(3)
    cmd = [sys.executable, "-m", "kiln.cli", "serve", str(engine_dir), "--http-port", str(ports[0])]
    cmd += ["--grpc-port", str(ports[1]), "--metrics-port", str(ports[2])]
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "serve.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env})
    model = model_name(engine_dir.name)
    url = f"http://127.0.0.1:{ports[0]}"
    try:
        wait_ready(url, [model], 300, proc, tuple(ports[1:]))
        loadtest(url, model, engine_dir, out / "warmup", [max(args.concurrency)], 2.0, config=config, inprocess=False)
        steal0, total0 = _cpu_times()
        result = loadtest(
            url, model, engine_dir, out, args.concurrency, args.duration, config=config, metrics_port=ports[2]
        )
        steal1, total1 = _cpu_times()
    finally:
        stop_server(proc)
    return [
        {
            "concurrency": lv["concurrency"],
            "throughput_rps": lv["throughput_rps"],
            "p50_ms": lv["latency_ms"]["p50"],
            "p99_ms": lv["latency_ms"]["p99"],
            "server_cores": (lv.get("cpu_cores") or {}).get("server"),
            "machine_cores": (lv.get("cpu_cores") or {}).get("busy"),
            "round_steal": (steal1 - steal0) / max(1, total1 - total0),
        }
        for lv in result["levels"]
    ]


def _cells(rows: list[dict[str, Any]], key: str, fmt: str) -> str:
    """Each round's value of ``key``, in round order."""
    return " / ".join(fmt.format(r[key]) if r[key] is not None else "-" for r in rows)


def markdown(report: dict[str, Any]) -> str:
    env = report["env"]
    lines = [
        f"# ORT thread pools in a served engine: blocking vs spinning ({report['engine']})",
        "",
        f"{env['machine']}, {env['cores']} cores, load average {env['load_avg_1m_at_start']:.1f} at start; "
        f"`{env['command']}`",
        "",
        f"Each round a fresh `kiln serve` (blocking: Kiln's default; spinning: `KILN_ORT_SPINNING=1`), rounds "
        f"alternated; HTTP, {report['duration_s']} s per level, every answer checked. Per mode: each round's value, "
        "then the median. CPU stolen: the share of the machine's CPU time its hypervisor gave to others during the "
        "round's load test (a round with much of it was slowed from outside).",
        "",
        "| c | mode | req/s | p50 ms | p99 ms | server cores | CPU stolen | median req/s | median p99 ms |",
        "|---:|---|---|---|---|---|---|---:|---:|",
    ]
    for c in report["concurrency"]:
        for mode in MODES:
            rows = [lv for r in report["rounds"] if r["mode"] == mode for lv in r["levels"] if lv["concurrency"] == c]
            cells = [_cells(rows, key, fmt) for key, fmt in COLUMNS]
            mid = f"{median(r['throughput_rps'] for r in rows):.0f} | {median(r['p99_ms'] for r in rows):.2f}"
            lines.append(f"| {c} | {mode} | {' | '.join(cells)} | {mid} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--demo", action="store_true", help="run the demo pipeline (CPU) and serve its FP32 engine")
    src.add_argument("--workdir", type=Path, help="a `kiln run` workdir")
    p.add_argument("--engine", default="onnxruntime-cpu-fp32", help="an ONNX Runtime engine in the workdir")
    p.add_argument("-c", "--config", type=Path, help="the run's config (its data become the requests)")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--duration", type=float, default=6.0, help="seconds per level")
    p.add_argument("--rounds", type=int, default=2, help="rounds of each mode, alternated")
    p.add_argument("--label", default=None, help="results file suffix (default: demo or the workdir's name)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    scratch = Path(tempfile.mkdtemp(prefix="kiln-spin-"))
    config = load_config(args.config) if args.config else None
    if args.demo:  # the demo's config: its data become the requests
        workdir, config = demo_workdir(scratch)
    else:
        workdir = args.workdir
    load_at_start = os.getloadavg()[0]
    engine_dir = workdir / "package" / "engines" / args.engine
    rounds = []
    for i in range(args.rounds):
        for mode, env in MODES.items():
            print(f"[{time.strftime('%H:%M:%S')}] round {i + 1}: {mode}", file=sys.stderr, flush=True)
            rounds.append(
                {
                    "mode": mode,
                    "round": i + 1,
                    "levels": one_round(engine_dir, env, config, args, scratch / f"{mode}{i}"),
                }
            )
    label = args.label or ("demo" if args.demo else workdir.name)
    report = {
        "engine": args.engine,
        "concurrency": args.concurrency,
        "duration_s": args.duration,
        "rounds": rounds,
        "env": {
            "machine": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "load_avg_1m_at_start": load_at_start,
            "command": "python benchmarks/ort_spinning_ab.py " + " ".join(sys.argv[1:]),
        },
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"ort_spinning_{label}.json").write_text(json.dumps(report, indent=2))
    (args.out / f"ort_spinning_{label}.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
