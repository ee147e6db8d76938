"""What moving a served batch onto the GPU costs the host: ResNet-18's float32 images (602 KB each) assembled from
single-sample requests and copied to the GPU, as a Python-backend stub does before the engine runs (GPU host).

Forms, per batch, timed on the host (``perf_counter`` around the call, synchronized), interleaved round by round:

- ``concat + pageable``: ``np.concatenate`` of the requests, then ``torch.from_numpy(...).to("cuda")`` (what the
  torch engine's runner does today; the driver stages pageable memory through its own pinned buffers);
- ``concat + pin_memory``: the same through ``Tensor.pin_memory()`` (PyTorch's caching host allocator) and a
  non-blocking copy;
- ``concat into pinned``: the requests concatenated straight into a page-locked buffer kept across calls, then a
  non-blocking copy into a device buffer kept across calls (one host copy, no allocation).

    PYTHONPATH=/tmp/site python3 benchmarks/host_copy_probe.py --out $OUT/hostcopy
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from common import write_report

SAMPLE = (3, 224, 224)


def forms(requests: list[np.ndarray]) -> dict[str, Callable[[], None]]:
    """Each form's call for this batch of single-sample requests."""
    batch = len(requests)
    pinned = torch.empty((batch, *SAMPLE), dtype=torch.float32, pin_memory=True)
    device = torch.empty((batch, *SAMPLE), dtype=torch.float32, device="cuda")
    view = pinned.numpy()

    def pageable() -> None:
        torch.from_numpy(np.concatenate(requests)).to("cuda")
        torch.cuda.synchronize()

    def pin_memory() -> None:
        torch.from_numpy(np.concatenate(requests)).pin_memory().to("cuda", non_blocking=True)
        torch.cuda.synchronize()

    def into_pinned() -> None:
        np.concatenate(requests, out=view)
        device.copy_(pinned, non_blocking=True)
        torch.cuda.synchronize()

    return {"concat + pageable": pageable, "concat + pin_memory": pin_memory, "concat into pinned": into_pinned}


def measure(fns: dict[str, Callable[[], None]], rounds: int, calls: int) -> dict[str, list[float]]:
    """Per form, the median ms of ``calls`` calls in each round; the forms take turns within every round."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        for _ in range(5):
            fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            one = []
            for _ in range(calls):
                start = time.perf_counter()
                fn()
                one.append((time.perf_counter() - start) * 1e3)
            times[name].append(statistics.median(one))
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--batches", default="1,4,16,32")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--calls", type=int, default=100)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        requests = [rng.standard_normal((1, *SAMPLE), dtype=np.float32) for _ in range(batch)]
        for name, t in measure(forms(requests), args.rounds, args.calls).items():
            mb = batch * np.prod(SAMPLE) * 4 / 1e6
            med = statistics.median(t)
            rows.append(
                {
                    "batch": batch,
                    "form": name,
                    "median_ms": round(med, 4),
                    "spread_ms": [round(min(t), 4), round(max(t), 4)],
                    "gb_per_s": round(mb / med, 2),
                }
            )
            print(rows[-1], flush=True)
    lines = [
        f"# A served batch onto the GPU, on the host ({torch.cuda.get_device_name()}, torch {torch.__version__})",
        "",
        f"`python benchmarks/host_copy_probe.py --batches {args.batches} --rounds {args.rounds} --calls "
        f"{args.calls}` on {platform.node()}; median of the rounds' medians (min-max of the rounds)",
        "",
        "| batch | form | ms | GB/s |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {r['batch']} | {r['form']} | {r['median_ms']} ({r['spread_ms'][0]}-{r['spread_ms'][1]}) | {r['gb_per_s']} |"
        for r in rows
    ]
    write_report(args.out, "host_copy_probe", {"rows": rows}, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
