"""Wall time from a config to an engine, stage by stage: `kiln run` from a cold workdir on models nobody here wrote
for Kiln, a `transformers` BERT-base classifier (input_ids + attention_mask, seq 128) and a ResNet-18 (written
below), with training off and validation at batch 1 and 32. Beside it, `kiln optimize` alone on the run's raw
export against onnxsim on the same file (the reference for the graph optimizer's time).

On the CPU (default) the engines are ONNX Runtime FP32; with `--gpu` (the GPU host) the torch FP16 engine on CUDA,
with Inductor's cache in a fresh folder per run.

    python benchmarks/time_to_engine.py --models hf_bert,resnet18 --out benchmarks/results
    PYTHONPATH=/tmp/site python3 -P benchmarks/time_to_engine.py --gpu --out "$OUT"
    python benchmarks/time_to_engine.py --smoke --out /tmp/tte        # tiny models, seconds

`--profile cprofile` runs `kiln run` under cProfile and keeps `<model>.prof` beside the results (its times are
inflated by the profiler: read the shares, not the seconds); `--profile py-spy` samples it and its subprocesses
(Inductor's compile workers) with py-spy without pausing them, as collapsed stacks in `<model>.pyspy.txt`.
"other" is the run's wall time outside its stages: starting Python, imports, config, hashing the stages' outputs,
the report.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_report  # noqa: E402

MODELS_PY = '''
"""The benchmark's models and data, as a user's project would hold them."""
import torch
from torch import nn

from kiln import DatasetSplits


class HFBertClassifier(nn.Module):
    def __init__(self, layers: int = 12, hidden: int = 768, heads: int = 12, ffn: int = 3072) -> None:
        from transformers import BertConfig, BertModel

        super().__init__()
        config = BertConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                            intermediate_size=ffn, vocab_size=30522, max_position_embeddings=512)
        self.bert = BertModel(config, add_pooling_layer=True)
        self.head = nn.Linear(hidden, 2)

    def forward(self, input_ids, attention_mask):
        return self.head(self.bert(input_ids=input_ids, attention_mask=attention_mask).pooler_output)


def hf_bert(**params) -> nn.Module:
    return HFBertClassifier(**params)


def bert_data(rows: int = 64, seq: int = 128) -> DatasetSplits:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 30000, (rows, seq), generator=g)
    mask = torch.ones(rows, seq, dtype=torch.long)
    y = torch.randint(0, 2, (rows,), generator=g)
    x = {"input_ids": ids, "attention_mask": mask}
    half = rows // 2
    return DatasetSplits({k: v[:half] for k, v in x.items()}, y[:half], {k: v[half:] for k, v in x.items()},
                         y[half:], num_classes=2)


class Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.down(x))


def resnet18(width: int = 64, classes: int = 1000) -> nn.Module:
    widths = [width, 2 * width, 4 * width, 8 * width]
    layers = [nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width), nn.ReLU(), nn.MaxPool2d(3, 2, 1)]
    cin = width
    for i, w in enumerate(widths):
        layers += [Block(cin, w, 1 if i == 0 else 2), Block(w, w, 1)]
        cin = w
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes))


def image_data(rows: int = 64, size: int = 224, classes: int = 1000) -> DatasetSplits:
    g = torch.Generator().manual_seed(0)
    x = torch.rand(rows, 3, size, size, generator=g)
    y = torch.randint(0, classes, (rows,), generator=g)
    half = rows // 2
    return DatasetSplits(x[:half], y[:half], x[half:], y[half:], num_classes=classes)
'''


def configs(smoke: bool, gpu: bool, variants: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """model -> its run config (training off; validate at 1 and 32, or 1 and 4 in smoke mode)."""
    small = {"hf_bert": {"layers": 1, "hidden": 64, "heads": 4, "ffn": 128}, "resnet18": {"width": 8, "classes": 10}}
    data = {"hf_bert": {"seq": 16}, "resnet18": {"size": 32, "classes": 10}}
    build = (
        {"backends": ["torch"], "torch": {"devices": ["cuda"]}}
        if gpu
        else {"backends": ["onnxruntime"], "onnxruntime": {"devices": ["cpu"]}}
    )
    out = {}
    for name, data_fn in (("hf_bert", "bert_data"), ("resnet18", "image_data")):
        out[name] = {
            "name": f"tte-{name}",
            "model": {"name": f"tte_models:{name}", "params": small[name] if smoke else {}},
            "data": {"name": f"tte_models:{data_fn}", "params": data[name] if smoke else {}},
            "train": {"enabled": False},
            "precision": {"variants": variants or ["fp16" if gpu else "fp32"]},
            "build": build,
            "signature": {"batch_sizes": [1, 4] if smoke else [1, 32]},
            "validate": {"warmup": 3, "iterations": 10},
        }
    return out


def timed(cmd: list[str], cwd: Path, env: dict[str, str]) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    return time.perf_counter() - t0, done


def onnxsim_seconds(src: Path, dst: Path) -> float | None:
    """onnxsim's `simplify` on the same raw export, in a fresh process (None where onnxsim is not installed)."""
    code = textwrap.dedent(f"""
        import onnx, onnxsim, time
        m = onnx.load({str(src)!r})
        t0 = time.perf_counter()
        out, ok = onnxsim.simplify(m)
        print(time.perf_counter() - t0)
        onnx.save(out, {str(dst)!r})
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return float(done.stdout.split()[-1]) if done.returncode == 0 and done.stdout.split() else None


def bytecode_facts() -> dict[str, Any]:
    """Whether this Python writes bytecode and how much of torch's sources has it: without bytecode every process
    compiles the torch modules it imports, which the run's seconds then include (a pip install writes bytecode;
    an image may ship none, and PYTHONDONTWRITEBYTECODE=1 keeps Python from writing it)."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    root = Path(spec.origin).parent if spec and spec.origin else None
    sources = list(root.rglob("*.py")) if root else []
    compiled = sum(1 for p in sources if Path(importlib.util.cache_from_source(str(p))).exists())
    return {"dont_write_bytecode": sys.flags.dont_write_bytecode, "torch_py": len(sources), "torch_pyc": compiled}


def run_model(
    name: str, config: dict[str, Any], folder: Path, gpu: bool, profiler: str | None = None, keep: Path | None = None
) -> dict[str, Any]:
    """`kiln run` from a cold workdir, then `kiln optimize` and onnxsim on its raw export; profiler: "cprofile" or
    "py-spy", whose output goes to ``keep``."""
    kiln = [sys.executable, "-m", "kiln.cli"]  # also where Kiln is installed with `pip --target` (no script)
    run = {
        None: kiln,
        "cprofile": [sys.executable, "-m", "cProfile", "-o", f"{name}.prof", "-m", "kiln.cli"],
        "py-spy": ["py-spy", "record", "--subprocesses", "--nonblocking", "--format", "raw"]
        + ["--rate", "50", "-o", f"{name}.pyspy.txt", "--", *kiln],
    }[profiler]
    env = {k: v for k, v in os.environ.items()}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(folder), env.get("PYTHONPATH")]))
    if gpu:
        env["TORCHINDUCTOR_CACHE_DIR"] = str(folder / f"inductor-{name}")  # cold: no kernels from earlier runs
    (folder / f"{name}.json").write_text(json.dumps(config))
    wall, done = timed([*run, "run", f"{name}.json", "-w", f"wd-{name}", "--quiet"], folder, env)
    row: dict[str, Any] = {"model": name, "kiln_run_s": round(wall, 2), "exit_code": done.returncode}
    for kept in (folder / f"{name}.prof", folder / f"{name}.pyspy.txt"):
        if profiler is not None and keep is not None and kept.exists():
            keep.mkdir(parents=True, exist_ok=True)
            shutil.copy(kept, keep / kept.name)
            row["profile"] = kept.name
    if done.returncode != 0:
        row["error"] = done.stderr[-1500:]
        return row
    report = json.loads((folder / f"wd-{name}" / "report.json").read_text())
    row["stages_s"] = {stage: s["seconds"] for stage, s in report["stages"].items()}
    row["other_s"] = round(wall - sum(s or 0.0 for s in row["stages_s"].values()), 2)
    row["validation_passed"] = report["validation"]["passed"]
    keys = ("name", "passed", "cosine", "top1_agreement", "top1_ties", "failures", "latency_ms", "speedups")
    keys += ("speedup_ci", "flops_per_sample", "precision_share", "roofline")
    row["engines"] = [{k: e.get(k) for k in keys} for e in report["validation"]["engines"]]
    row["baselines"] = [
        {k: b.get(k) for k in ("kind", "device", "latency_ms")} for b in report["validation"]["baselines"]
    ]
    row["timing"], row["peaks"] = report["validation"].get("timing"), report["validation"].get("peaks")
    row["speed_vs_fp32"] = report["validation"].get("speed_vs_fp32")  # INT8/FP8 judged against FP16/FP32 too
    row["dropped"] = report["validation"].get("dropped")
    raw = folder / f"wd-{name}" / "export" / "model.onnx"
    opt_wall, opt = timed([*kiln, "optimize", str(raw), "-o", str(folder / f"{name}.opt.onnx"), "--quiet"], folder, env)
    row["kiln_optimize_s"] = round(opt_wall, 2) if opt.returncode == 0 else None
    sim = onnxsim_seconds(raw, folder / f"{name}.sim.onnx")
    row["onnxsim_s"] = round(sim, 2) if sim is not None else None
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="hf_bert,resnet18", help="comma-separated: hf_bert, resnet18")
    parser.add_argument("--gpu", action="store_true", help="the torch FP16 engine on CUDA (the GPU host)")
    parser.add_argument("--smoke", action="store_true", help="tiny models, seconds (CI)")
    parser.add_argument("--variants", default=None, help="precision.variants, e.g. fp16,fp8 (default: fp16 on the GPU)")
    parser.add_argument("--out", type=Path, default=None, help="folder for time_to_engine.json and .md")
    parser.add_argument("--profile", choices=["cprofile", "py-spy"], help="profile `kiln run`; kept in --out")
    args = parser.parse_args(argv)
    if args.profile == "py-spy" and shutil.which("py-spy") is None:
        parser.error("--profile py-spy needs py-spy on PATH (pip install py-spy)")
    cfgs = configs(args.smoke, args.gpu, args.variants.split(",") if args.variants else None)
    load_before = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "tte_models.py").write_text(MODELS_PY)
        for name in args.models.split(","):
            rows.append(run_model(name, cfgs[name], folder, args.gpu, args.profile, args.out or Path.cwd()))
            print(json.dumps(rows[-1]), flush=True)
    device = "cuda (torch FP16 engine)" if args.gpu else "cpu (ONNX Runtime FP32 engine)"
    result = {
        "benchmark": "time_to_engine",
        "command": "python benchmarks/time_to_engine.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "bytecode": bytecode_facts(),
        "device": device,
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "rows": rows,
    }
    stages = ["train", "export", "optimize", "precision", "build", "validate", "package"]
    lines = [
        "# Time to an engine",
        "",
        f"`{result['command']}`: {device}; {result['machine']['cpus']} CPUs, load average "
        f"{result['load_average_before'][0]} before and {result['load_average_after'][0]} after; torch's bytecode "
        f"for {result['bytecode']['torch_pyc']} of its {result['bytecode']['torch_py']} sources. Seconds, cold "
        "workdir; `kiln optimize` and onnxsim on the run's raw export, each in a fresh process."
        + (f" `kiln run` under {args.profile} (its seconds inflated by the profiler)." if args.profile else ""),
        "",
        "| model | kiln run s | " + " | ".join(stages) + " | other | kiln optimize s | onnxsim s |",
        "|---|---:|" + "---:|" * len(stages) + "---:|---:|---:|",
    ]
    for r in rows:
        cells = [f"{r.get('stages_s', {}).get(s, float('nan')):.1f}" for s in stages]
        lines.append(
            f"| {r['model']} | {r['kiln_run_s']:.1f} | "
            + " | ".join(cells)
            + f" | {r.get('other_s', float('nan')):.1f} | "
            f"{r.get('kiln_optimize_s')} | "
            f"{r.get('onnxsim_s')} |"
        )
    if args.out:
        write_report(args.out, "time_to_engine", result, "\n".join(lines) + "\n")
    else:
        print("\n".join(lines))
    return result


if __name__ == "__main__":
    main()
