"""Why INT8 does not pay on the zoo Transformer on ONNX Runtime CPU: where its FP32 time goes, and how much
faster an INT8 MatMul is at its shapes. One run, side by side (2 threads, batch 8, graph optimisation ALL).

1. Profile Kiln's FP32 graph of the zoo ``transformer`` (8 tokens x 64 wide, 2 layers; random weights: speed
   does not depend on them) with ONNX Runtime's profiler: kernel time per op type, as a share of all kernel time.
2. Chains of 10 MatMuls at the model's shapes (64 rows; 64 -> 64 as in attention, 64 <-> 256 as in the FFN),
   FP32 against ``quantize_dynamic`` INT8 (the scheme Kiln's ORT CPU engine uses for Transformers); time per
   MatMul is the 10-chain minus the 2-chain, over 8, so the fixed per-run cost cancels.
3. The estimate that follows (Amdahl): with a share f of the kernel time in MatMuls made r times faster, the
   run gets 1 / ((1 - f) + f / r) faster. Everything else (LayerNorm, GELU, Softmax, Transpose) stays float.
   It is an estimate, not a bound: ORT also folds each quantized MatMul's bias Add into its kernel, and the
   profiler's per-kernel times leave out the per-run overhead.

    python benchmarks/int8_anatomy.py --out benchmarks/results      # ~1 minute on 2 cores
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling benchmark scripts
from precision_bench import interleaved_latency, optimized, session  # noqa: E402

from kiln.core.cpu_int8 import ask_exact_int8  # noqa: E402
from kiln.models.registry import build_model  # noqa: E402
from kiln.stages.export.torch_export import export_onnx  # noqa: E402

ROWS, THREADS = 64, 2  # batch 8 x 8 tokens


def op_type_shares(model_path: Path, x: np.ndarray, runs: int) -> dict[str, Any]:
    """Kernel time per op type from ORT's profiler (fused nodes count under their fused type)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = THREADS, 1
    ask_exact_int8(opts)  # the INT8 kernels Kiln's own sessions use here (kiln.core.cpu_int8)
    opts.enable_profiling = True
    with tempfile.TemporaryDirectory() as tmp:
        opts.profile_file_prefix = str(Path(tmp) / "prof")
        sess = ort.InferenceSession(str(model_path), opts, providers=["CPUExecutionProvider"])
        feed = {sess.get_inputs()[0].name: x}
        for _ in range(runs):
            sess.run(None, feed)
        events = json.loads(Path(sess.end_profiling()).read_text())
    per_op: dict[str, float] = defaultdict(float)
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            per_op[e["args"]["op_name"]] += e["dur"]
    total = sum(per_op.values())
    return {op: round(us / total, 4) for op, us in sorted(per_op.items(), key=lambda kv: -kv[1])}


def matmul_chain(k: int, width_in: int, width_out: int, rng: np.random.Generator) -> onnx.ModelProto:
    """k MatMuls in a row with constant weights, alternating [w_in, w_out] and [w_out, w_in] (like an FFN's
    two layers), so a per-op time is the mean of the two directions."""
    nodes, inits, cur = [], [], "x"
    for i in range(k):
        a, b = (width_in, width_out) if i % 2 == 0 else (width_out, width_in)
        inits.append(numpy_helper.from_array((rng.standard_normal((a, b)) * 0.1).astype(np.float32), f"w{i}"))
        out = "y" if i == k - 1 else f"t{i}"
        nodes.append(helper.make_node("MatMul", [cur, f"w{i}"], [out], name=f"mm{i}"))
        cur = out
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [ROWS, width_in])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def matmul_speed(work: Path, rounds: int) -> dict[str, Any]:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    rng = np.random.default_rng(0)
    sessions, shapes = {}, {"64x64": (64, 64), "64x256": (64, 256)}
    for shape, (w_in, w_out) in shapes.items():
        for k in (2, 10):
            fp32 = work / f"mm_{shape}_{k}.onnx"
            onnx.save(matmul_chain(k, w_in, w_out, rng), fp32)
            int8 = work / f"mm_{shape}_{k}_int8.onnx"
            quantize_dynamic(str(fp32), str(int8), op_types_to_quantize=["MatMul"], weight_type=QuantType.QInt8)
            sessions[f"{shape} fp32 x{k}"] = session(fp32, THREADS, ["CPUExecutionProvider"])
            sessions[f"{shape} int8 x{k}"] = session(int8, THREADS, ["CPUExecutionProvider"])
    x = np.random.default_rng(1).standard_normal((ROWS, 64)).astype(np.float32)
    lat = interleaved_latency(sessions, x, rounds=rounds, per_round=50, warmup=30)
    out = {}
    for shape in shapes:
        per = {
            p: (lat[f"{shape} {p} x10"]["p50_ms"] - lat[f"{shape} {p} x2"]["p50_ms"]) / 8 * 1e3
            for p in ("fp32", "int8")
        }
        out[shape] = {
            "fp32_us": round(per["fp32"], 2),
            "int8_us": round(per["int8"], 2),
            "int8_speedup": round(per["fp32"] / per["int8"], 2),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(THREADS)
    import onnxruntime as ort

    with tempfile.TemporaryDirectory(prefix="kiln-anatomy-") as tmp:
        work = Path(tmp)
        torch.manual_seed(0)
        model = build_model("transformer").eval()
        x = torch.rand(8, 1, 8, 8)
        proto, how = optimized(export_onnx(model, x[:2], work / "exported.onnx"))
        onnx.save(proto, work / "fp32.onnx")
        shares = op_type_shares(work / "fp32.onnx", x.numpy(), runs=400)
        speed = matmul_speed(work, args.rounds)
    matmul_share = sum(v for op, v in shares.items() if "MatMul" in op or op in ("Gemm", "FusedGemm", "FusedMatMul"))
    r = max(v["int8_speedup"] for v in speed.values())  # optimistic: every MatMul gets the best shape's gain
    ceiling = 1 / ((1 - matmul_share) + matmul_share / r)
    res = {
        "command": " ".join(sys.argv),
        "host": platform.node(),
        "onnxruntime": ort.__version__,
        "graph": how,
        "op_type_share_of_kernel_time": shares,
        "matmul_share": round(matmul_share, 3),
        "matmul_per_op": speed,
        "amdahl_estimate": round(ceiling, 2),
        "ceiling_if_matmuls_were_free": round(1 / (1 - matmul_share), 2),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "int8_anatomy.json").write_text(json.dumps(res, indent=2) + "\n")
    md = [
        f"# Where the zoo Transformer's FP32 time goes, and what INT8 can win (ORT CPU, {THREADS} threads)",
        "",
        f"Command: `{res['command']}`  ",
        f"Host: {res['host']}, onnxruntime {res['onnxruntime']}; graph: {how}",
        "",
        "| op type (after ORT fusion) | share of kernel time |",
        "|---|---|",
    ]
    md += [f"| {op} | {share:.1%} |" for op, share in shares.items()]
    md += ["", "| MatMul, 64 rows, widths | FP32 us | INT8 (dynamic) us | INT8 speedup |", "|---|---|---|---|"]
    md += [
        f"| {s.replace('x', ' <-> ')} | {v['fp32_us']} | {v['int8_us']} | {v['int8_speedup']}x |"
        for s, v in speed.items()
    ]
    md += [
        "",
        f"- MatMul share of FP32 kernel time: {matmul_share:.1%} (includes q k^T and attention x v, which "
        "dynamic quantization leaves float)",
        f"- Amdahl estimate with every MatMul {r}x faster (the better shape's gain, optimistic): "
        f"**{ceiling:.2f}x**; with MatMuls taking no time at all: {res['ceiling_if_matmuls_were_free']}x",
    ]
    (args.out / "int8_anatomy.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
