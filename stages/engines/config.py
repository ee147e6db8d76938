"""Settings of the build stage. Every knob is documented in ``stages/engines/README.md``."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from kiln.core.sections import AutoOnOff, Section, bool_words


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
        description="batch sizes tuned; empty = 1 and the build's max batch (max of validate.batch_sizes)",
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


class ShapeRange(Section):
    """One input's shapes in a TensorRT optimization profile (full shapes, batch axis included)."""

    min: list[int]
    opt: list[int]
    max: list[int]

    @model_validator(mode="after")
    def _ordered(self) -> ShapeRange:
        if not (len(self.min) == len(self.opt) == len(self.max)):
            raise ValueError(f"min/opt/max must have the same rank, got {self.min}, {self.opt}, {self.max}")
        if any(not (a <= b <= c) for a, b, c in zip(self.min, self.opt, self.max)):
            raise ValueError(f"need min <= opt <= max on every axis, got {self.min}, {self.opt}, {self.max}")
        if any(d < 1 for d in self.min):
            raise ValueError(f"shape dims must be >= 1, got min {self.min}")
        return self


class TensorRTConfig(Section):
    enabled: Annotated[Literal["auto", "always", "never"], bool_words("always", "never")] = Field(
        "auto", description="auto builds when tensorrt or tensorrt_rtx imports; always fails if neither does"
    )
    optimization_level: int = Field(3, ge=0, le=5, description="builder optimization level: higher tunes longer")
    workspace_mb: int = Field(1024, ge=16, description="WORKSPACE memory-pool limit")
    tactic_shared_memory_kb: int | None = Field(None, ge=0, description="TACTIC_SHARED_MEMORY pool limit")
    tactic_sources: list[str] | None = Field(
        None,
        description="TacticSource names to allow (e.g. [CUBLAS, CUDNN, EDGE_MASK_CONVOLUTIONS,"
        " JIT_CONVOLUTIONS]); null = library default",
    )
    avg_timing_iterations: int | None = Field(None, ge=1, description="timing runs averaged per tactic; null = default")
    timing_cache: bool = Field(True, description="load the timing cache before each build and save it after")
    max_aux_streams: int | None = Field(
        None, ge=0, description="0 = a single stream: friendlier to CUDA-graph capture; null = builder decides"
    )
    cuda_graph: bool = Field(
        True,
        description="the runner captures a CUDA graph per input shape (TensorRT 10/11);"
        " TensorRT-RTX uses its runtime CUDA-graph strategy",
    )
    compute_capabilities: list[str] = Field(
        default_factory=list,
        description="TensorRT-RTX targets, e.g. [SM89, SM120] or [CURRENT]; empty = library"
        " default. Lets a CPU machine build for a GPU it does not have",
    )
    profiles: list[dict[str, ShapeRange]] = Field(
        default_factory=list,
        description="optimization profiles: input name -> {min, opt, max}; empty = one profile"
        " with dynamic batch 1..max(validate.batch_sizes)",
    )
    calibration_cache: str | None = Field(
        None, description="TensorRT 10 INT8 only: calibration cache file read by the entropy calibrator"
    )
    fp32_op_types: list[str] = Field(
        default_factory=lambda: ["LayerNormalization", "Softmax", "Reduce", "Normalization"],
        description="TensorRT 10 weakly typed only: layers whose name/type contains these stay FP32",
    )
    detailed_profiling: bool = Field(True, description="DETAILED profiling verbosity: richer inspector layer info")

    @field_validator("compute_capabilities")
    @classmethod
    def _upper(cls, v: list[str]) -> list[str]:
        return [c.upper() for c in v]


EpilogueMode = Annotated[Literal["auto", "off", "bias", "bias_gelu", "bias_any_gelu"], bool_words(None, "off")]


class TorchConfig(Section):
    """Inductor engines built from the trained PyTorch model itself (``torch.export``, then an AOTInductor package or
    the compiled flavour): opt-in, ``build.backends: [onnxruntime, tensorrt, torch]``."""

    devices: list[Literal["cpu", "cuda"]] = Field(default_factory=lambda: ["cpu"])
    max_autotune: AutoOnOff = Field(
        "auto", description="Inductor max-autotune (benchmarks Triton/GEMM/conv choices): auto = on the GPU only"
    )
    coordinate_descent: AutoOnOff = Field(
        "auto",
        description="with max-autotune, Inductor's coordinate-descent tuning of each Triton kernel's block "
        "sizes (on in torch.compile's max-autotune modes): auto = only for models with Conv2d. "
        "On the H200 it left a BERT-base's LayerNorm kernels anywhere from 0.14 to 0.69 ms over "
        "five builds (0.21 ms without, one build), and the build took 40.8 s, not 15.7 "
        "(gpu_session10.md)",
    )
    channels_last: AutoOnOff = Field(
        "auto",
        description="channels_last memory format for 4-D inputs and weights (the inputs only for a frozen "
        "AOTInductor package: recorded as channels_last_weights); auto = when the model has Conv2d",
    )
    flavour: Literal["auto", "aotinductor", "compiled"] = Field(
        "auto",
        description="aotinductor: one AOTInductor package; compiled: the exported program plus Inductor's "
        "cache artifacts, compiled with torch.compile when the engine is loaded; auto: "
        "compiled where gemm_epilogues or conv_epilogues applies (FP16 GPU engines by default), "
        "otherwise aotinductor, or compiled when the package fails to compile or to load",
    )
    cuda_graphs: AutoOnOff = Field(
        "auto",
        description="the compiled flavour on the GPU replays each batch size's kernels as one CUDA graph, "
        "captured on the size's first call (outputs copied out of the graph's memory): auto = on "
        "on the GPU",
    )
    freezing: bool = Field(
        False,
        description="Inductor freezing: the weights become constants Inductor may fold and rearrange (the Q, K "
        "and V projections as one matrix multiply, BatchNorm into convolutions); off by default: "
        "on the H200 it took a BERT-base from 0.811 / 2.555 to 0.660 / 2.462 ms (batch 1 / 32, "
        "with cuBLAS GEMMs; gpu_session8.md) and one build took 155 s; on the CPU it sped up the "
        "compiled flavour (ResNet-18 23.4 -> 17.6 ms at batch 1), not AOTInductor packages "
        "(engine_bench_cpu_resnet18_freezing_*.md)",
    )
    gemm_epilogues: EpilogueMode = Field(
        "auto",
        description="the compiled flavour's linear layers as cuBLASLt GEMMs with the bias (bias), or bias and "
        "GELU (bias_gelu: GELUs the epilogue computes as the model does, the tanh one on the GPU; "
        "bias_any_gelu: every GELU, on the GPU as the tanh approximation) in the GEMM's epilogue "
        "instead of Inductor's GEMMs (kiln.stages.engines.gemm_epilogues). auto: bias_any_gelu "
        "for FP16 GPU engines (their flavour then is compiled), off for the others and with "
        "flavour aotinductor",
    )
    conv_epilogues: AutoOnOff = Field(
        "auto",
        description="the compiled flavour's 2-D convolutions with BatchNorm folded in and the bias, a residual "
        "add and the ReLU after them as one cuDNN call each (kiln.stages.engines.conv_epilogues). "
        "auto: on for FP16 GPU engines (their flavour then is compiled), off for the others and "
        "with flavour aotinductor. On the H200, ResNet-18 FP16 batch 1 / 32: 0.266 / 0.637 ms with "
        "Inductor's kernels, 0.181 / 0.470 with these (conv_epilogue_probe_h200_s12.md)",
    )
    merge_linears: bool = Field(
        True,
        description="with gemm_epilogues: linear layers with a bias that read the same tensor (an attention "
        "layer's Q, K and V projections) run as one GEMM over their concatenated weights, its "
        "output split back (kiln.stages.engines.gemm_epilogues.merge_parallel_linears)",
    )
    inductor: dict[str, bool | int | float | str] = Field(
        default_factory=dict,
        description="further torch._inductor.config entries set while the engine compiles "
        "(build and load), e.g. {'triton.enable_persistent_tma_matmul': true, "
        "'max_autotune_gemm_backends': 'ATEN,TRITON'}; names checked at build time",
    )
    load_check: bool = Field(
        True,
        description="load the built package once in a child process before accepting it"
        " (a package that crashes its loader is skipped, not served)",
    )
    load_check_timeout_s: float = Field(300.0, gt=0)

    @model_validator(mode="after")
    def _coordinate_descent_needs_max_autotune(self) -> TorchConfig:
        if self.coordinate_descent == "on" and self.max_autotune == "off":
            raise ValueError(
                "coordinate_descent 'on' tunes kernels only under max-autotune, and max_autotune is "
                "'off'; set max_autotune to 'on' or 'auto' (the GPU), or leave coordinate_descent 'auto'"
            )
        return self

    @model_validator(mode="after")
    def _epilogues_need_the_compiled_flavour(self) -> TorchConfig:
        if self.gemm_epilogues not in ("auto", "off") and self.flavour == "aotinductor":  # said before training
            raise ValueError(
                "gemm_epilogues needs flavour compiled or auto: its GEMMs are custom ops written in "
                "Python, which an AOTInductor package cannot hold"
            )
        if self.conv_epilogues == "on" and self.flavour == "aotinductor":
            raise ValueError(
                "conv_epilogues needs flavour compiled or auto: its fused convolutions are custom ops "
                "written in Python, which an AOTInductor package cannot hold"
            )
        return self


class BuildConfig(Section):
    backends: list[Literal["onnxruntime", "tensorrt", "torch"]] = Field(
        default_factory=lambda: ["onnxruntime", "tensorrt"],
        min_length=1,
        description="engine kinds to build; torch (Inductor, from the trained model) is opt-in",
    )
    onnxruntime: OnnxRuntimeConfig = Field(default_factory=OnnxRuntimeConfig)
    tensorrt: TensorRTConfig = Field(default_factory=TensorRTConfig)
    torch: TorchConfig = Field(default_factory=TorchConfig)
