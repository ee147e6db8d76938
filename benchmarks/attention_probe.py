"""Why ``build.torch.fused_attention`` exists (GPU): a ``transformers`` ViT-base's and BERT-base's FP16 attention
through torch.export as Kiln's torch backend captures it (inference mode, dynamic batch), each program compiled with
torch.compile (Inductor's own lowering of the attention, no Kiln rewrite): which attention op the program holds, the
compiled program's batch-32 time against eager FP16, and whether the capture succeeds when only PyTorch's fused
kernels are allowed (``sdpa_kernel``). On the host: ``PYTHONPATH=/tmp/site python3 benchmarks/attention_probe.py``
(random weights; wall-clock mean of 50 calls after 5, one process, synchronized)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

FUSED = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]


@contextlib.contextmanager
def fused_only() -> Iterator[None]:
    with torch.inference_mode(), sdpa_kernel(FUSED):
        yield


CAPTURES: dict[str, Callable[[], Any]] = {
    "as kiln (inference_mode)": torch.inference_mode,
    "no inference_mode": contextlib.nullcontext,
    "inference_mode + sdpa_kernel(fused only)": fused_only,
}


def attention_ops(ep: Any) -> list[tuple[str, str]]:
    """The program's attention, bmm and softmax calls with their output dtypes."""
    keys = ("attention", "bmm", "softmax")
    found = {
        (str(n.target), str(getattr(n.meta.get("val"), "dtype", "")))
        for n in ep.graph.nodes
        if n.op == "call_function" and any(k in str(n.target) for k in keys)
    }
    return sorted(found)


def timed(fn: Callable[..., Any], x: dict[str, torch.Tensor], n: int = 50) -> float:
    for _ in range(5):
        fn(**x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn(**x)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3


def cases() -> dict[str, tuple[torch.nn.Module, dict[str, torch.Tensor], dict[str, torch.Tensor]]]:
    from transformers import BertConfig, BertModel, ViTConfig, ViTForImageClassification

    vit = ViTForImageClassification(ViTConfig(num_hidden_layers=12, num_labels=10)).eval().cuda().half()
    bert = BertModel(BertConfig()).eval().cuda().half()

    def pixels(b: int) -> dict[str, torch.Tensor]:
        return {"pixel_values": torch.rand(b, 3, 224, 224, device="cuda", dtype=torch.half)}

    def tokens(b: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 1000, (b, 128), device="cuda")
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    return {"vit": (vit, pixels(2), pixels(32)), "bert": (bert, tokens(2), tokens(32))}


def main() -> None:
    print(torch.__version__, torch.cuda.get_device_name(0))
    for name, (model, example, big) in cases().items():
        dims = {k: {0: torch.export.Dim("b", min=1, max=64)} for k in example}
        with torch.inference_mode():
            print(name, f"eager b32 ms {timed(model, big):.3f}")
        for capture, ctx in CAPTURES.items():
            try:
                with ctx():
                    ep = torch.export.export(model, (), example, dynamic_shapes=dims)
            except Exception as exc:  # noqa: BLE001 - the probe reports it
                print(name, capture, "EXPORT FAILED", type(exc).__name__, str(exc)[:200])
                continue
            compiled = torch.compile(ep.module())
            with torch.inference_mode():
                ms = timed(compiled, big)
            print(name, "|", capture, "|", attention_ops(ep), f"| compiled b32 ms {ms:.3f}", flush=True)


if __name__ == "__main__":
    main()
