"""Host time of one training step, Kiln's loop vs the bare loop, part by part (issue 16).

A compiled ResNet-18 step on the H200 is close to host-bound: the host needs about as long to queue a step's
kernels as the GPU needs to run them, so every microsecond of Python or kernel launch the loop adds shows up in
steps/s. ``train_bench.py --compile`` measures the outcome (Kiln / bare steps/s); this script measures where the
host time goes, with the GPU kept out of the way (work per step far below the host's).

* ``tail``: everything after the backward pass: the bare loop's unscale, clip, scaler step, scaler update and
  zero_grad, against Kiln's ``_Trainer._step`` with its forward/backward replaced by setting the same gradients
  (so both run exactly their own loop code around the same optimizer on the same parameters).
* ``head``: the forward/backward pass at a small batch (8, host-bound), through the same compiled module: Kiln's
  ``_forward_backward`` (micro-batching, the static-shape check, autocast, the task's loss, scaled backward)
  against the bare loop's few lines.
* ``parts``: each piece Kiln adds, alone: the step check ([loss, norm], the non-finite flag and the buffer guard),
  its flag and guard op by op and as the CUDA graph the loop replays, the guard's save, the lagged read-back, the
  LR schedule, the micro-batch split, and (``train.update_graph``, the default on a GPU) the whole update as the loop
  runs it: the gradient copy and one graph replay. ``--update-graph off``: Kiln's update op by op.

Timing: ``--iters`` calls back to back, host clock around them (the host time to queue them; the GPU keeps up),
then a synchronisation; ``--rounds`` rounds alternating bare and Kiln; medians. Writes step_host_cost.json/.md.

    PYTHONPATH=/tmp/site:$PWD python benchmarks/step_host_cost.py --out $OUT      # GPU host, ~1.5 minutes
    PYTHONPATH=/tmp/site:$PWD python benchmarks/step_host_cost.py --model bert_base --out $OUT  # explicit attention
    python benchmarks/step_host_cost.py --smoke --out /tmp/shc                    # tiny model on CPU, seconds
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/common.py
from common import bare_update, write_report  # noqa: E402

from kiln.core.data import DatasetSplits  # noqa: E402
from kiln.models.registry import build_model  # noqa: E402
from kiln.stages.train.config import TrainConfig  # noqa: E402
from kiln.stages.train.data import micro_batches  # noqa: E402
from kiln.stages.train.dist import DistEnv  # noqa: E402
from kiln.stages.train.health import skip_if_nonfinite, skips_on_device  # noqa: E402
from kiln.stages.train.loop import SCHED_WARNING, _Trainer  # noqa: E402
from kiln.stages.train.precision import autocast  # noqa: E402
from kiln.stages.train.update_graph import GraphedUpdate  # noqa: E402

PRECISIONS = ("fp16", "bf16")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_us(fn: Callable[[], Any], device: torch.device, iters: int) -> float:
    """Host microseconds per call to queue ``iters`` calls (then waits for the device, untimed)."""
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    us = (time.perf_counter() - t0) / iters * 1e6
    sync(device)
    return us


def compare(fns: dict[str, Callable[[], Any]], device: torch.device, iters: int, rounds: int) -> dict[str, Any]:
    """Median host us per call of each function, the functions alternating within every round."""
    got: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():  # warm-up: first calls allocate (caching allocator, pinned memory, lazy init)
        for _ in range(3):
            fn()
    for r in range(rounds):
        names = list(fns)[r % 2 :] + list(fns)[: r % 2]  # alternate which goes first
        for k in names:
            got[k].append(host_us(fns[k], device, iters))
    return {k: {"us": round(statistics.median(v), 1), "rounds": [round(x, 1) for x in v]} for k, v in got.items()}


class Setup:
    """A model on the device, Kiln's trainer for it (not run: its step is called directly) and a bare optimizer."""

    def __init__(
        self, spec: dict[str, Any], precision: str, device: torch.device, compile: bool, update_graph: str = "auto"
    ) -> None:
        torch.manual_seed(0)
        self.device = device
        self.model = build_model(spec["model"], spec["params"]).to(device).train()
        batch, shape = spec["batch"], spec["shape"]
        x = torch.randn(batch * 2, *shape)
        y = torch.randint(0, spec["classes"], (batch * 2,))
        cfg = TrainConfig.model_validate(
            {
                "epochs": 1,
                "batch_size": batch,
                "precision": precision,
                "device": device.type,
                "lr": 1e-4,
                "weight_decay": 0.01,
                "grad_clip": 1.0,
                "optimizer": "adamw",
                "schedule": "constant",
                "plot": False,
                "loader": {"on_device": True},
                "checkpoint": {"resume": "never"},
                "compile": compile,
                "update_graph": update_graph,
            }
        )
        self.trainer = _Trainer(
            self.model,
            DatasetSplits(x, y, x, y, spec["classes"], "synthetic"),
            cfg,
            0,
            DistEnv(),
            device,
            precision,
            None,
            "",
            None,
        )
        self.trainer.acc = dict.fromkeys(("loss", "seen", "samples", "secs", "skipped", "nonfinite"), 0.0)  # as _epoch
        self.xb, self.yb = x[:batch].to(device), y[:batch].to(device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        # The gradients each call starts from: unscale and clip scale them in place, and many calls in a row would
        # shrink them into denormals (slow on CPUs); one multi-tensor copy restores them, the same in both loops
        self.pristine = [torch.randn_like(p) * 1e-3 for p in self.params]
        self.grads = [g.clone() for g in self.pristine]
        groups = [
            {"params": [p for p in self.params if p.dim() >= 2], "weight_decay": 0.01},
            {"params": [p for p in self.params if p.dim() < 2], "weight_decay": 0.0},
        ]
        self.opt = torch.optim.AdamW(groups, lr=1e-4, fused=device.type == "cuda")
        self.scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
        self.precision = precision
        self.loss = torch.tensor(1.0, device=device)
        for scaler in (self.scaler, self.trainer.scaler):  # the scale tensor is made lazily, by the first scale()
            scaler.scale(self.loss)

    def set_grads(self) -> None:
        torch._foreach_copy_(self.grads, self.pristine)
        for p, g in zip(self.params, self.grads):
            p.grad = g

    def bare_tail(self) -> None:
        self.set_grads()
        bare_update(self.scaler, self.opt, self.params)

    def kiln_tail(self) -> None:
        self.trainer._step(self.xb, self.yb)

    def _kiln_fb(self, xb: Any, yb: torch.Tensor) -> torch.Tensor:
        self.set_grads()
        return self.loss

    def bare_head(self) -> None:
        with autocast(self.device, self.precision):
            out = self.trainer.net.forward(self.xb)  # the compiled module itself, without Kiln's wrapper
        loss = nn.functional.cross_entropy(out.float(), self.yb)
        self.scaler.scale(loss).backward()
        self.opt.zero_grad(set_to_none=True)

    def kiln_head(self) -> None:
        self.trainer._forward_backward(self.xb, self.yb)
        self.opt.zero_grad(set_to_none=True)


def parts(s: Setup) -> dict[str, Callable[[], Any]]:
    t, loss, norm = s.trainer, s.loss, s.loss * 2
    check = t.check
    values, _ = check(loss, norm)
    step = [0]

    def stats() -> None:
        step[0] += 1
        t.stats.push(step[0], 0, 8, values)
        list(t.stats.ready())

    def check_graph() -> None:
        check.graph.replay()

    # Kiln's optimizer step as the loop takes it in bf16/fp32 (the skip on the device: fused AdamW's found_inf) and
    # without the skip, each after the same gradient reset (set_grads alone is timed too, to subtract)
    _, found = check(loss, norm)

    def opt_step() -> None:
        s.set_grads()
        t.opt.step()

    def opt_step_skippable() -> None:
        s.set_grads()
        with skip_if_nonfinite(t.opt, found):
            t.opt.step()

    out: dict[str, Callable[[], Any]] = {
        "step check (as the loop calls it)": lambda: check(loss, norm),
        "flag + guard, op by op": check._flag_and_settle,
    }
    if isinstance(t.update, GraphedUpdate):  # the whole update as the loop calls it (a replay, once captured)
        out["set_grads + the update (graphed)"] = lambda: (s.set_grads(), t.update(loss))
    if check.graph is not None:
        out["flag + guard, graph replay"] = check_graph
    out |= {"set_grads": s.set_grads, "set_grads + opt.step": opt_step}
    if skips_on_device(t.opt) and not t.scaler.is_enabled():  # Kiln's bf16/fp32 path (fp16 skips in scaler.step)
        out["set_grads + opt.step under skip_if_nonfinite"] = opt_step_skippable
    return {
        **out,
        "guard.save": t.guard.save,
        "lagged read-back": stats,
        "sched.step": t.sched.step,
        "micro_batches": lambda: micro_batches(s.xb, s.yb, 1),
    }


MODELS = ("resnet18", "bert_base")


def specs(smoke: bool, model: str = "resnet18") -> dict[str, Any]:
    """``bert_base``: the encoder with attention written out, the train_bench cell whose compiled step is the most
    host-bound (about 1,090 kernels per step on the H200; issue 16's worst cell in session 7)."""
    if model == "bert_base":
        params = {"layers": 2, "dim": 32, "heads": 2, "ffn": 64, "in_features": 32, "seq_len": 8} if smoke else {}
        return {
            "model": "bert_base",
            "params": {**params, "attention": "explicit"},
            "batch": 8,
            "shape": (8, 32) if smoke else (128, 768),
            "classes": 2,
        }
    if smoke:
        return {
            "model": "resnet18",
            "params": {"width": 8, "blocks": (1, 1), "num_classes": 10},
            "batch": 8,
            "shape": (3, 32, 32),
            "classes": 10,
        }
    return {"model": "resnet18", "params": {}, "batch": 8, "shape": (3, 224, 224), "classes": 1000}


def run(
    smoke: bool,
    iters: int,
    rounds: int,
    compile: bool,
    model: str = "resnet18",
    batch: int | None = None,
    update_graph: str = "auto",
) -> dict[str, Any]:
    device = torch.device("cpu" if smoke or not torch.cuda.is_available() else "cuda")
    spec = specs(smoke, model)
    if batch:  # e.g. train_bench's batch (64 for bert_base), where the head's GPU work may no longer hide
        spec = {**spec, "batch": batch}
    rows = []
    for precision in PRECISIONS:
        s = Setup(spec, precision, device, compile, update_graph)
        s.trainer._forward_backward = s._kiln_fb  # type: ignore[method-assign]
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=SCHED_WARNING)
            tail = compare({"bare": s.bare_tail, "kiln": s.kiln_tail}, device, iters, rounds)
            del s.trainer._forward_backward  # back to the class's method
            head = compare({"bare": s.bare_head, "kiln": s.kiln_head}, device, iters, rounds)
            kiln_parts = compare(parts(s), device, iters, rounds)
        s.trainer.stats.drain()
        rows.append(
            {
                "precision": precision,
                "tail": tail,
                "head": head,
                "parts": kiln_parts,
                "tail_extra_us": round(tail["kiln"]["us"] - tail["bare"]["us"], 1),
                # the compiled forward/backward's host time varies by +-1.5 ms between rounds on the H200's
                # host: its difference is reported apart, not added to the tail's
                "head_extra_us": round(head["kiln"]["us"] - head["bare"]["us"], 1),
                "compile": s.trainer.net.summary(),
                "update_graph": getattr(s.trainer.update, "summary", dict)(),
            }
        )
        s.model.to("cpu")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    return {
        "device": name,
        "torch": torch.__version__,
        "model": spec,
        "iters": iters,
        "rounds": rounds,
        "compiled_head": compile,
        "update_graph": update_graph,
        "rows": rows,
    }


def markdown(res: dict[str, Any]) -> str:
    lines = [
        f"# Host time per training step, Kiln vs bare ({res['device']}, torch {res['torch']})",
        "",
        f"{res['model']['model']} ({res['model']['params'] or 'full size'}), batch {res['model']['batch']}; "
        "median host us "
        f"per call over {res['rounds']} rounds of {res['iters']} calls; head compiled: {res['compiled_head']}; "
        f"Kiln's train.update_graph: {res.get('update_graph', 'auto')} (captured: "
        + ", ".join(f"{r['precision']} {bool((r.get('update_graph') or {}).get('captured'))}" for r in res["rows"])
        + ").",
        "",
        "| precision | tail bare | tail Kiln | Kiln extra, tail | head bare | head Kiln | Kiln extra, head |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        lines.append(
            f"| {r['precision']} | {r['tail']['bare']['us']} | {r['tail']['kiln']['us']} | "
            f"{r['tail_extra_us']} | {r['head']['bare']['us']} | {r['head']['kiln']['us']} | "
            f"{r['head_extra_us']} |"
        )
    precisions = [r["precision"] for r in res["rows"]]
    lines += [
        "",
        "Kiln's parts alone (us per call):",
        "",
        "| part | " + " | ".join(precisions) + " |",
        "|---|" + "---|" * len(precisions),
    ]
    for part in dict.fromkeys(p for r in res["rows"] for p in r["parts"]):  # some parts exist in one precision only
        lines.append(
            f"| {part} | "
            + " | ".join(str(r["parts"][part]["us"]) if part in r["parts"] else "-" for r in res["rows"])
            + " |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU")
    ap.add_argument("--iters", type=int, default=None, help="calls per timed round (default 50; smoke 5)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds per comparison (default 9; smoke 3)")
    ap.add_argument("--no-compile", action="store_true", help="the head through the eager model")
    ap.add_argument("--model", choices=MODELS, default="resnet18")
    ap.add_argument("--batch", type=int, default=None, help="batch size (default 8: host-bound)")
    ap.add_argument("--update-graph", choices=("auto", "off"), default="auto", help="Kiln's train.update_graph")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    res = run(
        args.smoke,
        args.iters or (5 if args.smoke else 50),
        args.rounds or (3 if args.smoke else 9),
        not args.no_compile,
        args.model,
        args.batch,
        args.update_graph,
    )
    name = (
        "step_host_cost"
        + ("" if args.model == "resnet18" else f"_{args.model}")
        + ("" if args.update_graph == "auto" else f"_graph_{args.update_graph}")
        + ("_smoke" if args.smoke else "")
    )
    write_report(args.out, name, res, markdown(res))


if __name__ == "__main__":
    main()
