"""How much the 16-bit saturation of ONNX Runtime's fast x86 INT8 GEMM (no VNNI) costs one layer, in numpy.

Without VNNI, ORT multiplies uint8 activations by int8 weights with VPMADDUBSW, which adds each pair of neighbouring
products into an int16 with saturation, before VPMADDWD sums the pairs in int32. This models that arithmetic on one
linear layer (``--rows`` x ``--k`` by ``--k`` x ``--n``, activations from a normal distribution quantized symmetric
int8 and shifted to uint8 as ORT does, weights uniform like ``nn.Linear``'s initialisation, quantized per output
channel) and compares, against the float result: exact int32 accumulation (VNNI, or ORT's exact U8U8 kernels under
``session.x64quantprecision``) and the saturating pairs, with 8-bit and 7-bit (``reduce_range``) weights. It runs no
ONNX Runtime kernel: this machine's CPU may have VNNI; it shows the size of the effect, not a measurement of ORT.

    python benchmarks/int8_saturation.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/common.py
from common import write_report  # noqa: E402

INT16 = (-32768, 32767)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float((a * b).sum() / np.linalg.norm(a) / np.linalg.norm(b))


def one_layer(bits: int, rows: int, k: int, n: int, seed: int) -> dict[str, Any]:
    """Cosine vs float of the exact and the saturating INT8 GEMM, and the share of saturated pair sums."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, k)).astype(np.float32)
    w = rng.uniform(-1, 1, size=(k, n)).astype(np.float32)
    x_scale, zero_point = np.abs(x).max() / 127, 128  # symmetric int8, shifted to uint8 (ORT's x86 kernels)
    a = np.clip(np.round(x / x_scale), -127, 127).astype(np.int64) + zero_point
    q_max = 127 if bits == 8 else 64
    w_scale = np.abs(w).max(0) / q_max
    b = np.clip(np.round(w / w_scale), -q_max, q_max).astype(np.int64)
    pairs = a[:, 0::2, None] * b[None, 0::2, :] + a[:, 1::2, None] * b[None, 1::2, :]
    exact = pairs.sum(1) - zero_point * b.sum(0)
    saturated = np.clip(pairs, *INT16).sum(1) - zero_point * b.sum(0)
    ref = x @ w
    return {
        "weight_bits": bits,
        "cosine_exact": round(cosine(exact * x_scale * w_scale, ref), 5),
        "cosine_saturating": round(cosine(saturated * x_scale * w_scale, ref), 5),
        "saturated_pair_share": round(float((pairs != np.clip(pairs, *INT16)).mean()), 5),
    }


def markdown(res: dict[str, Any]) -> str:
    lines = [
        "# One INT8 linear layer with and without 16-bit saturation (numpy model)",
        "",
        f"{res['rows']} x {res['k']} by {res['k']} x {res['n']}, seed {res['seed']}; cosine against the float product.",
        "",
        "| weight bits | exact int32 sums | saturating int16 pairs | pair sums saturated |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {r['weight_bits']} | {r['cosine_exact']} | {r['cosine_saturating']} | "
        f"{100 * r['saturated_pair_share']:.2f}% |"
        for r in res["layers"]
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--k", type=int, default=64)
    p.add_argument("--n", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    res = {
        "rows": args.rows,
        "k": args.k,
        "n": args.n,
        "seed": args.seed,
        "layers": [one_layer(bits, args.rows, args.k, args.n, args.seed) for bits in (8, 7)],
    }
    write_report(args.out, "int8_saturation", res, markdown(res))


if __name__ == "__main__":
    main()
