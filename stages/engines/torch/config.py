"""``build.torch``: Inductor engines compiled from the trained PyTorch model."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from kiln.core.sections import AutoOnOff, Section, bool_words

EpilogueMode = Annotated[Literal["auto", "off", "bias", "bias_gelu", "bias_any_gelu"], bool_words(None, "off")]


class TorchConfig(Section):
    """Inductor engines built from the trained PyTorch model itself (``torch.export``, then an AOTInductor package or
    the compiled flavour): opt-in, ``build.backends: [onnxruntime, tensorrt, torch]``."""

    devices: list[Literal["cpu", "cuda"]] | Literal["auto"] = Field(
        "auto",
        description="auto: the GPU where torch sees one, else the CPU unless ONNX Runtime builds CPU engines in the "
        "same run (Inductor's CPU engines lost to them where measured); a list builds exactly those",
    )
    max_autotune: AutoOnOff = Field(
        "auto",
        description="Inductor max-autotune (benchmarks Triton/GEMM/conv choices): auto = on the GPU, except for "
        "FP8 and INT8 engines, whose GEMMs are PyTorch's own kernels (lowbit)",
    )
    coordinate_descent: AutoOnOff = Field(
        "auto",
        description="Inductor's coordinate-descent tuning of each of its Triton kernels' block sizes, on the GPU "
        "(on in torch.compile's max-autotune modes): auto = with max-autotune, for models with Conv2d (on "
        "transformers its choices varied from build to build and the build took longer); on = also without "
        "max-autotune (an FP8/INT8 engine's quantizing kernels)",
    )
    channels_last: AutoOnOff = Field(
        "auto",
        description="channels_last memory format for 4-D inputs and weights (the inputs only for a frozen "
        "AOTInductor package: recorded as channels_last_weights); auto = when the model has Conv2d",
    )
    lowbit_exclude: list[str] = Field(
        default_factory=list,
        description="linear layers (module names) an FP8 or INT8 GPU engine keeps in its higher precision "
        "(precision.variants: [fp8] or [int8]; kiln.stages.engines.torch.lowbit)",
    )
    lowbit_scaling: Literal["auto", "static", "tensorwise", "rowwise"] = Field(
        "auto",
        description="FP8/INT8 engines' scales (kiln.stages.engines.torch.lowbit): static (per tensor, the inputs' "
        "from calibration data: the fastest), tensorwise (per tensor, found at each call) or rowwise "
        "(per row, found at each call: the most precise); auto: the first of these whose outputs keep a "
        "cosine of 0.995 (half of FP8's default gate, 0.99) to the unquantized model's on a calibration "
        "batch (static only where the build has calibration data)",
    )
    flavour: Literal["auto", "aotinductor", "compiled"] = Field(
        "auto",
        description="aotinductor: one AOTInductor package; compiled: the exported program plus Inductor's "
        "cache artifacts, compiled with torch.compile when the engine is loaded; auto: "
        "compiled where gemm_epilogues or conv_epilogues applies (FP16 GPU engines by default) and "
        "for FP8 and INT8 engines (replayed as CUDA graphs), otherwise aotinductor, or compiled when the "
        "package fails to compile or to load",
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
        "and V projections as one matrix multiply, BatchNorm into convolutions); off by default: its "
        "gains depend on the model and it lengthens builds (benchmarks/README.md)",
    )
    gemm_epilogues: EpilogueMode = Field(
        "auto",
        description="the compiled flavour's linear layers as cuBLASLt GEMMs with the bias (bias), or bias and "
        "GELU (bias_gelu: GELUs the epilogue computes as the model does, the tanh one on the GPU; "
        "bias_any_gelu: every GELU, on the GPU as the tanh approximation) in the GEMM's epilogue "
        "instead of Inductor's GEMMs (kiln.stages.engines.torch.gemm_epilogues). auto: bias_any_gelu "
        "for FP16 GPU engines (their flavour then is compiled), off for the others and with "
        "flavour aotinductor. In FP8 GPU engines with static scales anything but off also runs a layer, "
        "its GELU and the next layer's input cast as one cuBLASLt call "
        "(kiln.stages.engines.torch.fp8_epilogues)",
    )
    conv_epilogues: AutoOnOff = Field(
        "auto",
        description="the compiled flavour's 2-D convolutions with BatchNorm folded in and the bias, a residual "
        "add and the ReLU after them as one cuDNN call each (kiln.stages.engines.torch.conv_epilogues). "
        "auto: on for FP16 GPU engines (their flavour then is compiled), off for the others and "
        "with flavour aotinductor",
    )
    fused_attention: AutoOnOff = Field(
        "auto",
        description="the compiled flavour's FP16/BF16 scaled_dot_product_attention calls as one custom op that "
        "PyTorch dispatches to its fused kernels (cuDNN, FlashAttention) at run time, where Inductor may fall back "
        "to an FP32 math form (kiln.stages.engines.torch.attention). auto: the calls without a mask (where the "
        "fallback was seen: a ViT's) in FP16, FP8 and INT8 GPU engines, a model it fails on built without it; "
        "on: every call, masked ones too; an AOTInductor package keeps Inductor's attention",
    )
    gemm_algorithms: Literal["heuristic", "measured"] = Field(
        "heuristic",
        description="the GPU GEMMs Kiln calls through cuBLASLt itself (gemm_epilogues' linear layers, an FP8 "
        "engine's layers with per-tensor scales): heuristic = cuBLASLt's first choice, as PyTorch's own calls "
        "make; measured = the fastest of its first 16 candidates (over the first only where 3 % faster), timed on "
        "each shape's first call (the compiled "
        "flavour's warm-up of each batch size), as TensorRT's builder times its tactics "
        "(kiln.stages.engines.torch.cublaslt; benchmarks/cublaslt_fp8_probe.py --algos compares them)",
    )
    merge_linears: bool = Field(
        True,
        description="with gemm_epilogues, and in FP8/INT8 engines: linear layers that read the same tensor (an "
        "attention layer's Q, K and V projections) run as one GEMM over their concatenated weights, its "
        "output split back (kiln.stages.engines.torch.gemm_epilogues.merge_parallel_linears, "
        "kiln.stages.engines.torch.lowbit.MergedLowbit)",
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
