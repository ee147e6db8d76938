"""Settings of INT8 calibration (Q/DQ graphs for ONNX Runtime and TensorRT)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from kiln.core.sections import AutoOnOff, Section

# Compute ops plus the pooling and data-movement ops between them, so Q/DQ pairs line up with what TensorRT
# and ONNX Runtime fuse into INT8 kernels. Normalisations, Softmax, GELU and bias/residual adds stay float.
DEFAULT_OP_TYPES = (
    "Conv",
    "ConvTranspose",
    "MatMul",
    "Gemm",
    "Relu",
    "MaxPool",
    "AveragePool",
    "GlobalAveragePool",
    "Concat",
    "Reshape",
    "Transpose",
    "Flatten",
    "Squeeze",
    "Unsqueeze",
)


class CalibrationConfig(Section):
    # How the run checks the reader's batches are unchanged, not what they are: not part of any stage's cache key
    UNKEYED: ClassVar[tuple[str, ...]] = ("skip_unchanged", "depends_on")

    method: Literal["minmax", "entropy", "percentile"] = Field(
        "minmax", description="how activation ranges are chosen from the calibration data"
    )
    num_batches: int = Field(8, ge=1, description="calibration batches (a fixed number: the cache key depends on it)")
    batch_size: int = Field(
        32,
        ge=1,
        description="rows per calibration batch; batches hold at most the largest signature.batch_sizes (fewer for "
        "a graph whose outputs answer fewer rows a call), the batch_size x num_batches rows then in more batches",
    )
    reader: str | None = Field(
        None,
        description="user data reader 'package.module:function' returning an iterable of input batches; "
        "default: the run's training split, preprocessed like validation data",
    )
    reader_params: dict[str, Any] = Field(default_factory=dict, description="keyword arguments for the reader")
    skip_unchanged: bool = Field(
        False,
        description="a reader: a run whose precision stage is cached does not call it while its code, params and "
        "every file it read last time are unchanged (as data.skip_unchanged)",
    )
    depends_on: list[str] = Field(
        default_factory=list,
        description="with skip_unchanged: files or folders the reader reads that Python's open() does not see",
    )
    percentile: float = Field(99.999, gt=90, le=100, description="percentile method only")
    per_channel: bool = Field(True, description="per-output-channel weight scales")
    activation_type: Literal["int8", "uint8"] = Field(
        "int8", description="int8 (symmetric): what TensorRT executes; uint8: ONNX Runtime's faster x86 CPU kernels"
    )
    symmetric_activations: bool = Field(True, description="zero-point 0 for activations (what TensorRT requires)")
    ort_cpu_graph: bool = Field(
        True,
        description="also write an INT8 graph made for ONNX Runtime CPU engines (see ort_cpu_scheme); "
        "TensorRT engines keep the symmetric int8 Q/DQ graph",
    )
    ort_cpu_scheme: Literal["auto", "static", "dynamic"] = Field(
        "auto",
        description="how that ONNX Runtime CPU graph is quantized. static: calibrated, asymmetric uint8 "
        "activations (ORT's fastest x86 kernels for convolutions); dynamic: MatMul/Gemm layers and "
        "LSTMs (ORT's DynamicQuantizeLSTM; it has no int8 GRU or RNN kernel), activation ranges "
        "measured per batch at run time, so a sample's output depends slightly on its batch mates "
        "(ONNX Runtime's advice for Transformers); auto: dynamic when the graph has MatMul, Gemm or "
        "LSTM layers and no convolutions, or more of its FLOPs in those than in convolutions (a ViT's patch "
        "embedding), else static",
    )
    op_types: list[str] = Field(
        default_factory=lambda: list(DEFAULT_OP_TYPES),
        description="op types to quantize; norms, Softmax and element-wise math stay float by default",
    )
    quantize_bias: bool = Field(
        False,
        description="int32 bias Q/DQ: ONNX Runtime accepts it, TensorRT's parser "
        "rejects it, so biases stay float by default",
    )
    reduce_range: AutoOnOff = Field(
        "off",
        description="7-bit weights (ONNX Runtime's reduce_range), for INT8 graphs served by a runtime that "
        "cannot be told to avoid saturation on x86 CPUs without VNNI (e.g. Triton's onnxruntime "
        "backend); Kiln's own ONNX Runtime sessions there use exact kernels instead "
        "(kiln.core.cpu_int8). auto = on where the machine that quantizes is such a CPU. Every "
        "INT8 graph, TensorRT's Q/DQ one too; weights only: calibration ranges are shared",
    )
    exclude_nodes: list[str] = Field(default_factory=list, description="node names kept in float")
    exclude_op_types: list[str] = Field(
        default_factory=list,
        description="op types among op_types kept in float, e.g. [Gemm]; [LSTM] keeps the LSTMs of the dynamic "
        "ONNX Runtime CPU graph (ort_cpu_scheme) in float",
    )
    exclude_first_last: bool = Field(
        False, description="keep the first Conv/MatMul/Gemm and the last before each output in float"
    )
    keep_output_layers: AutoOnOff = Field(
        "auto",
        description="keep the last Conv/MatMul/Gemm before each output in float (auto: before a sigmoid output, "
        "whose scores a quantized layer gives 256 values: a heatmap's ties are peaks of their own)",
    )
    cache: bool = Field(True, description="reuse calibration ranges across runs (keyed on model, data, settings)")
    trt_table: bool = Field(True, description="also write a TensorRT 10 IInt8Calibrator calibration table")

    @model_validator(mode="after")
    def _dynamic_needs_matmul(self) -> CalibrationConfig:
        if self.ort_cpu_scheme == "dynamic" and ("MatMul" not in self.op_types or "MatMul" in self.exclude_op_types):
            raise ValueError(
                "ort_cpu_scheme 'dynamic' quantizes MatMul layers (and LSTMs), and MatMul is not among the "
                "quantized op types (op_types / exclude_op_types); use 'static' or 'auto'"
            )
        return self
