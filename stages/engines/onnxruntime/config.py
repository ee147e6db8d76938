"""``build.onnxruntime``: ONNX Runtime engines' session settings, CUDA provider options and build-time autotuning."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from kiln.core.sections import AutoOnOff, Section


class OrtCudaConfig(Section):
    """onnxruntime-gpu's CUDA execution provider: how much autotuning and which launch tricks."""

    conv_algo_search: Literal["EXHAUSTIVE", "HEURISTIC", "DEFAULT"] = Field(
        "EXHAUSTIVE", description="cuDNN convolution algorithm search; EXHAUSTIVE benchmarks every algorithm once"
    )
    prefer_nhwc: AutoOnOff = Field(
        "auto",
        description="NHWC kernels for convolutions; auto = on when the graph has Conv and precision is fp16/int8",
    )
    cuda_graph: bool = Field(True, description="capture one CUDA graph per fixed input shape (removes launch overhead)")
    tf32: bool = Field(False, description="allow TF32 math in FP32 engines (faster, ~1e-3 relative error)")
    device_id: int = Field(0, ge=0)


class OrtAutotuneConfig(Section):
    """Build-time autotuning of ORT engines (like TensorRT's tactic selection): time candidate session settings on
    the target machine, per optimization batch size, and record the fastest that still agrees with the reference."""

    cuda: bool = Field(True, description="autotune CUDA engines (skipped, with the reason logged, without a CUDA EP)")
    cpu: bool = Field(
        False, description="autotune CPU engines too (threads / execution mode); one choice for all shapes"
    )
    cuda_knobs: dict[str, list[Any]] = Field(
        default_factory=lambda: {
            "prefer_nhwc": [True, False],
            "conv_algo_search": ["EXHAUSTIVE", "HEURISTIC", "DEFAULT"],
            "conv_max_workspace": [True, False],
            "cuda_graph": [True, False],
            "transformer_fusion": [True, False],
        },
        description="knob -> values tried (first value listed = tried first); knobs that cannot matter for the model"
        " (conv knobs without Conv, fusion when nothing fused) are dropped",
    )
    cpu_knobs: dict[str, list[Any]] = Field(
        default_factory=lambda: {"intra_op_threads": [0, 1], "execution_mode": ["sequential", "parallel"]}
    )
    strategy: Literal["greedy", "grid"] = Field(
        "greedy",
        description="greedy: one knob at a time from the configured settings, keeping the best so far"
        " (1 + sum(values - 1) candidates); grid: every combination",
    )
    batch_sizes: list[int] = Field(
        default_factory=list,
        description="batch sizes tuned; empty = 1 and the build's max batch (max of signature.batch_sizes)",
    )
    warmup: int = Field(5, ge=1, description="untimed runs per candidate (CUDA-graph capture, cuDNN search)")
    iterations: int = Field(20, ge=3, description="timed runs per candidate; the median counts")
    time_budget_s: float = Field(180.0, gt=0, description="stop trying new candidates after this many seconds")
    min_gain: float = Field(
        0.03,
        ge=0,
        lt=1,
        description="keep the configured settings unless a candidate is faster"
        " by more than this fraction (timing noise is no reason)",
    )
    min_cosine: float = Field(0.999, ge=0, le=1, description="a candidate must reach this cosine vs the FP32 reference")
    min_top1: float = Field(
        0.99, ge=0, le=1, description="and this top-1 agreement (near-ties in the reference excused)"
    )


class OnnxRuntimeConfig(Section):
    devices: list[Literal["cpu", "cuda"]] = Field(default_factory=lambda: ["cpu"])
    intra_op_threads: int = Field(0, ge=0, description="0 = one per physical core")
    inter_op_threads: int = Field(0, ge=0, description="used only with execution_mode parallel; 0 = default")
    execution_mode: Literal["sequential", "parallel"] = "sequential"
    transformer_fusion: AutoOnOff = Field(
        "auto",
        description="onnxruntime.transformers fusions (Attention, SkipLayerNorm, BiasGelu); ORT engines only;"
        " auto = when the graph has attention-like ops and the fused graph computes the same",
    )
    fp16_source: Literal["fp32_graph", "precision_graph"] = Field(
        "fp32_graph",
        description="fp16 ORT engines: fuse the FP32 graph then convert with ORT's converter (keeping"
        " the precision stage's kept_fp32 ops), or take the precision stage's FP16 graph",
    )
    fusion_model_type: str = Field("bert", description="model_type passed to onnxruntime.transformers.optimizer")
    cuda: OrtCudaConfig = Field(default_factory=OrtCudaConfig)
    autotune: OrtAutotuneConfig = Field(default_factory=OrtAutotuneConfig)
