"""Which part of Kiln's training loop makes it slower than the bare loop? (issue 16, the explicit-attention cell)

``train_bench.py --compile`` measures Kiln compiled against a bare compiled loop in interleaved windows
(:func:`train_bench.interleaved`). This script runs that same comparison several times per *variant*, each variant
swapping one part of Kiln's loop for the bare loop's own code, so a part that causes the gap shows as a variant
whose ratio moves to ~1.0:

* ``kiln``: Kiln's loop as it ships;
* ``nograph``: the per-step check (:class:`~kiln.stages.train.health.StepCheck`) runs its kernels one by one instead
  of replaying its CUDA graph (what session 5's code did, when this cell measured 0.998 / 1.029);
* ``nograph+oldstats``: as ``nograph``, and the read-back of ``[loss, norm]`` copies into a fresh pinned tensor with
  a new CUDA event per step (session 5's ``LaggedStats.push``) instead of the ring made once;
* ``fb``: only ``_Trainer._forward_backward`` replaced by the bare loop's forward/backward (below), Kiln's update kept;
* ``update``: only what follows the backward pass replaced by the bare loop's update (unscale, clip, scaler
  step/update, zero_grad), Kiln's ``_forward_backward`` kept;
* ``direct``: Kiln's loop, but its model wrapper (``CompiledModel.__call__``: the static-shape check, the fallback
  handler) calls the compiled module directly;
* ``step``: ``_Trainer._step`` and ``_forward_backward`` replaced by the bare loop's step (forward through the compiled
  module, FP32 cross-entropy, scaled backward, unscale, clip, scaler step/update, zero_grad) on Kiln's own model,
  optimizer and scaler: no step check, lagged read-back, schedule or book-keeping;
* ``step+batches``: as ``step``, and Kiln's device-resident batches (``DeviceBatches``) replaced by the bare loop's
  batching (a random permutation sliced per step, ``index_select``);
* ``step+batches+compile``: as ``step+batches``, and Kiln's ``torch.compile(module, mode=..., dynamic=False, ...)``
  replaced by the bare loop's ``torch.compile(model)``;
* ``bare``: the bare loop against a second bare loop on another instance of the model (the method's own spread);
* ``bare+spin`` / ``bare+touch``: as ``bare``, the first loop doing ``--pad-us`` microseconds of extra host work per
  step: spinning on the clock, or reading Python objects scattered over ~64 MB (calibrated to the same time). Kiln's
  own per-step extras cost about 0.1-0.2 ms of host time (``step_host_cost.py``) but its GPU steps lose 2-5 ms; a
  pad costing far more than itself (expected ratio: ``1 / (1 + pad * steps/s)``, the pad as timed in the run) would
  mean the host-bound GPU step amplifies any extra host work. On the H200 it did not: both pads cost exactly their
  own time (``benchmarks/results/gpu_session9.md``).

The swaps monkeypatch Kiln's classes for the duration of one run and are undone after it. Variants alternate run
by run (a drift of the host's speed reaches all of them). Kiln / bare per run is the median of its window pairs'
ratios; per variant the mean and spread over runs. Writes <out>/train_loop_ab[_smoke].json/.md.

    PYTHONPATH=/tmp/site:$PWD python benchmarks/train_loop_ab.py --precision bf16 --out $OUT    # GPU host
    python benchmarks/train_loop_ab.py --smoke --out /tmp/ab                                   # tiny, CPU
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/common.py
import train_bench as TB  # noqa: E402
from common import bare_update, write_report  # noqa: E402

from kiln.stages.train import compile as compile_module  # noqa: E402
from kiln.stages.train import health, loop  # noqa: E402
from kiln.stages.train.precision import autocast  # noqa: E402

VARIANTS = (
    "kiln",
    "nograph",
    "nograph+oldstats",
    "fb",
    "update",
    "direct",
    "step",
    "step+batches",
    "step+batches+compile",
    "bare",
    "bare+spin",
    "bare+touch",
)


def bare_forward_backward(self: Any, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
    """The bare loop's forward/backward (train_bench.BareLoop.step) on Kiln's trainer."""
    with autocast(self.device, self.precision):
        out = self.net.forward(xb)  # the compiled module itself, not Kiln's CompiledModel wrapper
    loss = nn.functional.cross_entropy(out.float(), yb)
    self.scaler.scale(loss).backward()
    return loss.detach()


def bare_step(self: Any, xb: torch.Tensor, yb: torch.Tensor) -> None:
    """The bare loop's step on Kiln's trainer: none of Kiln's checks, read-back, schedule or book-keeping."""
    self._forward_backward(xb, yb)
    bare_update(self.scaler, self.opt, self.params)
    self.result.global_step += 1
    self.step_in_epoch += 1
    self.acc["samples"] += len(yb)


class BareBatches:
    """The bare loop's batching in place of Kiln's ``DeviceBatches``: a permutation sliced per step."""

    def __init__(self, batches: Any) -> None:
        self.x, self.y, self.batch, self.n = batches.x, batches.y, batches.batch, len(batches)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        perm = torch.randperm(len(self.y), device=self.y.device)
        for b in range(self.n):
            idx = perm[b * self.batch : (b + 1) * self.batch]
            yield self.x.index_select(0, idx), self.y.index_select(0, idx)

    def __len__(self) -> int:
        return self.n


def direct_call(self: Any, *args: Any, **kwargs: Any) -> Any:
    """``CompiledModel.__call__`` without its checks: the compiled module itself (variant ``direct``)."""
    return self.forward(*args, **kwargs)


def allocating_push(self: health.LaggedStats, step: int, epoch: int, samples: int, values: torch.Tensor) -> None:
    """Session 5's read-back (3105eb1): a fresh pinned copy and a new CUDA event per step."""
    event = None
    if values.is_cuda:
        values = values.to("cpu", non_blocking=True)  # D2H non_blocking lands in (newly taken) pinned memory
        event = torch.cuda.Event()
        event.record()
    else:
        values = values.clone()
    self.queue.append(health.StepStats(step, epoch, samples, values, event))


@contextmanager
def variant_patches(variant: str) -> Iterator[None]:
    """Kiln's loop with the parts named by ``variant`` swapped for the bare loop's (undone on exit)."""
    with ExitStack() as stack:
        if variant.startswith("nograph"):
            stack.enter_context(mock.patch.object(health, "_capture", lambda work, device: None))
        if "oldstats" in variant:
            stack.enter_context(mock.patch.object(health.LaggedStats, "push", allocating_push))
        if variant == "fb":
            stack.enter_context(mock.patch.object(loop._Trainer, "_forward_backward", bare_forward_backward))
        if variant == "update":
            # bare_step calls self._forward_backward: here Kiln's own
            stack.enter_context(mock.patch.object(loop._Trainer, "_step", bare_step))
        if variant == "direct":
            stack.enter_context(mock.patch.object(compile_module.CompiledModel, "__call__", direct_call))
        if variant.startswith("step"):
            stack.enter_context(mock.patch.object(loop._Trainer, "_step", bare_step))
            stack.enter_context(mock.patch.object(loop._Trainer, "_forward_backward", bare_forward_backward))
        if "batches" in variant:
            make = loop.make_loader

            def bare_loader(*args: Any, **kwargs: Any) -> Any:
                batches, sampler = make(*args, **kwargs)
                return BareBatches(batches), sampler

            stack.enter_context(mock.patch.object(loop, "make_loader", bare_loader))
        if "compile" in variant:
            real = torch.compile
            stack.enter_context(mock.patch.object(compile_module.torch, "compile", lambda module, **_: real(module)))
        yield


def spin(us: float) -> None:
    """``us`` microseconds of host time, spent on the clock."""
    end = time.perf_counter() + us / 1e6
    while time.perf_counter() < end:
        pass


class Toucher:
    """Reads of Python objects scattered over ~64 MB (ints in a list of 2M, at random indices): host work whose cost
    is cache misses. Each call reads the next ``n`` of 200k random indices (cyclically), so it keeps missing the
    caches; ``n`` is calibrated so that a call takes ``us`` microseconds here."""

    def __init__(self, us: float) -> None:
        self.pool = [i * 7 + 1000 for i in range(2_000_000)]  # separate int objects (above the small-int cache)
        rng = random.Random(0)
        self.index = [rng.randrange(len(self.pool)) for _ in range(200_000)]
        times = []
        for _ in range(3):  # the median of three passes over all indices
            t0 = time.perf_counter()
            self.touch(len(self.index))
            times.append((time.perf_counter() - t0) / len(self.index))
        self.n = max(1, min(len(self.index), round(us / 1e6 / statistics.median(times))))
        self.at = 0

    def touch(self, n: int, at: int = 0) -> int:
        pool = self.pool
        return sum(pool[i] for i in self.index[at : at + n])

    def __call__(self) -> None:
        if self.at + self.n > len(self.index):
            self.at = 0
        self.touch(self.n, self.at)
        self.at += self.n


class Padded:
    """A loop's step followed by ``pad``, timing every pad call (the expected ratio uses what the pads took in the
    run, not the calibrated figure: after a training step the caches are colder than during calibration)."""

    def __init__(self, step: Callable[[], None], pad: Callable[[], None]) -> None:
        self.step, self.pad, self.secs = step, pad, []

    def __call__(self) -> None:
        self.step()
        t0 = time.perf_counter()
        self.pad()
        self.secs.append(time.perf_counter() - t0)


def bare_vs_bare(
    name: str,
    spec: dict[str, Any],
    data: Any,
    precision: str,
    device: torch.device,
    steps: int,
    windows: int,
    pad: Padded | None = None,
) -> list[list[float]]:
    """Two bare compiled loops on two instances of the model, alternating windows: steps/s of both per pair.
    ``pad``: the first loop's step with extra host work after it (its ``step`` is set here)."""
    torch.compiler.reset()
    loops = [TB.BareLoop(TB.fresh_model(name, spec), data, spec["batch"], precision, device, True) for _ in range(2)]
    if pad is not None:
        pad.step = loops[0].step
        loops[0].step = pad  # type: ignore[method-assign]  # window() calls self.step
    for bare in loops:
        for _ in range(steps + 1):
            bare.step()
    pairs = [[bare.window(steps, device)["steps_per_s"] for bare in loops] for _ in range(windows)]
    for bare in loops:
        bare.model.to("cpu")
    return pairs


def one_run(
    variant: str,
    name: str,
    spec: dict[str, Any],
    data: Any,
    precision: str,
    device: torch.device,
    steps: int,
    windows: int,
    pad_us: float = 0.0,
) -> dict[str, float]:
    """One run: the median Kiln / bare ratio over its window pairs, and each loop's median steps/s (a variant that
    changes the ratio should change Kiln's steps/s, not the bare loop's)."""
    extra: dict[str, float] = {}
    if variant.startswith("bare"):
        pad = None
        if variant == "bare+spin":
            pad = Padded(lambda: None, lambda: spin(pad_us))
        elif variant == "bare+touch":
            pad = Padded(lambda: None, Toucher(pad_us))
        pairs = bare_vs_bare(name, spec, data, precision, device, steps, windows, pad)
        kiln_sps, bare_sps = [a for a, _ in pairs], [b for _, b in pairs]
        ratio = statistics.median(a / b for a, b in pairs)
        if pad is not None:  # what the pad would cost if it cost only the time it took
            took = statistics.median(pad.secs)
            extra = {
                "pad_us": pad_us,
                "pad_us_measured": round(took * 1e6, 1),
                "expected_ratio": round(statistics.median(1 / (1 + took * b) for b in bare_sps), 4),
            }
    else:
        with variant_patches(variant):
            r = TB.interleaved(name, spec, data, precision, device, steps, windows, compile=True)
        kiln_sps, bare_sps = [w["steps_per_s"] for w in r["kiln"]], [w["steps_per_s"] for w in r["bare"]]
        ratio = TB.paired_ratio(r["kiln"], r["bare"])
        gc = {f"{k}_gc_ms": round(sum(w["gc_ms"] for w in r[k]), 2) for k in ("kiln", "bare")}
        host = {f"{k}_host_step_ms_p50": statistics.median(w["step_ms"]["p50"] for w in r[k]) for k in ("kiln", "bare")}
        extra = {**gc, **host}
    return {
        "ratio": round(ratio, 4),
        "kiln_steps_per_s": round(statistics.median(kiln_sps), 3),
        "bare_steps_per_s": round(statistics.median(bare_sps), 3),
        **extra,
    }


def run(
    smoke: bool,
    precision: str,
    runs: int,
    steps: int,
    windows: int,
    variants: list[str],
    out: Path | None = None,
    pad_us: float = 300.0,
) -> dict[str, Any]:
    """Every variant ``runs`` times; after each run the results so far go to ``out`` (a run cut short keeps them)."""
    device = TB.bench_device(smoke)
    name = "bert_base"
    spec = TB.specs(smoke, compile_table=True)[name]  # attention written out: the cell that misses 0.97
    data = TB.make_data(spec, steps + 1)
    got: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    for i in range(runs):
        for v in variants[i % len(variants) :] + variants[: i % len(variants)]:  # rotate which variant goes first
            got[v].append(one_run(v, name, spec, data, precision, device, steps, windows, pad_us))
            print(f"run {i + 1}/{runs} {v}: {got[v][-1]}", flush=True)
            if out is not None:
                res = results(got, device, spec, precision, steps, windows)
                write_report(out, "train_loop_ab" + ("_smoke" if smoke else ""), res, markdown(res))
    return results(got, device, spec, precision, steps, windows)


def results(
    got: dict[str, list[dict[str, float]]],
    device: torch.device,
    spec: dict[str, Any],
    precision: str,
    steps: int,
    windows: int,
) -> dict[str, Any]:
    summary = {}
    for v, rs in got.items():
        if not rs:
            continue
        r = [x["ratio"] for x in rs]
        summary[v] = {
            "mean": round(statistics.mean(r), 4),
            "sd": round(statistics.stdev(r), 4) if len(r) > 1 else None,
            "runs": r,
            "kiln_steps_per_s": [x["kiln_steps_per_s"] for x in rs],
            "bare_steps_per_s": [x["bare_steps_per_s"] for x in rs],
            "details": rs,
        }
        if "expected_ratio" in rs[0]:
            summary[v]["expected"] = round(statistics.mean(x["expected_ratio"] for x in rs), 4)
    return {
        "device": TB.device_name(device),
        "host": platform.node(),
        "torch": torch.__version__,
        "model": spec,
        "precision": precision,
        "steps": steps,
        "windows": windows,
        "variants": summary,
    }


def markdown(res: dict[str, Any]) -> str:
    lines = [
        f"# Which part of Kiln's loop costs steps/s ({res['device']}, torch {res['torch']})",
        "",
        f"`bert_base` with attention written out ({res['model']['params'] or 'full size'}), batch "
        f"{res['model']['batch']}, {res['precision']}, compiled; per run the median Kiln / bare ratio over "
        f"{res['windows']} interleaved window pairs of {res['steps']} steps.",
        "",
        "| variant | mean Kiln / bare | sd | runs | Kiln steps/s per run | bare steps/s per run | "
        "a pad costing only itself |",
        "|---|---|---|---|---|---|---|",
    ]
    for v, s in res["variants"].items():
        sd = "-" if s["sd"] is None else f"{s['sd']:.3f}"
        per_run = [", ".join(f"{x:.2f}" for x in s[k]) for k in ("kiln_steps_per_s", "bare_steps_per_s")]
        expected = f"{s['expected']:.3f}" if "expected" in s else "-"
        lines.append(
            f"| {v} | {s['mean']:.3f} | {sd} | {', '.join(f'{r:.3f}' for r in s['runs'])} | "
            f"{per_run[0]} | {per_run[1]} | {expected} |"
        )
    if any("expected" in s for s in res["variants"].values()):
        lines += [
            "",
            "bare+spin / bare+touch: the first bare loop does the pad's host work after every step (Kiln / "
            "bare reads first / second loop); the last column is the ratio the pad would give if it cost "
            "only the time its calls took in the run (median).",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--smoke", action="store_true", help="tiny encoder on CPU")
    ap.add_argument("--precision", default="bf16", choices=["fp32", "fp16", "bf16"])
    ap.add_argument("--runs", type=int, default=None, help="runs per variant (default 4; smoke 1)")
    ap.add_argument("--steps", type=int, default=None, help="steps per window (default 24; smoke 4)")
    ap.add_argument("--windows", type=int, default=None, help="window pairs per run (default 8; smoke 2)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"subset of {','.join(VARIANTS)}")
    ap.add_argument("--pad-us", type=float, default=300.0, help="bare+spin / bare+touch: extra host work per step")
    args = ap.parse_args()
    variants = args.variants.split(",")
    if unknown := [v for v in variants if v not in VARIANTS]:
        ap.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    precision = "fp32" if args.smoke and args.precision == "fp16" else args.precision  # no fp16 autocast on CPU
    run(
        args.smoke,
        precision,
        args.runs or (1 if args.smoke else 4),
        args.steps or (4 if args.smoke else 24),
        args.windows or (2 if args.smoke else 8),
        variants,
        args.out,
        args.pad_us,
    )


if __name__ == "__main__":
    main()
