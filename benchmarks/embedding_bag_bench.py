"""A padded ``nn.EmbeddingBag`` model on ONNX Runtime CPU: Kiln's export (the bags as a lookup and a mean,
``kiln.stages.export.bags``) against the same export with that rewrite off (the Loop over the bags both exporters
write), beside PyTorch eager, timed interleaved in rounds.

    python benchmarks/embedding_bag_bench.py --out benchmarks/results

The model is a recommender's two towers: a user's history of ``--length`` item ids, padded, averaged by an
``nn.EmbeddingBag(mode="mean", padding_idx=0)``, dotted with an item's ``nn.Embedding`` row (random weights).
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any
from unittest import mock

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_report  # noqa: E402


class TwoTower(nn.Module):
    def __init__(self, items: int = 10_000, dim: int = 64) -> None:
        super().__init__()
        self.history = nn.EmbeddingBag(items, dim, mode="mean", padding_idx=0)
        self.item = nn.Embedding(items, dim)

    def forward(self, history: torch.Tensor, item: torch.Tensor) -> torch.Tensor:
        return (self.history(history) * self.item(item)).sum(-1)


def _feed(batch: int, length: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    history = rng.integers(1, 10_000, (batch, length))
    history[:, length // 2 :] *= rng.random((batch, length - length // 2)) < 0.5  # padded tails
    return {"history": history.astype(np.int64), "item": rng.integers(0, 10_000, batch).astype(np.int64)}


def _export(model: nn.Module, folder: Path, rewrite: bool) -> Any:
    """An ORT CPU session (2 threads) of ``model`` exported by Kiln, with the bag rewrite on or off."""
    from kiln.core.onnx_io import ort_session
    from kiln.stages.export.torch_export import export_onnx

    example = tuple(torch.from_numpy(v) for v in _feed(4, 16, 0).values())
    off = mock.patch("kiln.stages.export.torch_export.bags_as_lookups", lambda m: contextlib.nullcontext(0))
    with off if not rewrite else contextlib.nullcontext():
        graph = export_onnx(model, example, folder / f"{rewrite}.onnx", dynamic_axes={"history": {1: "length"}})
    loops = sum(n.op_type == "Loop" for n in graph.graph.node)
    return ort_session(folder / f"{rewrite}.onnx", threads=2), loops


def _time(fn: Any, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def _row(model: nn.Module, lookup: Any, loop: Any, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    """One batch size: both sessions checked against the model, then every variant timed once a round."""
    feed = _feed(batch, args.length, 1)
    tensors = {k: torch.from_numpy(v) for k, v in feed.items()}
    with torch.no_grad():
        want = model(**tensors).numpy()
        for sess in (lookup, loop):
            np.testing.assert_allclose(sess.run(None, feed)[0], want, atol=1e-5)
        runs = {
            "eager": lambda: model(**tensors),
            "ort_lookup": lambda: lookup.run(None, feed),
            "ort_loop": lambda: loop.run(None, feed),
        }
        times: dict[str, list[float]] = {k: [] for k in runs}
        for fn in runs.values():
            _time(fn, args.calls)  # warm-up
        for _ in range(args.rounds):  # interleaved: each round times every variant once
            for name, fn in runs.items():
                times[name].append(_time(fn, args.calls))
    ratios = [b / a for a, b in zip(times["ort_lookup"], times["ort_loop"])]
    return {
        "batch": batch,
        **{k: {"median_ms": median(v), "min_ms": min(v), "max_ms": max(v)} for k, v in times.items()},
        "loop_over_lookup": {"median": median(ratios), "min": min(ratios), "max": max(ratios)},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--length", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(2)
    model = TwoTower().eval()
    with tempfile.TemporaryDirectory() as tmp:
        (lookup, lookup_loops), (loop, loop_loops) = (_export(model, Path(tmp), r) for r in (True, False))
        rows = [_row(model, lookup, loop, int(b), args) for b in args.batches.split(",")]
    result = {
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, {platform.python_version()}",
        "command": "python benchmarks/embedding_bag_bench.py " + " ".join(sys.argv[1:]),
        "length": args.length,
        "loops_in_graph": {"lookup": lookup_loops, "loop": loop_loops},
        "rows": rows,
    }
    write_report(args.out, "embedding_bag_cpu", result, _markdown(result))


def _markdown(r: dict[str, Any]) -> str:
    def cell(t: dict[str, float]) -> str:
        return f"{t['median_ms']:.3f} ({t['min_ms']:.3f}-{t['max_ms']:.3f})"

    lines = [
        "# Padded nn.EmbeddingBag on ONNX Runtime CPU",
        "",
        f"`{r['command']}` on {r['machine']}; history length {r['length']}; ms per call, median of the rounds' "
        "means (min-max over rounds), rounds interleaved.",
        f"Loop nodes: Kiln's export {r['loops_in_graph']['lookup']}, with the bag rewrite off "
        f"{r['loops_in_graph']['loop']}.",
        "",
        "| batch | PyTorch eager | ORT, Kiln's export (lookup + mean) | ORT, Loop export | Loop / lookup |",
        "|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        ratio = row["loop_over_lookup"]
        lines.append(
            f"| {row['batch']} | {cell(row['eager'])} | {cell(row['ort_lookup'])} | {cell(row['ort_loop'])} | "
            f"{ratio['median']:.1f}x ({ratio['min']:.1f}-{ratio['max']:.1f}) |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
