"""Why did ``aoti_load_package`` segfault on the GPU host (issue 12)? Load one AOTInductor package in child
processes that differ in one thing each, and record how each ended.

The package: a small CNN (or ``--model resnet18`` from Kiln's zoo), FP16 on CUDA, built here with
``torch.export`` + ``torch._inductor.aoti_compile_and_package`` (no max-autotune: minutes saved, same loader).
Children: ``plain`` (this environment as is), ``no_pythonpath`` (PYTHONPATH removed: only the interpreter's own
packages), ``after_onnxruntime`` (``import onnxruntime`` first, as in a Kiln process that also serves ONNX
engines), ``copied`` (the package copied to a fresh folder first). Each child loads the package and runs it
once; its exit code (a negative number is the signal that killed it) and the tail of its stderr are written to
``<out>/aoti_probe.json``.

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/aoti_probe.py --out $OUT [--model resnet18]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

CHILD = """
import sys, time
import torch
{pre}
from torch._inductor import aoti_load_package
t0 = time.perf_counter()
runner = aoti_load_package(sys.argv[1])
x = torch.randn({shape}, device="cuda", dtype=torch.float16)
out = runner(x)
torch.cuda.synchronize()
print("ok", tuple(out[0].shape if isinstance(out, (list, tuple)) else out.shape), round(time.perf_counter() - t0, 2))
"""


def small_cnn() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(16, 10),
    )


def build(model_name: str, folder: Path) -> tuple[Path, tuple[int, ...]]:
    if model_name == "resnet18":
        from kiln.models.registry import build_model

        model, shape = build_model("resnet18", {}), (2, 3, 224, 224)
    else:
        model, shape = small_cnn(), (2, 3, 32, 32)
    model = model.eval().cuda().half()
    x = torch.randn(shape, device="cuda", dtype=torch.float16)
    exported = torch.export.export(model, (x,))
    path = folder / "model.pt2"
    t0 = time.perf_counter()
    torch._inductor.aoti_compile_and_package(exported, package_path=str(path))
    print(f"built {path} in {time.perf_counter() - t0:.1f} s", flush=True)
    return path, shape


def child(name: str, package: Path, shape: tuple[int, ...], folder: Path) -> dict[str, object]:
    env = dict(os.environ)
    pre = ""
    if name == "no_pythonpath":
        env.pop("PYTHONPATH", None)
    elif name == "after_onnxruntime":
        pre = "import onnxruntime"
    elif name == "copied":
        fresh = folder / "copy"
        fresh.mkdir(exist_ok=True)
        package = Path(shutil.copy2(package, fresh / package.name))
    code = CHILD.format(pre=pre, shape=shape)
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", code, str(package)], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    return {
        "child": name,
        "returncode": proc.returncode,
        "seconds": round(time.perf_counter() - t0, 1),
        "stdout": proc.stdout.strip()[-300:],
        "stderr_tail": proc.stderr.strip()[-1500:],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="small", choices=["small", "resnet18"])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: needs a CUDA GPU\nfix: run it on the GPU host")
    args.out.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="aoti-probe-"))
    package, shape = build(args.model, folder)
    results = [child(n, package, shape, folder) for n in ("plain", "no_pythonpath", "after_onnxruntime", "copied")]
    for r in results:
        print(f"{r['child']}: rc {r['returncode']} {r['stdout']} {r['stderr_tail'][-200:]}", flush=True)
    report = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0),
        "model": args.model,
        "package_bytes": package.stat().st_size,
        "pythonpath": os.environ.get("PYTHONPATH"),
        "children": results,
    }
    (args.out / f"aoti_probe_{args.model}.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
