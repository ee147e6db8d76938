"""Kiln's engine vs what a PyTorch user gets today, side by side in one run (GPU host).

Rows per (model, batch): PyTorch eager FP32, eager FP16 (``.half()``), ``torch.compile`` FP16 (mode from
``--compile-mode``, default max-autotune), ONNX Runtime CUDA FP16 with default settings, Kiln's engine with its
fixed settings (``kiln_fixed``: ORT CUDA FP16 with transformer fusion, exhaustive cuDNN search, NHWC for
convolutions, IO binding on device buffers, one CUDA graph per shape) and Kiln's engine autotuned at build time
(``kiln``: ``kiln.stages.engines.build_engine`` times candidate settings per batch size on this GPU and keeps the
fastest that agrees with FP32; the choice per batch is printed and recorded, see ``stages/engines/ort_autotune.py``).
Latency: median (and p90) of ``--iterations``
timed runs after warm-up, CUDA events, inputs already on the GPU, TF32 off. Agreement: top-1 agreement, cosine
and max abs error vs eager FP32 on ``--eval-samples`` random inputs. Build: seconds to produce the runnable
thing (compile / session / engine build) and its size on disk.

Models: ``resnet18`` and ``bert_base`` from Kiln's zoo (one input), ``hf_vit`` (Hugging Face's ViT-base/16,
unmasked attention over 197 tokens), and ``hf_bert``: Hugging Face
``transformers.BertModel`` + ``Linear(768, 2)`` on ``pooler_output``, ``forward(input_ids, attention_mask)``, exported
with ``torch.onnx.export(dynamo=True)`` and a dynamic batch on both inputs (issue 12's model; needs ``pip install
transformers``, skipped with a note otherwise). Row ``baseline_compile`` is the torch.compile baseline exactly as
``validate.baselines: [compile]`` builds it (``kiln.stages.validate.baselines.prepare``); ``kiln_torch`` is Kiln's
torch engine (``build.backends: [torch]``), ``kiln_torch_frozen`` the same with ``build.torch.freezing: true`` (what
Inductor's freezing is worth, side by side). ``--torch-variant NAME:KEY=VALUE,...`` (repeatable) adds a row
``kiln_torch_NAME``: the torch engine built with those ``build.torch.inductor`` entries on top of ``--torch-inductor``
(a key naming a ``build.torch`` setting sets it: ``freezing=true``, ``gemm_epilogues=MODE``, ``merge_linears=false``),
so Inductor settings are compared in one run. Variant rows are
shown but not counted as Kiln's engine in the targets: they are not what a build ships by default. Rows
``kiln_torch_fp8`` and ``kiln_torch_int8`` are the torch engine at ``precision`` fp8 / int8 (GPU: linear layers as
FP8 or INT8 GEMMs, ``kiln.stages.engines.torch.lowbit``); a ``--torch-variant`` takes ``precision=fp8`` too.
Rows ``torchao_fp8_tensor`` and ``torchao_fp8_row`` are torchao's FP8 inference recipe (dynamic scales per tensor or
per row, bfloat16, ``torch.compile``), the peer FP8 path, where ``torchao`` is installed.
Roofline columns: FLOPs per sample from torch's FLOP counter (eager FP32, batch 1), achieved TFLOP/s at the median,
and its share of this device's measured GEMM peak in the row's precision (``kiln.stages.validate.roofline``).

    PYTHONPATH=/tmp/site:$PWD python benchmarks/engine_bench.py --out $OUT                  # full (GPU host)
    ... --models hf_bert --batches 1,32 --rows eager16,baseline_compile,kiln,kiln_torch     # issue 12's BERT
    ... --models resnet18 --batches 32 --rows compile,kiln --compile-mode max-autotune       # one slice
    ... --models hf_bert --batches 32 --rows kiln_torch --torch-variant aten:max_autotune_gemm_backends=ATEN
    ... --models hf_bert --batches 1,32 --rows kiln_torch,kiln_torch_fp8,kiln_torch_int8 --profile 20  # issue 33
    ... --models hf_bert --batches 1,32 --rows kiln_torch_fp8,torchao_fp8_tensor,torchao_fp8_row    # with torchao
    python benchmarks/engine_bench.py --smoke --out /tmp/bench                             # tiny, CPU
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import re
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch

from kiln.calibration.feeds import save_feeds  # noqa: E402
from kiln.core.timing import time_calls  # noqa: E402
from kiln.models.registry import build_model  # noqa: E402
from kiln.stages.engines.config import BuildConfig  # noqa: E402
from kiln.stages.engines.onnxruntime.config import OnnxRuntimeConfig, OrtAutotuneConfig  # noqa: E402
from kiln.stages.engines.registry import load_engine  # noqa: E402
from kiln.stages.engines.stage import build_engine  # noqa: E402
from kiln.stages.engines.torch.config import TorchConfig  # noqa: E402
from kiln.stages.export.torch_export import export_onnx  # noqa: E402
from kiln.stages.optimize.api import optimize_model  # noqa: E402
from kiln.stages.optimize.config import OptimizeConfig  # noqa: E402
from kiln.stages.validate.baselines import prepare as prepare_baseline  # noqa: E402
from kiln.stages.validate.roofline import peak_tflops, sig  # noqa: E402

ROWS = [
    "eager32",
    "eager16",
    "compile",
    "compile_cl",
    "baseline_compile",
    "ort_default",
    "ort_cuda_graph",
    "kiln_fixed",
    "kiln",
    "kiln_torch",
    "kiln_torch_frozen",
    "kiln_torch_fp8",
    "kiln_torch_int8",
    "torchao_fp8_tensor",
    "torchao_fp8_row",
]
LABEL = {
    "eager32": "torch eager fp32",
    "eager16": "torch eager fp16",
    "compile": "torch.compile fp16",
    "compile_cl": "torch.compile fp16, channels_last",
    "ort_cuda_graph": "ORT CUDA fp16 + CUDA graph, by hand",
    "baseline_compile": "validate.baselines compile (fp16 on GPU)",
    "ort_default": "ORT CUDA fp16 default",
    "kiln_fixed": "Kiln engine, fixed settings",
    "kiln": "Kiln engine, autotuned",
    "kiln_torch": "Kiln torch engine (build.backends torch)",
    "kiln_torch_frozen": "Kiln torch engine, build.torch.freezing on",
    "kiln_torch_fp8": "Kiln torch engine, FP8 linear layers (precision fp8)",
    "kiln_torch_int8": "Kiln torch engine, INT8 linear layers (precision int8)",
    "torchao_fp8_tensor": "torchao FP8 dynamic, per tensor, bf16, torch.compile",
    "torchao_fp8_row": "torchao FP8 dynamic, per row, bf16, torch.compile",
}
ROW_PRECISION = {"kiln_torch_fp8": "fp8", "kiln_torch_int8": "int8"}  # the other Kiln torch rows: fp16 (GPU)
TORCHAO = {"torchao_fp8_tensor": "PerTensor", "torchao_fp8_row": "PerRow"}  # granularity per torchao row
Inputs = tuple[torch.Tensor, ...]
T0 = time.perf_counter()


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} +{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def model_specs(smoke: bool, bert_layers: int) -> dict[str, tuple[dict[str, Any], tuple[int, ...]]]:
    """name -> (model params, one sample's shape; for hf_bert the token sequence length)."""
    if smoke:
        return {
            "resnet18": ({"width": 8, "blocks": (1, 1), "num_classes": 10}, (3, 32, 32)),
            "bert_base": ({"layers": 1, "dim": 64, "heads": 4, "ffn": 128, "in_features": 64, "seq_len": 16}, (16, 64)),
            "hf_bert": (
                {
                    "num_hidden_layers": 1,
                    "hidden_size": 64,
                    "num_attention_heads": 4,
                    "intermediate_size": 128,
                    "vocab_size": 100,
                    "max_position_embeddings": 32,
                },
                (16,),
            ),
            "hf_vit": (
                {"num_hidden_layers": 1, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128},
                (3, 32, 32),
            ),
        }
    return {
        "resnet18": ({}, (3, 224, 224)),
        "bert_base": ({"layers": bert_layers}, (128, 768)),
        "hf_bert": ({"num_hidden_layers": bert_layers}, (128,)),
        "tv_resnet18": ({}, (3, 224, 224)),
        "hf_vit": ({"num_hidden_layers": bert_layers}, (3, 224, 224)),
    }


class HFBertClassifier(torch.nn.Module):
    """``transformers.BertModel`` + a 2-way head on ``pooler_output``: what an HF user fine-tunes and serves."""

    def __init__(self, **config: Any) -> None:
        from transformers import BertConfig, BertModel  # optional: only this model needs transformers

        super().__init__()
        self.bert = BertModel(BertConfig(**config), add_pooling_layer=True)
        self.head = torch.nn.Linear(self.bert.config.hidden_size, 2)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.bert(input_ids=input_ids, attention_mask=attention_mask).pooler_output)


class HFViTClassifier(torch.nn.Module):
    """``transformers.ViTForImageClassification`` (ViT-base/16 by default, 10 classes) returning its logits: a
    transformer whose attention has no mask and 197 tokens, unlike BERT's."""

    def __init__(self, **config: Any) -> None:
        from transformers import ViTConfig, ViTForImageClassification  # optional: only this model needs it

        super().__init__()
        size = 224 if config.get("hidden_size", 768) == 768 else 32
        self.vit = ViTForImageClassification(ViTConfig(num_labels=10, image_size=size, patch_size=16, **config))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.vit(pixel_values=pixel_values).logits


def make_model(name: str, params: dict[str, Any]) -> torch.nn.Module:
    if name == "tv_resnet18":  # torchvision's ResNet-18 (a model nobody here wrote); torchvision is on the GPU host
        import torchvision

        return torchvision.models.resnet18(**params)
    if name == "hf_vit":
        return HFViTClassifier(**params)
    return HFBertClassifier(**params) if name == "hf_bert" else build_model(name, params)


def make_inputs(name: str, params: dict[str, Any], shape: tuple[int, ...], batch: int, seed: int) -> Inputs:
    """One batch of the model's inputs (host tensors): token ids + attention mask (last quarter padded on odd
    rows) for hf_bert, a standard normal tensor otherwise."""
    gen = torch.Generator().manual_seed(seed)
    if name != "hf_bert":
        return (torch.randn((batch, *shape), generator=gen),)
    seq = shape[0]
    ids = torch.randint(0, params.get("vocab_size", 30522), (batch, seq), generator=gen)
    mask = torch.ones((batch, seq), dtype=torch.int64)
    mask[1::2, seq - seq // 4 :] = 0
    return ids, mask


def cat_inputs(xs: list[Inputs]) -> Inputs:
    return tuple(torch.cat(parts) for parts in zip(*xs))


def slice_inputs(xs: Inputs, i: int, j: int) -> Inputs:
    return tuple(x[i:j] for x in xs)


def time_fn(fn: Callable[[], Any], warmup: int, iterations: int) -> list[float]:
    """ms per call after ``warmup`` calls, timed like Kiln's runners do (CUDA events on a GPU, else wall clock)."""
    for _ in range(warmup):
        fn()
    return time_calls(fn, iterations)


# Kernel kinds by name, first match wins (cuDNN, cuBLAS/CUTLASS, Triton and ORT's own kernels): how a row's kernel time
# splits into the work itself and what fusion or another layout would remove. A name-based reading: "other" is kept.
KERNEL_KINDS = (
    ("attention", ("fmha", "flash", "attention", "attn", "softmax")),
    ("layout", ("transpose", "nchwtonhwc", "nhwctonchw", "addpadding", "nhwc2nchw", "nchw2nhwc", "permute")),
    ("convolution", ("convolve", "convolution", "conv2d", "fprop", "dgrad", "implicit_gemm", "xmma_fprop")),
    ("matmul", ("gemm", "addmm", "bmm", "_mm_", "triton_mm", "cutlass", "cublas", "matmul", "sm90_xmma", "nvjet")),
    ("normalization", ("layer_norm", "layernorm", "batch_norm", "batchnorm", "bn_fw", "rms")),
    ("pooling", ("pooling", "pool2d", "max_pool", "avg_pool")),
    ("copy / cast", ("copy", "cast", "memcpy", "multi_tensor_apply", "fill", "clone")),
)
"""Names checked on H200 profiles: cuDNN's BatchNorm (``cudnn::bn_fw_inf_...``) and pooling kernels are not
convolutions, nor is ``op_generic_tensor_kernel`` (cuDNN's elementwise op, e.g. a bias add: "other"); Inductor's
convolution templates with BatchNorm fused in (``triton_tem_fused__native_batch_norm_..._convolution_relu``) are."""


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KERNEL_KINDS if any(k in low for k in keys)), "other")


def kernel_profile(fn: Callable[[], Any], calls: int) -> dict[str, Any]:
    """Per call: GPU kernel time, kernel count and the kernels taking most of it (torch.profiler over ``calls``
    calls): what makes two rows that should run the same work differ."""
    acts = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else []
    )
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(calls):
            fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if str(getattr(e, "device_type", "")).endswith("CUDA")]
    total = sum(e.self_device_time_total for e in kernels)
    top = sorted(kernels, key=lambda e: e.self_device_time_total, reverse=True)[:15]
    kinds: dict[str, list[float]] = {}
    for e in kernels:
        ms_count = kinds.setdefault(kernel_kind(e.key), [0.0, 0.0])
        ms_count[0] += e.self_device_time_total / 1e3 / calls
        ms_count[1] += e.count / calls
    return {
        "calls": calls,
        "kernel_ms": round(total / 1e3 / calls, 4),
        "kernels": round(sum(e.count for e in kernels) / calls, 1),
        "by_kind": {k: [round(ms, 4), round(n, 1)] for k, (ms, n) in sorted(kinds.items(), key=lambda kv: -kv[1][0])},
        "top": [
            [e.key[:120], round(e.self_device_time_total / 1e3 / calls, 4), round(e.count / calls, 1)] for e in top
        ],
    }


def agreement(ref: np.ndarray, got: np.ndarray) -> dict[str, float]:
    r, g = ref.astype(np.float64), got.astype(np.float64)
    return {
        "top1_agreement": float(np.mean(r.argmax(-1) == g.argmax(-1))),
        "cosine": float((r.ravel() @ g.ravel()) / (np.linalg.norm(r) * np.linalg.norm(g))),
        "max_abs_err": float(np.abs(r - g).max()),
    }


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.cuda = args, torch.cuda.is_available()
        self.dev = "cuda" if self.cuda else "cpu"
        self.work = Path(tempfile.mkdtemp(prefix="engine-bench-"))
        self.results: list[dict[str, Any]] = []
        self.peak = peak_tflops(self.dev, self.work / "cache")  # measured once per run, in the env
        self.env: dict[str, Any] = {"peak_tflops": self.peak}

    def save(self) -> None:
        write_results(self.args, self.env, self.results)

    def label(self, row: str) -> str:
        if row in self.args.torch_variants:
            entries = ",".join(f"{k}={v}" for k, v in self.args.torch_variants[row].items())
            text = f"Kiln torch engine, {entries}"
        else:
            text = LABEL[row]
        if self.cuda:
            return text
        return text.replace("ORT CUDA", "ORT CPU") + (" (fp32 on CPU)" if row.startswith("kiln") else "")

    def run_model(self, name: str, params: dict[str, Any], shape: tuple[int, ...]) -> None:
        a = self.args
        torch.manual_seed(0)
        try:
            model = make_model(name, params).eval().to(self.dev)
        except ImportError as exc:  # hf_bert without transformers: said, not hidden
            say(f"{name}: skipped ({exc}; pip install transformers)")
            self.results.append({"model": name, "row": "all", "label": "skipped", "error": f"skipped: {exc}"})
            return
        self.params, self.shape = params, shape
        self.flops = flops_per_sample(model, make_inputs(name, params, shape, 1, seed=0), self.dev)
        say(f"{name}: {self.flops / 1e9:.2f} GFLOP per sample (torch's FLOP counter)")
        evalx = make_inputs(name, params, shape, a.eval_samples, seed=1)
        with torch.inference_mode():
            ref = self._batched(lambda xs: model(*(x.to(self.dev) for x in xs)).float().cpu(), evalx).numpy()
        onnx32 = self._export(name, model, shape)
        say(f"{name}: exported FP32 ONNX ({onnx32.stat().st_size / 1e6:.0f} MB)")
        for row in a.rows:
            try:
                self._row(row, name, model, shape, evalx, ref, onnx32)
            except Exception as exc:  # one broken row must not lose the others; it is reported, not hidden
                say(f"{name} {row}: FAILED {type(exc).__name__}: {str(exc)[:300]}")
                self.results.append({"model": name, "row": row, "label": self.label(row), "error": str(exc)[:500]})
            self.save()  # after each row: a run cut short by a time limit keeps the rows it finished

    def _batched(self, fn: Callable[[Inputs], torch.Tensor], xs: Inputs) -> torch.Tensor:
        bs = max(self.args.batches)
        return torch.cat([fn(slice_inputs(xs, i, i + bs)) for i in range(0, len(xs[0]), bs)])

    def _export(self, name: str, model: torch.nn.Module, shape: tuple[int, ...]) -> Path:
        import onnx_graphsurgeon as gs

        raw = self.work / f"{name}-raw.onnx"
        if name == "hf_bert":  # as issue 12 exported it: dynamo, dynamic batch on both inputs
            xs = make_inputs(name, self.params, shape, 2, seed=0)
            batch = torch.export.Dim("batch", min=1, max=max(64, max(self.args.batches)))
            torch.onnx.export(
                model.float().cpu(),
                xs,
                str(raw),
                dynamo=True,
                input_names=["input_ids", "attention_mask"],
                output_names=["logits"],
                dynamic_shapes={"input_ids": {0: batch}, "attention_mask": {0: batch}},
            )
        else:
            export_onnx(model.float().cpu(), torch.randn(2, *shape), raw)
        model.to(self.dev)
        # Constant folding, and Conv+BatchNorm folding where there is BatchNorm, and deliberately no more: Kiln's
        # default optimize passes also include merge_qkv (one MatMul for Q/K/V), matmul_add_to_gemm and
        # fold_scalar_mul, which rewrite exactly the MatMul+Add / scaled-QK^T subgraphs ORT's transformer fusion
        # matches to emit Attention/SkipLayerNorm, so they would cost the ORT engine its biggest win. BatchNorm is
        # folded (Kiln's fold_conv_bn, as its pipeline does) because ORT does not do it on these graphs: the exporter
        # gives bias-free convolutions a zero bias through CastLike/Expand of the input, which ORT's Conv+BN fusion
        # does not take as a constant, and the FP16 engines then ran every BatchNorm as its own kernel between FP32
        # casts (H200, ResNet-18 batch 32: engine_bench_h200_s7_profile_resnet18). Only there: Kiln's optimize API
        # re-infers shapes, which renames some of the exporter's symbolic dims, and ORT's SkipLayerNorm fusion then
        # misses residual Adds whose inputs no longer have provably equal shapes (a BERT export).
        out = self.work / f"{name}-fp32.onnx"
        exported = onnx.load(str(raw))
        if any(n.op_type == "BatchNormalization" for n in exported.graph.node):
            folded, _ = optimize_model(exported, OptimizeConfig(passes=["fold_constants", "fold_conv_bn"]))
        else:
            graph = gs.import_onnx(exported)
            graph.fold_constants().cleanup().toposort()
            folded = gs.export_onnx(graph)
        onnx.save(folded, str(out), save_as_external_data=False)
        return out

    def _row(
        self,
        row: str,
        name: str,
        model: torch.nn.Module,
        shape: tuple[int, ...],
        evalx: torch.Tensor,
        ref: np.ndarray,
        onnx32: Path,
    ) -> None:
        say(f"{name} {row}: preparing")
        t0 = time.perf_counter()
        runner, size, extra = self._prepare(row, model, onnx32, name)
        for batch in self.args.batches:
            x = make_inputs(name, self.params, shape, batch, seed=2)
            t1 = time.perf_counter()
            call = runner(x)  # first call compiles/captures for this shape: counted in build_seconds
            build = time.perf_counter() - t0 if batch == self.args.batches[0] else None
            times = time_fn(call, self.args.warmup, self.args.iterations)
            profile = kernel_profile(call, self.args.profile) if self.args.profile else None
            got = self._eval(row, runner, evalx)
            entry = {
                "model": name,
                "row": row,
                "label": self.label(row),
                "batch": batch,
                "median_ms": float(np.median(times)),
                "p90_ms": float(np.percentile(times, 90)),
                "iterations": len(times),
                "first_call_s": time.perf_counter() - t1,
                "build_seconds": build,
                "size_bytes": size,
                **self._roofline(row, batch, float(np.median(times))),
                **agreement(ref, got),
                **extra,
            }
            if profile is not None:
                entry["profile"] = profile
            self.results.append(entry)
            say(
                f"{name} {row} batch {batch}: median {entry['median_ms']:.3f} ms, top1 "
                f"{entry['top1_agreement']:.4f}, cos {entry['cosine']:.6f}"
            )

    def _calibration(self, name: str, onnx32: Path) -> Path:
        return _calibration_feeds(self, name, onnx32)

    def _roofline(self, row: str, batch: int, median_ms: float) -> dict[str, Any]:
        """Achieved TFLOP/s at the median and its share of this device's measured GEMM peak in the row's precision
        (``kiln.stages.validate.roofline``; FP16's where that precision's peak is not measured)."""
        precision = self.row_precision(row)
        measured = self.peak.get("measured", {})
        kind = precision if precision in measured else "fp16" if "fp16" in measured else "fp32"
        tflops = self.flops * batch / (median_ms / 1e3) / 1e12
        pct = sig(100 * tflops / measured[kind]) if measured.get(kind) else None
        return {"precision": precision, "tflops": sig(tflops), "pct_of_peak": pct, "peak_kind": kind}

    def row_precision(self, row: str) -> str:
        if row in ROW_PRECISION:
            return ROW_PRECISION[row]
        if row in TORCHAO:
            return "fp8"
        if row in self.args.torch_variants and "precision" in self.args.torch_variants[row]:
            return str(self.args.torch_variants[row]["precision"])
        return "fp16" if self.cuda and row != "eager32" else "fp32"

    def _eval(self, row: str, runner: Callable[[Inputs], Callable[[], Any]], evalx: Inputs) -> np.ndarray:
        bs = max(self.args.batches)
        outs = [self._out(row, runner(slice_inputs(evalx, i, i + bs))) for i in range(0, len(evalx[0]), bs)]
        return np.concatenate(outs)

    @staticmethod
    def _out(row: str, call: Callable[[], Any]) -> np.ndarray:
        out = call()
        if isinstance(out, torch.Tensor):
            return out.float().cpu().numpy()
        if hasattr(out, "numpy"):  # an ORT OrtValue on the device: copies to the host
            return np.asarray(out.numpy(), dtype=np.float32)
        return np.asarray(out, dtype=np.float32)

    def _prepare(self, row: str, model: torch.nn.Module, onnx32: Path, name: str) -> tuple[Any, int | None, dict]:
        """A factory ``x -> call`` where ``call()`` runs one inference on device-resident inputs and returns outputs."""
        dev = self.dev
        if row in ("eager32", "eager16", "compile", "compile_cl", "baseline_compile"):
            half = row != "eager32" and (self.cuda or row != "baseline_compile")
            dtype = torch.float16 if half else torch.float32
            m = make_model(name, self.params).eval().to(dev)
            m.load_state_dict(model.state_dict())
            extra: dict[str, Any] = {}
            if row == "baseline_compile":  # exactly what validate.baselines: [compile] times
                m = prepare_baseline(m.float().cpu(), "compile", dev, "fp16" if half else "fp32")
                extra["compile_mode"] = "max-autotune" if self.cuda else "default"
            else:
                m = m.to(dtype)
            layout = torch.channels_last if row == "compile_cl" else torch.contiguous_format
            if row in ("compile", "compile_cl"):
                m = torch.compile(m.to(memory_format=layout), mode=self.args.compile_mode, dynamic=False)
                extra["compile_mode"] = self.args.compile_mode

            def torch_factory(xs: Inputs) -> Callable[[], Any]:
                xd = tuple(x.to(dev, dtype) if x.is_floating_point() else x.to(dev) for x in xs)
                xd = tuple(x.contiguous(memory_format=layout) if x.dim() == 4 else x for x in xd)

                def call() -> torch.Tensor:
                    with torch.inference_mode():
                        return m(*xd)

                return call

            return torch_factory, None, extra
        if row in TORCHAO:
            return self._torchao(model, name, TORCHAO[row])
        if row in ("ort_default", "ort_cuda_graph"):
            return self._ort_default(onnx32, name, cuda_graph=row == "ort_cuda_graph")
        if row in ("kiln_torch", "kiln_torch_frozen", *ROW_PRECISION):
            frozen = {"freezing": row == "kiln_torch_frozen"}
            return self._kiln_torch(onnx32, name, model, row, settings=frozen, precision=ROW_PRECISION.get(row))
        if row in self.args.torch_variants:
            entries = dict(self.args.torch_variants[row])
            precision = entries.pop("precision", None)
            own = {k: entries.pop(k) for k in list(entries) if k in TorchConfig.model_fields and k != "inductor"}
            return self._kiln_torch(onnx32, name, model, row, settings=own, inductor=entries, precision=precision)
        return self._kiln(onnx32, name, autotuned=row == "kiln")

    def _torchao(self, model: torch.nn.Module, name: str, granularity: str) -> tuple[Any, None, dict]:
        """torchao's FP8 inference recipe as its README gives it: the model in bfloat16, ``quantize_`` with
        ``Float8DynamicActivationFloat8WeightConfig`` (``granularity`` PerTensor or PerRow), then ``torch.compile``
        (``--compile-mode``). The peer path beside Kiln's FP8 engine; needs ``pip install torchao``."""
        import torchao
        import torchao.quantization as tq

        m = make_model(name, self.params).eval().to(self.dev)
        m.load_state_dict(model.state_dict())
        m = m.to(torch.bfloat16)
        tq.quantize_(m, tq.Float8DynamicActivationFloat8WeightConfig(granularity=getattr(tq, granularity)()))
        m = torch.compile(m, mode=self.args.compile_mode, dynamic=False)

        def factory(xs: Inputs) -> Callable[[], Any]:
            xd = tuple(x.to(self.dev, torch.bfloat16) if x.is_floating_point() else x.to(self.dev) for x in xs)

            def call() -> torch.Tensor:
                with torch.inference_mode():
                    return m(*xd)

            return call

        return factory, None, {"compile_mode": self.args.compile_mode, "torchao": torchao.__version__}

    def _ort_default(self, onnx32: Path, name: str, cuda_graph: bool = False) -> tuple[Any, int, dict]:
        """ORT CUDA FP16 as a user sets it up by hand: onnxconverter-common's converter, default session options;
        ``cuda_graph``: plus the CUDA EP's ``enable_cuda_graph`` (one session per shape: a graph is captured once)."""
        import onnxruntime as ort
        from onnxconverter_common import float16

        path = self.work / f"{name}-ort-fp16.onnx"
        if not path.is_file():
            onnx.save(float16.convert_float_to_float16(onnx.load(str(onnx32)), keep_io_types=True), str(path))
        providers: list[Any] = ["CUDAExecutionProvider"] if self.cuda else ["CPUExecutionProvider"]
        if cuda_graph and self.cuda:
            providers = [("CUDAExecutionProvider", {"enable_cuda_graph": "1"})]

        def factory(xs: Inputs) -> Callable[[], Any]:
            sess = ort.InferenceSession(str(path), providers=providers)  # default options: what a user gets
            feed = {i.name: x.numpy() for i, x in zip(sess.get_inputs(), xs)}
            if not self.cuda:
                return lambda: sess.run(None, feed)[0]
            binding = sess.io_binding()  # device buffers, as for every other row: no host copies timed
            for n, a in feed.items():
                binding.bind_ortvalue_input(n, ort.OrtValue.ortvalue_from_numpy(a, "cuda", 0))
            for o in sess.get_outputs():
                if cuda_graph:  # a replayed graph writes to fixed addresses: outputs preallocated (float32 I/O)
                    shape = [d if isinstance(d, int) else len(xs[0]) for d in o.shape]
                    binding.bind_ortvalue_output(
                        o.name, ort.OrtValue.ortvalue_from_shape_and_type(shape, np.float32, "cuda", 0)
                    )
                else:
                    binding.bind_output(o.name, "cuda", 0)

            def call() -> np.ndarray:
                sess.run_with_iobinding(binding)
                return binding.get_outputs()[0]

            return call

        return factory, path.stat().st_size, {"providers": [str(p) for p in providers]}

    def _kiln(self, onnx32: Path, name: str, autotuned: bool) -> tuple[Any, int, dict]:
        device, precision = ("cuda", "fp16") if self.cuda else ("cpu", "fp32")
        a = self.args
        # Tuned at the benchmark's batch sizes; on CPU (--smoke) the CPU knobs are tuned so the path runs here too.
        tune = OrtAutotuneConfig(
            cuda=autotuned,
            cpu=autotuned,
            batch_sizes=a.batches,
            iterations=a.autotune_iterations,
            time_budget_s=a.autotune_budget,
        )
        cfg = BuildConfig(backends=["onnxruntime"], onnxruntime=OnnxRuntimeConfig(autotune=tune))
        folder = self.work / f"{name}-{'kiln' if autotuned else 'kiln-fixed'}"
        meta = build_engine(
            onnx32, folder, "onnxruntime", device, precision, cfg, self.work / "cache", max_batch=max(a.batches)
        )
        say(
            f"{name} kiln: engine built in {meta.build_seconds:.1f}s "
            f"(fusion: {meta.builder_settings.get('transformer_fusion')})"
        )
        tuned = meta.backend_info.get("autotune") or {}
        for b, choice in (tuned.get("choice_by_batch") or {"all": tuned.get("choice")}).items():
            if choice:
                say(
                    f"{name} kiln autotune batch {b}: {choice['knobs']} {choice.get('median_ms')} ms "
                    f"(configured settings {choice.get('base_ms')} ms)"
                )
        if tuned.get("skipped"):
            say(f"{name} kiln: autotune skipped: {tuned['skipped']}")
        runner = load_engine(folder).activate()
        out_name = runner.meta.outputs[0].name
        graphs: dict[int, bool] = {}  # batch -> whether the timed call replays a CUDA graph

        def factory(xs: Inputs) -> Callable[[], Any]:
            feed = {n: x.numpy() for n, x in zip(runner.input_names, xs)}
            if device == "cpu":
                return lambda: runner.infer(feed)[out_name]
            call, graph = runner.prepared(feed)  # the runner's own device buffers / CUDA graph for this shape
            graphs[xs[0].shape[0]] = graph
            return call

        extra = {
            "engine": meta.name,
            "precision": precision,
            "autotune": tuned,
            "fusion": meta.builder_settings.get("transformer_fusion"),
            "engine_build_seconds": meta.build_seconds,
            "cuda_graph_by_batch": graphs,
        }
        return factory, meta.size_bytes, extra

    def _kiln_torch(
        self,
        onnx32: Path,
        name: str,
        model: torch.nn.Module,
        row: str,
        settings: dict[str, Any] | None = None,
        inductor: dict[str, Any] | None = None,
        precision: str | None = None,
    ) -> tuple[Any, int, dict]:
        """Kiln's torch engine of the same weights (FP16 + max-autotune on the GPU, FP32 on the CPU, or
        ``precision``: fp8/int8 GPU engines); ``settings``: build.torch settings (the row kiln_torch_frozen sets
        freezing); ``inductor``: build.torch.inductor entries on top of ``--torch-inductor`` (a ``--torch-variant``
        row)."""
        device, default = ("cuda", "fp16") if self.cuda else ("cpu", "fp32")
        precision = precision or default
        state = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}

        def load() -> torch.nn.Module:
            m = make_model(name, self.params).eval()
            m.load_state_dict(state)
            return m

        torch_cfg = TorchConfig(
            devices=[device],
            flavour=self.args.torch_flavour,
            **(settings or {}),
            inductor={**self.args.torch_inductor, **(inductor or {})},
        )
        cfg = BuildConfig(backends=["torch"], torch=torch_cfg)
        folder = self.work / f"{name}-{row}"
        meta = build_engine(
            onnx32,
            folder,
            "torch",
            device,
            precision,
            cfg,
            self.work / "cache",
            max_batch=max(self.args.batches),
            torch_model=load,
            calibration=self._calibration(name, onnx32) if precision in ("fp8", "int8") else None,
        )
        say(f"{name} {row}: built in {meta.build_seconds:.1f}s ({meta.builder_settings})")
        runner = load_engine(folder).activate()

        def factory(xs: Inputs) -> Callable[[], Any]:
            return runner.prepared({n: x.numpy() for n, x in zip(runner.input_names, xs)})[0]

        return (
            factory,
            meta.size_bytes,
            {
                "engine": meta.name,
                "precision": precision,
                "flavour": meta.flavour,
                "builder_settings": meta.builder_settings,
            },
        )


def flops_per_sample(model: torch.nn.Module, x: Inputs, device: str) -> int:
    """FLOPs of one sample through ``model`` in eager FP32, counted by ``torch.utils.flop_counter``."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with torch.inference_mode(), counter:
        model(*(t.to(device) for t in x))
    return int(counter.get_total_flops())


def _calibration_feeds(bench: Bench, name: str, onnx32: Path) -> Path:
    """Calibration batches for FP8/INT8 static scales, drawn as the benchmark's other inputs are (4 x 16 samples,
    seeds apart from the timed and evaluated ones), saved as the precision stage saves them."""
    path = bench.work / f"{name}-calibration.npz"
    if not path.is_file():
        names = [i.name for i in onnx.load(str(onnx32), load_external_data=False).graph.input]
        batches = [make_inputs(name, bench.params, bench.shape, 16, seed=100 + i) for i in range(4)]
        save_feeds([{n: x.numpy() for n, x in zip(names, xs)} for xs in batches], names, path)
    return path


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def markdown(results: list[dict[str, Any]], env: dict[str, Any]) -> str:
    lines = [
        f"# Engine benchmark ({env['device']})",
        "",
        f"Command: `{env['command']}`",
        "",
        "| model | batch | row | median ms | p90 ms | vs eager fp32 | top-1 agree | cosine | build s | size MB "
        "| TFLOP/s | % of peak |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = {(r["model"], r["batch"]): r["median_ms"] for r in results if r["row"] == "eager32" and "median_ms" in r}
    for r in results:
        if "error" in r:
            lines.append(
                f"| {r['model']} | - | {r['label']} | failed: {r['error'][:80].replace(chr(10), ' ')} | | | | | | | | |"
            )
            continue
        speed = base.get((r["model"], r["batch"]))
        lines.append(
            f"| {r['model']} | {r['batch']} | {r['label']} | {r['median_ms']:.3f} | {r['p90_ms']:.3f} | "
            f"{(speed / r['median_ms']) if speed else float('nan'):.2f}x | {r['top1_agreement']:.4f} | "
            f"{r['cosine']:.6f} | {_num(r['build_seconds'] if r['row'] not in ('eager32', 'eager16') else None)} | "
            f"{_num(r['size_bytes'] / 1e6 if r['size_bytes'] else None)} | {r.get('tflops', '-')} | "
            f"{_pct(r)} |"
        )
    return "\n".join(lines + target_table(results) + profile_table(results) + autotune_table(results)) + "\n"


def _pct(r: dict[str, Any]) -> str:
    """The share of the measured peak; past 100 % the peak was measured low, and no share of it is a fact."""
    if r.get("pct_of_peak") is None:
        return "-"
    return f"{'> 100' if r['pct_of_peak'] > 100 else format(r['pct_of_peak'], '.1f')} % ({r['peak_kind']})"


def profile_table(results: list[dict[str, Any]]) -> list[str]:
    """``--profile``: per row and batch, kernel time per call against the timed latency (the rest is launch gaps and
    host time inside the CUDA events), and the kernel time by kind (:data:`KERNEL_KINDS`)."""
    rows = [r for r in results if r.get("profile")]
    if not rows:
        return []
    lines = [
        "",
        "## Kernel profile (torch.profiler over --profile calls; ms per call, kernels per call)",
        "",
        "| model | batch | row | median ms | kernel ms | kernels | by kind: ms (kernels) | top kernel |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p = r["profile"]
        kinds = ", ".join(f"{k} {ms:.3f} ({n:g})" for k, (ms, n) in p.get("by_kind", {}).items())
        top = p["top"][0] if p["top"] else ["-", 0.0, 0]
        lines.append(
            f"| {r['model']} | {r['batch']} | {r['row']} | {r['median_ms']:.3f} | {p['kernel_ms']:.3f} | "
            f"{p['kernels']:g} | {kinds} | `{top[0][:60]}` {top[1]:.3f} |"
        )
    return lines


REFERENCE_ROWS = ("compile", "compile_cl", "ort_cuda_graph")  # the strongest paths a user builds without Kiln
KILN_ROWS = ("kiln", "kiln_torch")  # Kiln's engines; the build keeps the fastest that passes the gates per batch
# Issue 12's absolute targets on the H200 (ms, median)
ABSOLUTE_MS = {
    ("resnet18", 1): 0.25,
    ("resnet18", 32): 0.85,
    ("tv_resnet18", 1): 0.25,
    ("tv_resnet18", 32): 0.85,
    ("hf_bert", 32): 1.8,
}


def targets(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per model and batch: Kiln's fastest engine vs the fastest reference path, and the absolute targets."""
    ok = [r for r in results if "median_ms" in r]
    out = []
    for model, batch in dict.fromkeys((r["model"], r["batch"]) for r in ok):
        cell = [r for r in ok if (r["model"], r["batch"]) == (model, batch)]
        ref = min((r for r in cell if r["row"] in REFERENCE_ROWS), key=lambda r: r["median_ms"], default=None)
        kiln = min((r for r in cell if r["row"] in KILN_ROWS), key=lambda r: r["median_ms"], default=None)
        if ref is None or kiln is None:
            continue
        limit = ABSOLUTE_MS.get((model, batch))
        out.append(
            {
                "model": model,
                "batch": batch,
                "kiln_row": kiln["row"],
                "kiln_ms": kiln["median_ms"],
                "reference_row": ref["row"],
                "reference_ms": ref["median_ms"],
                "kiln_vs_reference": kiln["median_ms"] / ref["median_ms"],
                "at_or_below_reference": kiln["median_ms"] <= ref["median_ms"],
                "absolute_target_ms": limit,
                "absolute_met": None if limit is None else kiln["median_ms"] <= limit,
            }
        )
    return out


def target_table(results: list[dict[str, Any]]) -> list[str]:
    rows = targets(results)
    if not rows:
        return []
    lines = [
        "",
        "## Targets (issue 12): Kiln's fastest engine vs the fastest of torch.compile (NCHW, channels_last) "
        "and ORT CUDA FP16 + CUDA graph by hand",
        "",
        "| model | batch | Kiln engine | Kiln ms | fastest reference | reference ms | Kiln / reference "
        "| absolute target |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for t in rows:
        absolute = (
            "-"
            if t["absolute_target_ms"] is None
            else f"<= {t['absolute_target_ms']} ms: {'met' if t['absolute_met'] else 'NOT met'}"
        )
        lines.append(
            f"| {t['model']} | {t['batch']} | {t['kiln_row']} | {t['kiln_ms']:.3f} | {t['reference_row']} | "
            f"{t['reference_ms']:.3f} | {t['kiln_vs_reference']:.2f} | {absolute} |"
        )
    return lines


def autotune_table(results: list[dict[str, Any]]) -> list[str]:
    """What the autotuned Kiln engine chose per batch, vs its configured settings, and how many candidates it timed."""
    lines = [
        "",
        "## Kiln autotune choices",
        "",
        "| model | batch | chosen settings | chosen ms | configured ms | candidates | tune s |",
        "|---|---|---|---|---|---|---|",
    ]
    seen = set()
    for r in results:
        tuned = r.get("autotune") or {}
        if r.get("row") != "kiln" or (r["model"], r.get("batch")) in seen:
            continue
        seen.add((r["model"], r.get("batch")))
        if tuned.get("skipped") or "trials" not in tuned:
            lines.append(f"| {r['model']} | {r.get('batch')} | skipped: {tuned.get('skipped')} | | | | |")
            continue
        choice = (tuned.get("choice_by_batch") or {}).get(str(r["batch"]), tuned["choice"])
        n = sum(1 for t in tuned["trials"] if t.get("batch") in (None, r["batch"]))
        lines.append(
            f"| {r['model']} | {r['batch']} | `{json.dumps(choice['knobs'])}` | {choice.get('median_ms')} | "
            f"{choice.get('base_ms')} | {n} | {tuned.get('seconds')} |"
        )
    return lines if len(lines) > 5 else []  # 5: the heading and the header rows


PAIR = r"([A-Za-z_][\w.]*)=((?:(?!,[A-Za-z_][\w.]*=)[^=])+)"  # a value: no "=", up to the next ",key="
ENTRIES = re.compile(f"{PAIR}(?:,{PAIR})*")


def inductor_entries(text: str) -> dict[str, Any]:
    """``a=true,b.c=3,d=ATEN,TRITON``-style pairs; a value runs to the next ``,key=`` (so values may hold commas).
    Anything else is an argparse error, not a silently dropped or misread entry."""
    if not ENTRIES.fullmatch(text):
        raise argparse.ArgumentTypeError(f"not KEY=VALUE[,KEY=VALUE...] with Inductor config names: {text!r}")
    out: dict[str, Any] = {}
    for key, raw in re.findall(PAIR, text):
        if raw.lower() in ("true", "false"):
            out[key] = raw.lower() == "true"
        elif re.fullmatch(r"-?\d+", raw):
            out[key] = int(raw)
        elif re.fullmatch(r"-?\d+\.\d*([eE]-?\d+)?|-?\d+[eE]-?\d+", raw):
            out[key] = float(raw)
        else:
            out[key] = raw
    return out


def torch_variant(text: str) -> tuple[str, dict[str, Any]]:
    """``NAME:KEY=VALUE,...`` -> (row ``kiln_torch_NAME``, its entries) for ``--torch-variant``."""
    name, sep, entries = text.partition(":")
    if not sep or not re.fullmatch(r"[a-z0-9_]+", name):
        raise argparse.ArgumentTypeError(f"not NAME:KEY=VALUE[,KEY=VALUE...] (NAME in a-z, 0-9, _): {text!r}")
    return f"kiln_torch_{name}", inductor_entries(entries)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--smoke", action="store_true", help="tiny models, few iterations, CPU is fine")
    p.add_argument("--models", default="resnet18,bert_base,hf_bert")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--rows", default=",".join(ROWS), help=f"subset of {','.join(ROWS)}")
    p.add_argument("--compile-mode", default="max-autotune")
    p.add_argument("--iterations", type=int, default=100)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--eval-samples", type=int, default=256)
    p.add_argument("--bert-layers", type=int, default=12)
    p.add_argument(
        "--torch-flavour",
        default="auto",
        choices=["auto", "aotinductor", "compiled"],
        help="kiln_torch: build.torch.flavour (compiled skips the AOTInductor package)",
    )
    p.add_argument(
        "--torch-inductor",
        type=inductor_entries,
        default={},
        metavar="KEY=VALUE,...",
        help="kiln_torch rows: build.torch.inductor entries, e.g. triton.enable_persistent_tma_matmul=true",
    )
    p.add_argument(
        "--torch-variant",
        type=torch_variant,
        action="append",
        default=[],
        metavar="NAME:KEY=VALUE,...",
        help="an extra row kiln_torch_NAME built with these build.torch.inductor entries (a key naming a "
        "build.torch setting sets it: freezing=true, gemm_epilogues=MODE, merge_linears=false); "
        "repeatable",
    )
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="after timing each row and batch, N calls under torch.profiler: kernel time, count, top kernels",
    )
    p.add_argument("--autotune-budget", type=float, default=90.0, help="seconds of candidate timing per kiln engine")
    p.add_argument("--autotune-iterations", type=int, default=20, help="timed runs per autotune candidate")
    args = p.parse_args()
    args.models, args.rows = args.models.split(","), args.rows.split(",")
    args.batches = [int(b) for b in args.batches.split(",")]
    args.torch_variants = dict(args.torch_variant)
    if len(args.torch_variants) < len(args.torch_variant) or set(args.torch_variants) & set(ROWS):
        p.error("--torch-variant names must be unique and not name a built-in row")
    args.rows += [r for r in args.torch_variants if r not in args.rows]
    if args.smoke:
        args.iterations, args.warmup, args.eval_samples = min(args.iterations, 5), min(args.warmup, 2), 16
        args.autotune_iterations = min(args.autotune_iterations, 5)
        args.batches = [b if b <= 4 else 4 for b in args.batches]
    unknown = set(args.rows) - set(ROWS) - set(args.torch_variants)
    if unknown:
        p.error(f"unknown rows {sorted(unknown)}; choose from {ROWS}")
    logging.basicConfig(level=logging.WARNING)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    bench = Bench(args)
    env = bench.env
    env.update(
        {
            "device": torch.cuda.get_device_name(0) if bench.cuda else f"CPU ({platform.processor() or 'x86'})",
            "command": " ".join(["python", *sys.argv]),
            "torch": torch.__version__,
            "python": platform.python_version(),
        }
    )
    try:
        import onnxruntime as ort

        env["onnxruntime"] = ort.__version__
        env["ort_providers"] = ort.get_available_providers()
    except ImportError:
        pass
    say(f"engine bench on {env['device']}: models {args.models}, batches {args.batches}, rows {args.rows}")
    specs = model_specs(args.smoke, args.bert_layers)
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.models:
        bench.run_model(name, *specs[name])
        bench.save()
    print(markdown(bench.results, env), flush=True)


def write_results(args: argparse.Namespace, env: dict[str, Any], results: list[dict[str, Any]]) -> None:
    (args.out / "engine_bench.json").write_text(
        json.dumps(
            {"env": env, "args": vars(args) | {"out": str(args.out)}, "results": results, "targets": targets(results)},
            indent=2,
            default=str,
        )
    )
    (args.out / "engine_bench.md").write_text(markdown(results, env))


if __name__ == "__main__":
    main()
