"""Training throughput: Kiln's training loop vs a bare minimal loop, fp32 / fp16 / bf16, in one run.

Models (random weights, synthetic data already on the GPU): a BERT-base-shaped encoder (12 layers, hidden 768,
seq 128) at batch 64 and a ResNet-18-shaped CNN (3x224x224) at batch 128. Both loops do the same work per
step: autocast forward, FP32 loss, (scaled) backward, unscale, clip to norm 1.0, fused AdamW step, scaler
update, zero_grad(set_to_none). TF32 is off for both (FP32 means FP32), cuDNN autotuning on for both.

* bare: that step in a Python for-loop over device-resident batches, nothing else.
* kiln: ``stages.train.loop.train`` with ``loader.on_device`` (DataLoader + DistributedSampler + gather),
  its per-step sync for the loss/NaN check, metrics and schedule. Steps/s comes from Kiln's own per-epoch
  samples/s of the epochs after the first (the first epoch is the warm-up); validation is excluded there.

Peak memory is ``torch.cuda.max_memory_allocated`` over the timed steps (both hold the same dataset on the GPU).
Writes <out>/train.json and <out>/train.md.

    PYTHONPATH=/tmp/site:$PWD python benchmarks/train_bench.py --out $OUT     # GPU host, ~1-2 minutes
    python benchmarks/train_bench.py --smoke --out /tmp/train_bench          # tiny models on CPU, seconds
"""
from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models.datasets import DatasetSplits  # noqa: E402
from models.registry import build_model  # noqa: E402
from stages.train.config import TrainConfig  # noqa: E402
from stages.train.loop import train  # noqa: E402

log = logging.getLogger("bench")
PRECISIONS = ("fp32", "fp16", "bf16")
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def specs(smoke: bool) -> dict[str, dict[str, Any]]:
    """name -> model params, batch, sample shape, classes."""
    if smoke:
        return {"bert_base": {"params": {"layers": 1, "dim": 64, "heads": 4, "ffn": 128, "in_features": 64,
                                         "seq_len": 16}, "batch": 8, "shape": (16, 64), "classes": 2},
                "resnet18": {"params": {"width": 8, "blocks": (1, 1), "num_classes": 10}, "batch": 8,
                             "shape": (3, 32, 32), "classes": 10}}
    return {"bert_base": {"params": {}, "batch": 64, "shape": (128, 768), "classes": 2},
            "resnet18": {"params": {}, "batch": 128, "shape": (3, 224, 224), "classes": 1000}}


def make_data(spec: dict[str, Any], batches: int, seed: int = 0) -> DatasetSplits:
    g = torch.Generator().manual_seed(seed)
    n = spec["batch"] * batches
    x = torch.randn((n, *spec["shape"]), generator=g)
    y = torch.randint(0, spec["classes"], (n,), generator=g)
    return DatasetSplits(x, y, x[: spec["batch"]], y[: spec["batch"]], spec["classes"], "synthetic")


def fresh_model(name: str, spec: dict[str, Any]) -> nn.Module:
    torch.manual_seed(0)
    return build_model(name, spec["params"])


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bare_loop(model: nn.Module, data: DatasetSplits, batch: int, precision: str, device: torch.device,
              warmup: int, steps: int) -> dict[str, float]:
    """The minimal AMP step, nothing around it."""
    model.to(device).train()
    x, y = data.train_x.to(device), data.train_y.to(device)
    nb = len(x) // batch
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    ctx = (lambda: torch.autocast(device.type, dtype=DTYPES[precision])) if precision != "fp32" else nullcontext

    def step(i: int) -> None:
        xb, yb = x[(i % nb) * batch:(i % nb + 1) * batch], y[(i % nb) * batch:(i % nb + 1) * batch]
        with ctx():
            logits = model(xb)
        loss = nn.functional.cross_entropy(logits.float(), yb)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    for i in range(warmup):
        step(i)
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    for i in range(steps):
        step(warmup + i)
    sync(device)
    secs = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    model.to("cpu")
    return {"steps_per_s": steps / secs, "peak_mb": peak}


def kiln_loop(model: nn.Module, data: DatasetSplits, batch: int, precision: str, device: torch.device,
              epochs: int) -> dict[str, Any]:
    """Kiln's loop: epoch 1 warms up, epochs 2.. are timed by Kiln's own metrics."""
    cfg = TrainConfig.model_validate({
        "epochs": epochs, "batch_size": batch, "precision": precision, "device": device.type, "lr": 1e-4,
        "grad_clip": 1.0, "optimizer": "adamw", "schedule": "constant", "eval_every": 10_000, "plot": False,
        "loader": {"on_device": True}, "checkpoint": {"resume": "never"}})
    result = train(model, data, cfg)
    timed = result.history[1:]
    secs = sum(len(data.train_x) / m.samples_per_s for m in timed)
    steps = sum(m.steps for m in timed)
    peak = max(m.peak_memory_mb or 0 for m in timed) if device.type == "cuda" else None
    return {"steps_per_s": steps / secs, "peak_mb": peak, "skipped_steps": sum(m.skipped_steps for m in timed),
            "final_loss": result.history[-1].loss}


def run(smoke: bool, batches: int, epochs: int) -> dict[str, Any]:
    device = torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = True  # Kiln turns it on too (non-deterministic mode)
    rows = []
    for name, spec in specs(smoke).items():
        data = make_data(spec, batches)
        for precision in PRECISIONS:
            log.info("%s %s", name, precision)
            bare = bare_loop(fresh_model(name, spec), data, spec["batch"], precision, device,
                             warmup=batches, steps=batches * (epochs - 1))
            kiln = kiln_loop(fresh_model(name, spec), data, spec["batch"], precision, device, epochs)
            rows.append({"model": name, "batch": spec["batch"], "precision": precision, "bare": bare, "kiln": kiln,
                         "kiln_vs_bare": kiln["steps_per_s"] / bare["steps_per_s"]})
            if device.type == "cuda":
                torch.cuda.empty_cache()
    for r in rows:
        base = next(b for b in rows if b["model"] == r["model"] and b["precision"] == "fp32")
        r["speedup_vs_fp32"] = {k: r[k]["steps_per_s"] / base[k]["steps_per_s"] for k in ("bare", "kiln")}
    return {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "smoke": smoke, "tf32": False, "timed_steps": batches * (epochs - 1),
            "warmup_steps": batches, "rows": rows, "targets": targets(rows)}


def targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    amp = [r for r in rows if r["model"] == "bert_base" and r["precision"] != "fp32"]
    return {"encoder_amp_speedup_kiln": {r["precision"]: round(r["speedup_vs_fp32"]["kiln"], 2) for r in amp},
            "encoder_amp_at_least_2.8x": any(r["speedup_vs_fp32"]["kiln"] >= 2.8 for r in amp),
            "kiln_within_5pct_of_bare": all(r["kiln_vs_bare"] >= 0.95 for r in rows),
            "worst_kiln_vs_bare": round(min(r["kiln_vs_bare"] for r in rows), 3)}


def markdown(res: dict[str, Any]) -> str:
    mb = lambda v: "-" if v is None else f"{v:,.0f}"  # noqa: E731
    lines = [f"# Training throughput: Kiln loop vs bare loop ({res['device']}, torch {res['torch']})", "",
             f"{res['warmup_steps']} warm-up + {res['timed_steps']} timed steps per cell; TF32 off; "
             "synthetic data on the device.", "",
             "| model | batch | precision | bare steps/s | Kiln steps/s | Kiln / bare | AMP speedup (bare) "
             "| AMP speedup (Kiln) | peak MB bare | peak MB Kiln |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['model']} | {r['batch']} | {r['precision']} | {r['bare']['steps_per_s']:.2f} | "
                     f"{r['kiln']['steps_per_s']:.2f} | {r['kiln_vs_bare']:.3f} | "
                     f"{r['speedup_vs_fp32']['bare']:.2f}x | {r['speedup_vs_fp32']['kiln']:.2f}x | "
                     f"{mb(r['bare']['peak_mb'])} | {mb(r['kiln']['peak_mb'])} |")
    t = res["targets"]
    lines += ["", f"- encoder AMP speedup through Kiln: {t['encoder_amp_speedup_kiln']} "
                  f"(target >= 2.8x: {'met' if t['encoder_amp_at_least_2.8x'] else 'NOT met'})",
              f"- Kiln vs bare loop, worst cell: {t['worst_kiln_vs_bare']} "
              f"(target >= 0.95: {'met' if t['kiln_within_5pct_of_bare'] else 'NOT met'})"]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--smoke", action="store_true", help="tiny models on CPU")
    ap.add_argument("--batches", type=int, default=None, help="batches per epoch (default 8; smoke 2)")
    ap.add_argument("--epochs", type=int, default=None, help="epochs; the first is warm-up (default 5; smoke 2)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("kiln.train").setLevel(logging.WARNING)
    res = run(args.smoke, args.batches or (2 if args.smoke else 8), args.epochs or (2 if args.smoke else 5))
    args.out.mkdir(parents=True, exist_ok=True)
    name = "train_smoke" if args.smoke else "train"
    (args.out / f"{name}.json").write_text(json.dumps(res, indent=2) + "\n")
    md = markdown(res)
    (args.out / f"{name}.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
