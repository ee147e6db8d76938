"""Training throughput: Kiln's training loop vs a bare minimal loop, fp32 / fp16 / bf16, in one run.

Models (random weights, synthetic data already on the GPU): a BERT-base-shaped encoder (12 layers, hidden 768,
seq 128) at batch 64 and a ResNet-18-shaped CNN (3x224x224) at batch 128. Both loops do the same work per
step: gather a shuffled batch from the device-resident data set (index_select), autocast forward, FP32 loss,
(scaled) backward, unscale, clip to norm 1.0, fused AdamW step (lr 1e-4, weight decay 0.01 on matrices only,
two param groups), scaler update, zero_grad(set_to_none). TF32 off for both, cuDNN autotuning on for both.

* bare: that step in a Python for-loop, nothing else (no NaN check, no schedule, no metrics).
* kiln: ``kiln.stages.train.loop.train`` with ``loader.on_device``, one epoch of warm-up + timed steps; on top of
  the bare step it does the lagged loss/NaN book-keeping, the LR schedule and its epoch metrics.

Both are timed the same way: ``torch.cuda.synchronize`` after the warm-up steps, clock, timed steps,
``torch.cuda.synchronize``, clock (Kiln's through its ``on_step`` hook, so the timed window is exactly the
same steps, away from epoch boundaries). Peak memory is ``torch.cuda.max_memory_allocated`` over the timed
steps, reset at the same point for both. Each cell runs ``--rounds`` times, alternating which loop goes
first and emptying the allocator cache before every run; the table shows medians and the JSON every round.

Why the first version of this benchmark showed Kiln bf16 31% *faster* than the bare loop: the two were not
measured alike. Kiln was timed by its own per-epoch clock over four 8-step epochs, the bare loop over one
stretch. The bare loop sliced contiguous batches while Kiln gathered shuffled ones. The bare loop used one
param group. Each cell ran once (~1.3 s of timed work), always bare first, with ``empty_cache`` before the
bare run only, so Kiln always started on the allocator cache the bare run had warmed. Reading the code finds
no step in which Kiln's bf16 path does less GPU work than the bare one. On CUDA no norm is patched (CUDA
autocast already runs layer_norm in FP32). The scaler is off in both. It is the same fused AdamW. More than
25 consecutive skipped steps would have aborted. Kiln also did strictly more: two host syncs per step. The
AMP encoder step (~1,500 kernel launches in ~35 ms) is close to launch-bound, so one short window per cell
swings with host jitter; the fp16 and bf16 bare cells (22.3 and 21.6 steps/s) were also well below the
reference bare loop's 27.7 and 30.2. The like-for-like loops, the identical timing and the repeated
alternating rounds above remove those differences, and the per-round figures show how much noise is left.

The encoder's attention runs through ``F.scaled_dot_product_attention`` in both loops (models/transformer.py);
with attention written out op by op (MatMul, Softmax, MatMul and a [B, H, S, S] score tensor kept for the
backward pass) the AMP step was bound by small kernels and reached only 2.35x (fp16) / 2.45x (bf16) FP32.

Writes <out>/train.json and <out>/train.md.

``--compile``: the torch.compile table instead (issue 16). Loops: Kiln and the bare loop above, eager AMP and with
``train.compile: true`` / ``torch.compile(model)``, fp16 and bf16, for ``bert_base`` (explicit attention: MatMul,
Softmax, MatMul written out), ``bert_base_hf`` (``transformers``' BertForSequenceClassification, random weights,
token ids; skipped with a note where ``transformers`` does not import; pip install 'kiln[bench]') and ``resnet18``.
Both compiled loops compile the model alone (mode default, inductor). Kiln runs with its default ``train.update_graph``
(auto: on a GPU the update after the backward pass is one CUDA graph: the bare loop's kernels, Kiln's step check and
a copy of the gradients into the graph's buffers); ``--update-graph off`` runs it op by op, as the bare loop does.
Kiln and the bare loop run interleaved in one process (:func:`interleaved`): alternating timed windows of
``--steps`` steps, ``--windows`` pairs per cell and mode, each loop compiled once in its warm-up, after
``torch.compiler.reset()`` per cell and mode. Kiln / bare is the median of the pairs' ratios. Why: these compiled
steps are close to host-bound, and runs of one loop minutes apart varied by up to 30% on the H200's shared host,
more than the difference the target is about; the separate rounds this
table used before (one process each, compiled each time) measured that drift as a difference between the loops.
``--profile-steps N`` adds one profiled run per compiled loop and cell (torch.profiler over N steps after the
warm-up): GPU kernel time and kernels per step, the synchronising CUDA calls per step and the busiest host ops.
``--phases`` adds the host time of each part of the step (forward, loss + backward, everything after the backward
pass, between steps), median over the timed steps of both loops and modes (:class:`Phases`): on a host-bound step
the parts show whether a gap lies in Kiln's own code (after the backward pass) or in the same compiled graphs' calls.
Target: Kiln compiled >= 0.97x the bare compiled loop in every cell. Writes <out>/train_compile[_<models>].json/.md.
Each ratio carries a 95% bootstrap interval over its window pairs (:func:`ratio_interval`); ``--intervals JSON...``
prints them for saved results.

    PYTHONPATH=/tmp/site:$PWD python benchmarks/train_bench.py --out $OUT     # GPU host, ~4 minutes
    PYTHONPATH=/tmp/site:$PWD python benchmarks/train_bench.py --compile --models bert_base,bert_base_hf --out $OUT
    PYTHONPATH=/tmp/site:$PWD python benchmarks/train_bench.py --compile --models resnet18 --out $OUT
    PYTHONPATH=/tmp/site python benchmarks/train_bench.py --compile --phases --models bert_base --windows 6 \
        --out $OUT
    python benchmarks/train_bench.py --smoke --out /tmp/train_bench          # tiny models on CPU, seconds
    python benchmarks/train_bench.py --smoke --compile --models bert_base --precisions bf16 --out /tmp/tb
    python benchmarks/train_bench.py --intervals benchmarks/results/train_compile_h200_s6_*.json
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import platform
import random
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/common.py
from common import bare_update, write_report  # noqa: E402

from kiln.core.data import DatasetSplits  # noqa: E402
from kiln.models.registry import build_model  # noqa: E402
from kiln.stages.train.compile import CompileCounts  # noqa: E402
from kiln.stages.train.config import TrainConfig  # noqa: E402
from kiln.stages.train.loop import train  # noqa: E402

log = logging.getLogger("bench")
PRECISIONS = ("fp32", "fp16", "bf16")
COMPILE_PRECISIONS = ("fp16", "bf16")
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
EAGER_LOOPS = ("bare", "kiln")
# Bare loop, eager -> compiled, median ms/step on the H200 (issue 16's anchor): the gain Kiln should match.
ANCHOR_GAIN = {
    ("bert_base", "fp16"): 1.54,
    ("bert_base", "bf16"): 1.17,
    ("bert_base_hf", "fp16"): 1.11,
    ("bert_base_hf", "bf16"): 1.34,
    ("resnet18", "fp16"): 1.74,
    ("resnet18", "bf16"): 2.33,
}


def specs(smoke: bool, compile_table: bool = False) -> dict[str, dict[str, Any]]:
    """name -> model (registry name or "hf_bert"), params, batch, sample shape, classes (and token ids)."""
    if smoke:
        enc = {
            "model": "bert_base",
            "params": {"layers": 1, "dim": 64, "heads": 4, "ffn": 128, "in_features": 64, "seq_len": 16},
            "batch": 8,
            "shape": (16, 64),
            "classes": 2,
        }
        out = {
            "bert_base": enc,
            "resnet18": {
                "model": "resnet18",
                "params": {"width": 8, "blocks": (1, 1), "num_classes": 10},
                "batch": 8,
                "shape": (3, 32, 32),
                "classes": 10,
            },
        }
        hf = {
            "model": "hf_bert",
            "params": {
                "hidden_size": 64,
                "num_hidden_layers": 1,
                "num_attention_heads": 4,
                "intermediate_size": 128,
                "vocab_size": 1000,
                "max_position_embeddings": 32,
            },
            "batch": 8,
            "shape": (16,),
            "classes": 2,
            "vocab": 1000,
        }
    else:
        enc = {"model": "bert_base", "params": {}, "batch": 64, "shape": (128, 768), "classes": 2}
        out = {
            "bert_base": enc,
            "resnet18": {"model": "resnet18", "params": {}, "batch": 128, "shape": (3, 224, 224), "classes": 1000},
        }
        hf = {"model": "hf_bert", "params": {}, "batch": 64, "shape": (128,), "classes": 2, "vocab": 30522}
    if not compile_table:
        return out
    # The compile table: attention written out (what the compiler must fuse), and transformers' BERT.
    return {
        "bert_base": {**enc, "params": {**enc["params"], "attention": "explicit"}},
        "bert_base_hf": hf,
        "resnet18": out["resnet18"],
    }


def make_data(spec: dict[str, Any], batches: int, seed: int = 0) -> DatasetSplits:
    g = torch.Generator().manual_seed(seed)
    n = spec["batch"] * batches
    if "vocab" in spec:  # token ids
        x = torch.randint(0, spec["vocab"], (n, *spec["shape"]), generator=g)
    else:
        x = torch.randn((n, *spec["shape"]), generator=g)
    y = torch.randint(0, spec["classes"], (n,), generator=g)
    return DatasetSplits(x, y, x[: spec["batch"]], y[: spec["batch"]], spec["classes"], "synthetic")


class HFBert(nn.Module):
    """transformers' BertForSequenceClassification returning logits (Kiln's loop takes a tensor in, logits out)."""

    def __init__(self, **overrides: Any) -> None:
        super().__init__()
        from transformers import BertConfig, BertForSequenceClassification

        self.bert = BertForSequenceClassification(BertConfig(num_labels=2, **overrides))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.bert(input_ids=ids).logits


def has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def fresh_model(name: str, spec: dict[str, Any]) -> nn.Module:
    torch.manual_seed(0)
    if spec.get("model") == "hf_bert":
        return HFBert(**spec["params"])
    return build_model(spec.get("model", name), spec["params"])


class Phases:
    """Host time of each part of a step, per loop, inside timed windows only (``--phases``): where Kiln's step spends
    the host time the bare one does not. Parts: ``data`` (the batch), ``forward`` (the model's call, compiled or not),
    ``loss_backward``, ``tail`` (everything after the backward pass) and ``between`` (from the end of one step to the
    start of the next: the loader, hooks, the window's clock). On a host-bound GPU step these add up to the step time.
    Kiln's parts are read by wrapping its methods (:func:`instrument_kiln`); each wrapper costs a clock read, as the
    bare loop's own reads do."""

    enabled = False
    active: str | None = None  # "kiln" / "bare" while that loop's window runs
    fwd_secs = fb_secs = 0.0  # Kiln's forward / forward+backward of the current step, for the parts around them
    times: dict[str, dict[str, list[float]]] = {}
    last_end: dict[str, float] = {}

    @classmethod
    def add(cls, loop: str, part: str, secs: float) -> None:
        if cls.active == loop:
            cls.times.setdefault(loop, {}).setdefault(part, []).append(secs * 1e3)

    @classmethod
    def step_bounds(cls, loop: str, start: float, end: float) -> None:
        if cls.active == loop and loop in cls.last_end:
            cls.add(loop, "between", start - cls.last_end[loop])
        cls.last_end[loop] = end

    @classmethod
    def take(cls) -> dict[str, dict[str, float]]:
        """Median ms per part and loop since the last take."""
        out = {
            loop: {part: round(statistics.median(v), 3) for part, v in parts.items()}
            for loop, parts in cls.times.items()
        }
        cls.times, cls.last_end = {}, {}
        return out


def instrument_kiln() -> None:
    """Wrap Kiln's step, its forward/backward and the compiled model's call with host clocks (:class:`Phases`)."""
    from kiln.stages.train import compile as train_compile
    from kiln.stages.train import loop as train_loop

    trainer, model = train_loop._Trainer, train_compile.CompiledModel
    if getattr(trainer, "_phases", False):
        return
    step, fb, call = trainer._step, trainer._forward_backward, model.__call__

    def timed_step(self: Any, xb: Any, yb: Any) -> None:
        t0 = time.perf_counter()
        Phases.fb_secs = 0.0
        step(self, xb, yb)
        t1 = time.perf_counter()
        Phases.add("kiln", "tail", t1 - t0 - Phases.fb_secs)
        Phases.step_bounds("kiln", t0, t1)

    def timed_fb(self: Any, xb: Any, yb: Any) -> Any:
        t0 = time.perf_counter()
        Phases.fwd_secs = 0.0
        out = fb(self, xb, yb)
        Phases.fb_secs = time.perf_counter() - t0
        Phases.add("kiln", "loss_backward", Phases.fb_secs - Phases.fwd_secs)
        return out

    def timed_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = call(self, *args, **kwargs)
        Phases.fwd_secs = time.perf_counter() - t0
        Phases.add("kiln", "forward", Phases.fwd_secs)
        return out

    trainer._step, trainer._forward_backward, model.__call__ = timed_step, timed_fb, timed_call
    trainer._phases = True


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Window:
    """The timed window, identical for both loops: sync + clock + peak reset at the start, sync + clock +
    peak at the end. ``profile``: torch.profiler records the window too (see :func:`profile_summary`)."""

    profile = False

    def __init__(self, device: torch.device, loop: str = "") -> None:
        self.device, self.t0, self.secs, self.peak, self.resident = device, 0.0, 0.0, None, 0.0
        self.loop = loop  # whose steps these are, for Phases
        self.prof: Any = None
        self.marks: list[float] = []  # host clock after each timed step was queued
        self.gc_ms: list[float] = []  # Python garbage collections inside the window
        self._gc_t0 = 0.0

    def _gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        elif self.t0 and not self.secs:
            self.gc_ms.append((time.perf_counter() - self._gc_t0) * 1e3)

    def mark(self) -> None:
        if self.t0 and not self.secs:
            self.marks.append(time.perf_counter())

    def start(self) -> None:
        sync(self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.resident = torch.cuda.memory_allocated(self.device) / 2**20
        if self.profile:
            activities = [torch.profiler.ProfilerActivity.CPU] + (
                [torch.profiler.ProfilerActivity.CUDA] if self.device.type == "cuda" else []
            )
            self.prof = torch.profiler.profile(activities=activities)
            self.prof.start()
        gc.callbacks.append(self._gc)
        Phases.active = self.loop or None
        self.t0 = time.perf_counter()

    def stop(self) -> None:
        sync(self.device)
        self.secs = time.perf_counter() - self.t0
        Phases.active = None
        gc.callbacks.remove(self._gc)
        if self.prof is not None:
            self.prof.stop()
        if self.device.type == "cuda":
            self.peak = torch.cuda.max_memory_allocated(self.device) / 2**20

    def result(self, steps: int) -> dict[str, Any]:
        # step_peak_mb: the peak above what was allocated when the window began (weights, optimizer state, data,
        # and in interleaved runs the other loop's): what the steps themselves add (activations, gradients)
        out: dict[str, Any] = {
            "steps_per_s": steps / self.secs,
            "peak_mb": self.peak,
            "step_peak_mb": None if self.peak is None else round(self.peak - self.resident, 1),
            "gc_collections": len(self.gc_ms),
            "gc_ms": round(sum(self.gc_ms), 2),
        }
        gaps = [1e3 * (b - a) for a, b in zip([self.t0, *self.marks], self.marks)]
        if gaps:  # host time per step (the host runs ahead of the GPU only as far as the queue allows)
            out["step_ms"] = {"p50": round(statistics.median(gaps), 3), "max": round(max(gaps), 3)}
        if self.prof is not None:
            out["profile"] = profile_summary(self.prof, steps, self.secs)
        return out


# Calls that can make the host wait: synchronisations, copies, and allocations that reach the driver (the caching
# allocator calls cudaMalloc/cudaFree only when its pool cannot serve a request)
SYNC_CALLS = (
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpy",
    "cudaMemcpyAsync",
    "aten::item",
    "aten::_local_scalar_dense",
    "cudaMalloc",
    "cudaFree",
    "cudaHostAlloc",
    "cudaFreeHost",
    "cudaEventCreate",
    "cudaEventCreateWithFlags",
)


def profile_summary(prof: Any, steps: int, secs: float) -> dict[str, Any]:
    """Per step: wall time, GPU kernel time (busy share), kernel launches, synchronising calls, busiest host ops.
    A loop whose kernel time matches the other's but whose wall time does not waits on the host or on syncs."""
    kernel_us, kernels, host = 0.0, 0, []
    calls: dict[str, int] = {}
    for e in prof.key_averages():
        if str(getattr(e, "device_type", "")).endswith("CUDA"):
            kernel_us += getattr(e, "self_device_time_total", 0.0)
            kernels += e.count
            continue
        if e.key in SYNC_CALLS:
            calls[e.key] = calls.get(e.key, 0) + e.count
        host.append((e.self_cpu_time_total, e.key, e.count))
    wall_ms = secs * 1e3 / steps
    return {
        "wall_ms": round(wall_ms, 3),
        "gpu_kernel_ms": round(kernel_us / 1e3 / steps, 3),
        "gpu_busy": round(kernel_us / 1e3 / steps / wall_ms, 3),
        "kernels": round(kernels / steps, 1),
        "sync_calls": {k: round(v / steps, 2) for k, v in sorted(calls.items())},
        "top_host_ms": [
            [k, round(t / 1e3 / steps, 3), round(n / steps, 1)] for t, k, n in sorted(host, reverse=True)[:12]
        ],
    }


class BareLoop:
    """The minimal AMP step, nothing around it; ``compile``: through ``torch.compile(model)``. Set up once and
    stepped on demand, so that windows of it can alternate with windows of Kiln's loop (:func:`interleaved`)."""

    def __init__(
        self,
        model: nn.Module,
        data: DatasetSplits,
        batch: int,
        precision: str,
        device: torch.device,
        compile: bool = False,
    ) -> None:
        self.model, self.batch, self.i = model.to(device).train(), batch, 0
        self.net = torch.compile(model) if compile else model
        self.x, self.y = data.train_x.to(device), data.train_y.to(device)
        self.perm = torch.randperm(len(self.x), device=device)  # shuffled batches, gathered on the device like Kiln's
        self.batches = len(self.x) // batch
        self.params = [p for p in model.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in self.params if p.dim() >= 2], "weight_decay": 0.01},
            {"params": [p for p in self.params if p.dim() < 2], "weight_decay": 0.0},
        ]
        self.opt = torch.optim.AdamW(groups, lr=1e-4, fused=device.type == "cuda")
        self.scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
        self.ctx = (
            (lambda: torch.autocast(device.type, dtype=DTYPES[precision])) if precision != "fp32" else nullcontext
        )

    def step(self) -> None:
        if Phases.enabled:
            return self.timed_step()
        b = self.i % self.batches
        self.i += 1
        idx = self.perm[b * self.batch : (b + 1) * self.batch]
        xb, yb = self.x.index_select(0, idx), self.y.index_select(0, idx)
        with self.ctx():
            logits = self.net(xb)
        loss = nn.functional.cross_entropy(logits.float(), yb)
        self.scaler.scale(loss).backward()
        bare_update(self.scaler, self.opt, self.params)

    def timed_step(self) -> None:
        """:meth:`step` with a host clock between its parts (``--phases``)."""
        t0 = time.perf_counter()
        b = self.i % self.batches
        self.i += 1
        idx = self.perm[b * self.batch : (b + 1) * self.batch]
        xb, yb = self.x.index_select(0, idx), self.y.index_select(0, idx)
        t1 = time.perf_counter()
        with self.ctx():
            logits = self.net(xb)
        t2 = time.perf_counter()
        loss = nn.functional.cross_entropy(logits.float(), yb)
        self.scaler.scale(loss).backward()
        t3 = time.perf_counter()
        bare_update(self.scaler, self.opt, self.params)
        t4 = time.perf_counter()
        for part, secs in (("data", t1 - t0), ("forward", t2 - t1), ("loss_backward", t3 - t2), ("tail", t4 - t3)):
            Phases.add("bare", part, secs)
        Phases.step_bounds("bare", t0, t4)

    def window(self, steps: int, device: torch.device) -> dict[str, Any]:
        window = Window(device, "bare")
        window.start()
        for _ in range(steps):
            self.step()
            window.mark()
        window.stop()
        return window.result(steps)


def bare_loop(
    model: nn.Module,
    data: DatasetSplits,
    batch: int,
    precision: str,
    device: torch.device,
    warmup: int,
    steps: int,
    compile: bool = False,
) -> dict[str, float | None]:
    """``warmup`` untimed steps of :class:`BareLoop`, then one timed window."""
    loop = BareLoop(model, data, batch, precision, device, compile)
    for _ in range(warmup):
        loop.step()
    out = loop.window(steps, device)
    model.to("cpu")
    return out


# Kiln's train.update_graph in every Kiln run (--update-graph): auto (the default: the update after the backward pass
# as one CUDA graph on a GPU) or off (the update op by op, as the bare loop runs it)
UPDATE_GRAPH = {"setting": "auto"}


def kiln_config(batch: int, precision: str, device: torch.device, compile: bool, epochs: int = 1) -> TrainConfig:
    return TrainConfig.model_validate(
        {
            "epochs": epochs,
            "batch_size": batch,
            "precision": precision,
            "device": device.type,
            "lr": 1e-4,
            "weight_decay": 0.01,
            "grad_clip": 1.0,
            "optimizer": "adamw",
            "schedule": "constant",
            "eval_every": 10_000,
            "plot": False,
            "loader": {"on_device": True},
            "checkpoint": {"resume": "never"},
            "compile": compile,
            "update_graph": UPDATE_GRAPH["setting"],
        }
    )


def kiln_loop(
    model: nn.Module,
    data: DatasetSplits,
    batch: int,
    precision: str,
    device: torch.device,
    warmup: int,
    steps: int,
    compile: bool = False,
) -> dict[str, Any]:
    """Kiln's loop over one epoch of warmup + steps batches, timed through its on_step hook."""
    window = Window(device)

    def on_step(step: int) -> None:
        if step == warmup:
            window.start()
            return
        window.mark()
        if step == warmup + steps:
            window.stop()

    result = train(model, data, kiln_config(batch, precision, device, compile), on_step=on_step)
    m = result.history[-1]
    assert result.global_step >= warmup + steps and window.secs > 0
    out = {
        **window.result(steps),
        "skipped_steps": m.skipped_steps,
        "nonfinite_steps": m.nonfinite_steps,
        "final_loss": m.loss,
    }
    if result.compile is not None:  # a fallback to eager would make the compiled figure meaningless: record it
        out["compile"] = result.compile
    return out


def interleaved(
    name: str,
    spec: dict[str, Any],
    data: DatasetSplits,
    precision: str,
    device: torch.device,
    steps: int,
    windows: int,
    compile: bool,
) -> dict[str, Any]:
    """Kiln's loop and the bare loop in alternating timed windows of ``steps`` steps, in one process.

    Kiln trains ``windows + 1`` epochs of ``steps + 1`` batches (``data``); the first is its warm-up (compilation
    included). At the end of it the bare loop is set up and warmed up (compiled) too, after Kiln compiled, and what
    its compilation adds to Dynamo's process-wide counters is taken off Kiln's. In every later epoch Kiln's window
    runs from its first step's ``on_step`` (after the epoch boundary) to its last, and then the bare loop runs one
    untimed step and a window of ``steps``. So the two alternate K, B, K, B, ... and a drift of the host's speed
    (the steps are close to host-bound) reaches both alike, where separate runs minutes apart measured it as a
    difference between the loops (single runs varied by up to 30% on the H200)."""
    batch, per_epoch = spec["batch"], steps + 1
    if compile:
        torch.compiler.reset()  # graphs of this cell only (see the module docstring)
    bare: BareLoop | None = None
    bare_counts: dict[str, Any] = {}
    window = Window(device)
    kiln_w: list[dict[str, Any]] = []
    bare_w: list[dict[str, Any]] = []

    def on_step(step: int) -> None:
        nonlocal bare, bare_counts, window
        epoch, k = divmod(step - 1, per_epoch)  # k: 0-based step within the epoch
        last = k == per_epoch - 1
        if epoch == 0:
            if last:
                before = CompileCounts.now()
                bare = BareLoop(fresh_model(name, spec), data, batch, precision, device, compile)
                for _ in range(per_epoch):
                    bare.step()
                bare_counts = CompileCounts.now().since(before)
            return
        if k == 0:
            window = Window(device, "kiln")
            window.start()
            return
        window.mark()
        if last:
            window.stop()
            kiln_w.append(window.result(steps))
            assert bare is not None
            bare.step()
            bare_w.append(bare.window(steps, device))

    result = train(
        fresh_model(name, spec), data, kiln_config(batch, precision, device, compile, windows + 1), on_step=on_step
    )
    assert bare is not None
    bare.model.to("cpu")
    c = result.compile
    if c is not None:  # Dynamo's counters are process-wide: what the bare loop's compile added is not Kiln's
        c = {**c, **{k: c[k] - bare_counts[k] for k in ("graphs", "recompiles", "graph_breaks")}}
    return {
        "kiln": kiln_w,
        "bare": bare_w,
        "compile": c,
        "update_graph": result.update_graph,
        "skipped_steps": sum(h.skipped_steps for h in result.history),
        "nonfinite_steps": sum(h.nonfinite_steps for h in result.history),
        "final_loss": result.history[-1].loss,
    }


LOOP_FNS = {
    "bare": (bare_loop, False),
    "kiln": (kiln_loop, False),
    "bare_compiled": (bare_loop, True),
    "kiln_compiled": (kiln_loop, True),
}


def measure(
    name: str,
    spec: dict[str, Any],
    data: DatasetSplits,
    precision: str,
    device: torch.device,
    warmup: int,
    steps: int,
    rounds: int,
) -> dict[str, Any]:
    """The eager table's cell: ``rounds`` runs of each loop, rotating which goes first; medians plus every round."""
    runs: dict[str, list[dict[str, Any]]] = {which: [] for which in EAGER_LOOPS}
    for r in range(rounds):
        for which in EAGER_LOOPS[r % 2 :] + EAGER_LOOPS[: r % 2]:
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            fn, _ = LOOP_FNS[which]
            runs[which].append(fn(fresh_model(name, spec), data, spec["batch"], precision, device, warmup, steps))
    row: dict[str, Any] = {"model": name, "batch": spec["batch"], "precision": precision}
    for which, rs in runs.items():
        c = dict(rs[-1])
        c["steps_per_s"] = statistics.median(x["steps_per_s"] for x in rs)
        c["peak_mb"] = max(x["peak_mb"] for x in rs) if device.type == "cuda" else None
        c["rounds_steps_per_s"] = [round(x["steps_per_s"], 3) for x in rs]
        if which == "kiln":
            c["skipped_steps"] = sum(x["skipped_steps"] for x in rs)
            c["nonfinite_steps"] = sum(x["nonfinite_steps"] for x in rs)
        row[which] = c
    row["kiln_vs_bare"] = row["kiln"]["steps_per_s"] / row["bare"]["steps_per_s"]
    return row


def bench_device(smoke: bool) -> torch.device:
    device = torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = True  # Kiln turns it on too (non-deterministic mode)
    return device


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(0) if device.type == "cuda" else platform.processor() or "cpu"


def run(smoke: bool, warmup: int, steps: int, rounds: int) -> dict[str, Any]:
    device = bench_device(smoke)
    rows = []
    for name, spec in specs(smoke).items():
        data = make_data(spec, warmup + steps)  # one epoch: Kiln's timed window has no epoch boundary
        for precision in PRECISIONS:
            log.info("%s %s", name, precision)
            row = measure(name, spec, data, precision, device, warmup, steps, rounds)
            # Both loops hold this on the device during the timed steps: it is part of both peaks.
            row["dataset_mb"] = round((data.train_x.nbytes + data.train_y.nbytes) / 2**20, 1)
            rows.append(row)
    for r in rows:
        base = next(b for b in rows if b["model"] == r["model"] and b["precision"] == "fp32")
        r["speedup_vs_fp32"] = {k: r[k]["steps_per_s"] / base[k]["steps_per_s"] for k in ("bare", "kiln")}
    return {
        "device": device_name(device),
        "torch": torch.__version__,
        "smoke": smoke,
        "tf32": False,
        "timed_steps": steps,
        "warmup_steps": warmup,
        "rounds": rounds,
        "rows": rows,
        "targets": targets(rows),
    }


def cell(windows: list[dict[str, Any]]) -> dict[str, Any]:
    """Median steps/s and step peak over a loop's windows, and every window's figure."""
    peaks = [w["step_peak_mb"] for w in windows if w["step_peak_mb"] is not None]
    return {
        "steps_per_s": statistics.median(w["steps_per_s"] for w in windows),
        "step_peak_mb": max(peaks) if peaks else None,
        "windows_steps_per_s": [round(w["steps_per_s"], 3) for w in windows],
        "host_step_ms_p50": statistics.median(w["step_ms"]["p50"] for w in windows if "step_ms" in w),
        # Python's garbage collections inside the windows: host time neither loop's code accounts for
        "gc_ms_per_window": [w.get("gc_ms", 0.0) for w in windows],
        "gc_collections_per_window": [w.get("gc_collections", 0) for w in windows],
    }


def paired_ratio(kiln: list[dict[str, Any]], bare: list[dict[str, Any]]) -> float:
    """Median over the window pairs of Kiln's steps/s over the bare loop's in the window right after it."""
    return statistics.median(k["steps_per_s"] / b["steps_per_s"] for k, b in zip(kiln, bare))


def ratio_interval(
    kiln_sps: list[float], bare_sps: list[float], resamples: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """95% bootstrap interval of :func:`paired_ratio`'s median (window pairs resampled with replacement; a fixed
    seed, so the same windows give the same interval). On a host whose per-window ratios spread by +-15%, a median
    of 8-16 pairs moves by a few percent between runs; the interval says how far, next to a 3% target."""
    ratios = [k / b for k, b in zip(kiln_sps, bare_sps)]
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def cell_interval(row: dict[str, Any], suffix: str) -> tuple[float, float]:
    return ratio_interval(row["kiln" + suffix]["windows_steps_per_s"], row["bare" + suffix]["windows_steps_per_s"])


def measure_compile(
    name: str,
    spec: dict[str, Any],
    data: DatasetSplits,
    precision: str,
    device: torch.device,
    steps: int,
    windows: int,
    profile_steps: int = 0,
) -> dict[str, Any]:
    """One cell of the compile table: eager Kiln vs eager bare, then compiled Kiln vs compiled bare, each pair
    interleaved (:func:`interleaved`)."""
    row: dict[str, Any] = {"model": name, "batch": spec["batch"], "precision": precision}
    for compile in (False, True):
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        got = interleaved(name, spec, data, precision, device, steps, windows, compile)
        suffix = "_compiled" if compile else ""
        if Phases.enabled:
            row["phases" + suffix] = Phases.take()
        row["kiln" + suffix] = {
            **cell(got["kiln"]),
            "skipped_steps": got["skipped_steps"],
            "nonfinite_steps": got["nonfinite_steps"],
            "final_loss": got["final_loss"],
            "update_graph": got["update_graph"],
        }
        row["bare" + suffix] = cell(got["bare"])
        row[f"kiln{suffix}_vs_bare{suffix}"] = paired_ratio(got["kiln"], got["bare"])
        row[f"kiln{suffix}_vs_bare{suffix}_ci95"] = cell_interval(row, suffix)
        if compile:
            c = got["compile"]
            row["kiln_compiled"]["compile"] = c
            row["kiln_compiled"]["fallbacks"] = [c["fallback"]] if c and c["fallback"] else []
    if profile_steps:  # one more run per compiled loop, profiled, apart from the interleaved windows
        Window.profile = True
        try:
            for which in ("kiln_compiled", "bare_compiled"):
                torch.compiler.reset()
                fn, _ = LOOP_FNS[which]
                warmup = 8  # compilation included
                r = fn(
                    fresh_model(name, spec),
                    make_data(spec, warmup + profile_steps),
                    spec["batch"],
                    precision,
                    device,
                    warmup,
                    profile_steps,
                    compile=True,
                )
                row.setdefault("profile", {})[which] = r["profile"]
        finally:
            Window.profile = False
    row["compile_gain_kiln"] = row["kiln_compiled"]["steps_per_s"] / row["kiln"]["steps_per_s"]
    row["compile_gain_bare"] = row["bare_compiled"]["steps_per_s"] / row["bare"]["steps_per_s"]
    row["compile_gain_anchor"] = ANCHOR_GAIN.get((name, precision))
    return row


def run_compile(
    smoke: bool,
    steps: int,
    windows: int,
    models: list[str] | None,
    precisions: tuple[str, ...],
    profile_steps: int = 0,
    partial: Path | None = None,
) -> dict[str, Any]:
    """The torch.compile table: Kiln and bare loops, eager and compiled, per model and precision."""
    device = bench_device(smoke)
    rows, notes = [], []
    for name, spec in specs(smoke, compile_table=True).items():
        if models is not None and name not in models:
            continue
        if spec["model"] == "hf_bert":
            if not has_transformers():
                notes.append(f"{name}: skipped, transformers does not import (pip install 'kiln[bench]')")
                continue
            import transformers

            attention = fresh_model(name, spec).bert.config._attn_implementation
            notes.append(f"{name}: transformers {transformers.__version__}, attention implementation {attention}")
        data = make_data(spec, steps + 1)  # one epoch: an untimed first step and one timed window
        for precision in precisions:
            log.info("%s %s (compile)", name, precision)
            row = measure_compile(name, spec, data, precision, device, steps, windows, profile_steps)
            row["dataset_mb"] = round((data.train_x.nbytes + data.train_y.nbytes) / 2**20, 1)
            rows.append(row)
            if partial is not None:  # a run cut short by a time limit keeps the cells it finished
                partial.write_text(json.dumps(rows, indent=2) + "\n")
    return {
        "device": device_name(device),
        "torch": torch.__version__,
        "smoke": smoke,
        "tf32": False,
        "timed_steps": steps,
        "windows": windows,
        "update_graph": UPDATE_GRAPH["setting"],
        "rows": rows,
        "notes": notes,
        "targets": compile_targets(rows),
    }


def compile_targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Kiln compiled >= 0.97x the bare compiled loop in every cell, and no run fell back to eager."""
    ratios = [r["kiln_compiled_vs_bare_compiled"] for r in rows]
    return {
        "kiln_compiled_at_least_0.97x_bare_compiled": bool(ratios) and all(v >= 0.97 for v in ratios),
        "worst_kiln_compiled_vs_bare_compiled": round(min(ratios), 3) if ratios else None,
        "fallbacks": sum(len(r["kiln_compiled"]["fallbacks"]) for r in rows),
    }


def compile_markdown(res: dict[str, Any]) -> str:
    mb = lambda v: "-" if v is None else f"{v:,.0f}"  # noqa: E731
    lines = [
        f"# Training throughput with torch.compile: Kiln vs bare loop ({res['device']}, torch {res['torch']})",
        "",
        f"Per cell and mode (eager, compiled), Kiln's loop and the bare loop alternate in {res['windows']} pairs of "
        f"timed windows of {res['timed_steps']} steps in one process, after one warm-up epoch each (compilation "
        "included); steps/s are medians over the windows, Kiln / bare the median of the pairs' ratios "
        "[its 95% bootstrap "
        "interval over the pairs]. TF32 off; "
        "synthetic data on the device. Compiled gain = compiled / eager steps/s; anchor = the bare loop's gain "
        "measured for issue 16. Step peak = peak memory above what was allocated when the window began.",
        "",
        "| model | batch | precision | Kiln eager | bare eager | Kiln compiled | bare compiled "
        "| Kiln / bare, compiled | Kiln / bare, eager | compiled gain Kiln | compiled gain bare | anchor gain "
        "| graphs / recompiles / breaks | step peak MB Kiln eager / compiled |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        k, kc, b, bc = r["kiln"], r["kiln_compiled"], r["bare"], r["bare_compiled"]
        c = kc.get("compile") or {"graphs": "-", "recompiles": "-", "graph_breaks": "-"}
        anchor = f"{r['compile_gain_anchor']:.2f}x" if r.get("compile_gain_anchor") else "-"
        ci = r.get("kiln_compiled_vs_bare_compiled_ci95")  # absent in results written before it was added
        interval = f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else ""
        lines.append(
            f"| {r['model']} | {r['batch']} | {r['precision']} | {k['steps_per_s']:.2f} | {b['steps_per_s']:.2f} | "
            f"{kc['steps_per_s']:.2f} | {bc['steps_per_s']:.2f} | "
            f"{r['kiln_compiled_vs_bare_compiled']:.3f}{interval} | "
            f"{r['kiln_vs_bare']:.3f} | {r['compile_gain_kiln']:.2f}x | {r['compile_gain_bare']:.2f}x | {anchor} | "
            f"{c['graphs']} / {c['recompiles']} / {c['graph_breaks']} | "
            f"{mb(k['step_peak_mb'])} / {mb(kc['step_peak_mb'])} |"
        )
    t = res["targets"]
    lines += [
        "",
        f"- Kiln compiled vs bare compiled, worst cell: {t['worst_kiln_compiled_vs_bare_compiled']} "
        f"(target >= 0.97: {'met' if t['kiln_compiled_at_least_0.97x_bare_compiled'] else 'NOT met'})",
        f"- runs that fell back to eager: {t['fallbacks']}",
    ]
    if "update_graph" in res:  # absent in results written before train.update_graph existed
        graphed = [
            f"{r['model']} {r['precision']}{'' if mode == 'kiln' else ' compiled'}"
            for r in res["rows"]
            for mode in ("kiln", "kiln_compiled")
            if (r[mode].get("update_graph") or {}).get("captured")
        ]
        lines.append(
            f"- Kiln's train.update_graph: {res['update_graph']}; the update ran as one CUDA graph in "
            f"{len(graphed)} of {2 * len(res['rows'])} Kiln runs"
        )
    lines += [f"- {n}" for n in res.get("notes", [])]
    phased = [r for r in res["rows"] if r.get("phases")]
    if phased:
        parts = ("data", "forward", "loss_backward", "tail", "between")
        lines += [
            "",
            "Host ms per part of a step, median over the timed steps (`--phases`; Kiln's batch is taken in `between`):",
            "",
            "| model | precision | mode | loop | " + " | ".join(parts) + " | sum |",
            "|---|---|---|---|" + "---|" * (len(parts) + 1),
        ]
        for r in phased:
            for mode in ("", "_compiled"):
                for loop, got in r.get("phases" + mode, {}).items():
                    cells = [f"{got[p]:.3f}" if p in got else "-" for p in parts]
                    lines.append(
                        f"| {r['model']} | {r['precision']} | {mode.strip('_') or 'eager'} | {loop} | "
                        + " | ".join(cells)
                        + f" | {sum(got.values()):.3f} |"
                    )
    profiled = [r for r in res["rows"] if r.get("profile")]
    if profiled:
        lines += [
            "",
            "Profiled runs (torch.profiler, per step; not part of the medians):",
            "",
            "| model | precision | loop | wall ms | GPU kernel ms | GPU busy | kernels | sync calls "
            "| busiest host op |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in profiled:
            for loop, pr in r["profile"].items():
                sync_calls = ", ".join(f"{k} {v}" for k, v in pr["sync_calls"].items()) or "-"
                top = pr["top_host_ms"][0] if pr["top_host_ms"] else ["-", 0, 0]
                lines.append(
                    f"| {r['model']} | {r['precision']} | {loop} | {pr['wall_ms']:.2f} | {pr['gpu_kernel_ms']:.2f} "
                    f"| {pr['gpu_busy']:.2f} | {pr['kernels']:.0f} | {sync_calls} | {top[0]} {top[1]:.2f} ms |"
                )
    return "\n".join(lines) + "\n"


def targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Each AMP mode judged on its own: the issue's 2.8x is not met by one mode beating it."""
    amp = [r for r in rows if r["model"] == "bert_base" and r["precision"] != "fp32"]
    speed = {r["precision"]: round(r["speedup_vs_fp32"]["kiln"], 2) for r in amp}
    return {
        "encoder_amp_speedup_kiln": speed,
        "encoder_amp_at_least_2.8x": {p: v >= 2.8 for p, v in speed.items()},
        "kiln_within_5pct_of_bare": all(r["kiln_vs_bare"] >= 0.95 for r in rows),
        "worst_kiln_vs_bare": round(min(r["kiln_vs_bare"] for r in rows), 3),
    }


def markdown(res: dict[str, Any]) -> str:
    mb = lambda v: "-" if v is None else f"{v:,.0f}"  # noqa: E731
    lines = [
        f"# Training throughput: Kiln loop vs bare loop ({res['device']}, torch {res['torch']})",
        "",
        f"{res['warmup_steps']} warm-up + {res['timed_steps']} timed steps per run, median of "
        f"{res['rounds']} runs per loop in alternating order; TF32 off; synthetic data on the device "
        "(in both peaks: "
        + ", ".join(dict.fromkeys(f"{r['model']} {r['dataset_mb']:,.0f} MB" for r in res["rows"]))
        + ").",
        "",
        "| model | batch | precision | bare steps/s | Kiln steps/s | Kiln / bare | AMP speedup (bare) "
        "| AMP speedup (Kiln) | peak MB bare | peak MB Kiln |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        lines.append(
            f"| {r['model']} | {r['batch']} | {r['precision']} | {r['bare']['steps_per_s']:.2f} | "
            f"{r['kiln']['steps_per_s']:.2f} | {r['kiln_vs_bare']:.3f} | "
            f"{r['speedup_vs_fp32']['bare']:.2f}x | {r['speedup_vs_fp32']['kiln']:.2f}x | "
            f"{mb(r['bare']['peak_mb'])} | {mb(r['kiln']['peak_mb'])} |"
        )
    t = res["targets"]
    amp = ", ".join(
        f"{p} {v:.2f}x ({'met' if t['encoder_amp_at_least_2.8x'][p] else 'NOT met'})"
        for p, v in t["encoder_amp_speedup_kiln"].items()
    )
    lines += [
        "",
        f"- encoder AMP speedup over FP32 through Kiln, target >= 2.8x each: {amp}",
        f"- Kiln vs bare loop, worst cell: {t['worst_kiln_vs_bare']} "
        f"(target >= 0.95: {'met' if t['kiln_within_5pct_of_bare'] else 'NOT met'})",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="folder for the results (required unless --intervals)")
    ap.add_argument("--smoke", action="store_true", help="tiny models on CPU")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps per run (default 8; smoke 2)")
    ap.add_argument(
        "--steps",
        type=int,
        default=None,
        help="timed steps per run (default 48; smoke 2); --compile: per window (default 24; smoke 2)",
    )
    ap.add_argument("--rounds", type=int, default=None, help="runs per loop and cell (default 5; smoke 2)")
    ap.add_argument(
        "--windows", type=int, default=None, help="--compile: window pairs per cell and mode (default 8; smoke 2)"
    )
    ap.add_argument(
        "--compile", action="store_true", help="the torch.compile table (Kiln and bare, eager and compiled)"
    )
    ap.add_argument(
        "--models", default=None, help="--compile: comma-separated subset of bert_base,bert_base_hf,resnet18"
    )
    ap.add_argument("--precisions", default=",".join(COMPILE_PRECISIONS), help="--compile: fp16,bf16 or one of them")
    ap.add_argument("--profile-steps", type=int, default=0, help="--compile: one profiled run per compiled loop")
    ap.add_argument(
        "--update-graph",
        choices=("auto", "off"),
        default="auto",
        help="Kiln's train.update_graph in every Kiln run (auto: as configured by default)",
    )
    ap.add_argument(
        "--phases",
        action="store_true",
        help="--compile: host ms per part of the step (forward, loss+backward, tail, between), both loops",
    )
    ap.add_argument(
        "--intervals",
        type=Path,
        nargs="+",
        metavar="JSON",
        help="print Kiln / bare with its 95%% interval for saved --compile results, and exit",
    )
    args = ap.parse_args()
    if args.intervals:
        for path in args.intervals:
            for r in json.loads(path.read_text())["rows"]:
                for suffix in ("_compiled", ""):
                    lo, hi = cell_interval(r, suffix)
                    print(
                        f"{path.name} {r['model']} {r['precision']} {suffix.strip('_') or 'eager'}: "
                        f"{r[f'kiln{suffix}_vs_bare{suffix}']:.3f} [{lo:.3f}, {hi:.3f}]"
                    )
        return
    if args.out is None:
        ap.error("--out is required")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("kiln.train").setLevel(logging.WARNING)
    args.out.mkdir(parents=True, exist_ok=True)
    UPDATE_GRAPH["setting"] = args.update_graph
    if args.compile:
        if args.phases:
            Phases.enabled = True
            instrument_kiln()
        models = args.models.split(",") if args.models else None
        unknown = sorted(set(models or []) - set(specs(True, compile_table=True)))
        if unknown:
            ap.error(f"--models: unknown {', '.join(unknown)}; choose from bert_base, bert_base_hf, resnet18")
        name = "train_compile" + ("_smoke" if args.smoke else "") + ("_" + "_".join(models) if models else "")
        steps, windows = args.steps or (2 if args.smoke else 24), args.windows or (2 if args.smoke else 8)
        res = run_compile(
            args.smoke,
            steps,
            windows,
            models,
            tuple(args.precisions.split(",")),
            args.profile_steps,
            args.out / f"{name}.partial.json",
        )
        write_report(args.out, name, res, compile_markdown(res))
        return
    warmup, steps = args.warmup or (2 if args.smoke else 8), args.steps or (2 if args.smoke else 48)
    rounds = args.rounds or (2 if args.smoke else 5)
    res = run(args.smoke, warmup, steps, rounds)
    write_report(args.out, "train_smoke" if args.smoke else "train", res, markdown(res))


if __name__ == "__main__":
    main()
