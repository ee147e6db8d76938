"""Each served request's time by the batch of the execution that answered it, from saved records.

`serve_bench.py --stamped` keeps, per server, every request's joined record (``requests.npy`` in its work folder:
sent, latency, the stub's execution start and end, ns). This prints, per file, the share of requests, executions
and latency p50 / p99 by batch size (1-8, 9-16, larger): whether a latency tail comes from large batches.

    python benchmarks/serve_legs.py run/loadtest0/requests.npy run/loadtest1/requests.npy --labels "a,b"
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kiln.serve.stub_times import by_batch  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("records", nargs="+", type=Path, help="requests.npy files from serve_bench --stamped")
    p.add_argument("--labels", help="comma-separated names of the records (default: their paths)")
    args = p.parse_args()
    labels = args.labels.split(",") if args.labels else [str(r) for r in args.records]
    print("| server | batch | share of requests | executions | p50 ms | p99 ms |")
    print("|---|---|---:|---:|---:|---:|")
    for label, record in zip(labels, args.records):
        for g in by_batch(np.load(record)):
            print(
                f"| {label} | {g['batches']} | {100 * g['requests_share']:.1f} % | {g['executions']} | "
                f"{g['p50_ms']:.2f} | {g['p99_ms']:.2f} |"
            )


if __name__ == "__main__":
    main()
