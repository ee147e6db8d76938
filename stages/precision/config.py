"""Settings of the precision stage (FP16 mixed precision, INT8 via calibration, accuracy-driven fallback)."""

from __future__ import annotations

from typing import ClassVar, Literal, get_args

from pydantic import Field, model_validator

from kiln.core.sections import Section

Precision = Literal["fp32", "fp16", "int8", "fp8"]  # fp8: torch engines on GPUs with FP8 tensor cores
PRECISIONS: tuple[str, ...] = get_args(Precision)

# Ops whose FP16 result is unreliable: normalisation statistics, exponentials and powers overflow or lose
# the small differences they work on. Softmax is kept because its exp/sum is what overflows first. Sin/Cos/Tan
# read phases (timestep and position embeddings) that FP16 rounds by up to 0.25 rad near 1000.
DEFAULT_FP32_OPS = (
    "LayerNormalization",
    "GroupNormalization",
    "InstanceNormalization",
    "Softmax",
    "LogSoftmax",
    "Exp",
    "Log",
    "Pow",
    "Sqrt",
    "Reciprocal",
    "ReduceLogSumExp",
    "ReduceSumSquare",
    "ReduceL2",
    "ReduceLogSum",
    "ReduceProd",
    "CumSum",
    "Sin",
    "Cos",
    "Tan",
    # a sampling grid's coordinates in [-1, 1] step 2**-11 in FP16: a fraction of a pixel off on large images
    "AffineGrid",
    "GridSample",
)


class FP16Config(Section):
    keep_io_types: bool = Field(True, description="graph inputs/outputs keep FP32 (casts inside the graph)")
    fp32_ops: list[str] = Field(
        default_factory=lambda: list(DEFAULT_FP32_OPS), description="op types always kept in FP32"
    )
    fp32_nodes: list[str] = Field(default_factory=list, description="node names always kept in FP32")
    phase_fp32: bool = Field(
        True,
        description="keep FP32 the nodes computing the argument of a Sin/Cos/Tan kept FP32 from constants, integer "
        "inputs and small float inputs (a timestep or position embedding's t*freq): FP16's spacing is 0.5 between "
        "512 and 1024, so such a phase would be off by up to 0.25 rad; the chain reads no big activation, so it "
        "costs no speed",
    )
    decomposed_layernorm: bool = Field(True, description="keep LayerNorm written as ReduceMean/Sub/Pow/Sqrt in FP32")
    long_reduction: int = Field(
        1024,
        ge=1,
        description="sums and means over at least this many elements stay FP32 (a max or min is exact in FP16) "
        "(unknown/dynamic reduced axes count as long)",
    )
    range_check: bool = Field(True, description="keep ops whose weights or calibrated activations exceed FP16")
    range_limit: float = Field(
        32768.0,
        gt=0,
        le=65504.0,
        description="magnitude above which a tensor is out of FP16 range (headroom below 65504)",
    )


class FallbackConfig(Section):
    enabled: bool = Field(True, description="when a variant misses the target, keep offending nodes in FP32 and retry")
    min_top1_agreement: float | None = Field(
        None,
        ge=0,
        le=1.0,
        description="a target of its own for argmax agreement with the FP32 graph, on top of the validation gates "
        "the fallback always aims at (validate.gates for the variant's precision); null: the gates alone",
    )
    min_cosine: float | None = Field(
        None,
        ge=-1,
        le=1.0,
        description="a target of its own for cosine similarity (worst output) vs the FP32 graph, on top of the "
        "validation gates; null: the gates alone",
    )
    max_rounds: int = Field(4, ge=0, description="retries, each keeping more nodes in FP32")
    nodes_per_round: int = Field(2, ge=1, description="nodes moved to FP32 per round")
    samples: int = Field(
        512,
        ge=8,
        description="samples compared against FP32 by `kiln precision` (a pipeline run uses validation's held-out "
        "data, validate.max_samples)",
    )


class PrecisionConfig(Section):
    # read by validation alone (its SOURCES name them): no reason to make the graph variants again
    UNKEYED: ClassVar[tuple[str, ...]] = ("required", "require_speedup")

    variants: list[Precision] = Field(
        default_factory=lambda: ["fp32", "fp16", "int8"],
        min_length=1,
        description="graph precisions to make; each backend builds the ones it has (validation gates each engine)",
    )
    fp16: FP16Config = Field(default_factory=FP16Config)
    fallback: FallbackConfig = Field(default_factory=FallbackConfig)
    required: list[Precision] = Field(
        default_factory=list,
        description="precisions the run must deliver: with no engine of one validated, passed and packaged (its "
        "variant not made for its gates, no backend building it, or dropped as slower), validation fails (exit 3); "
        "without it such a precision is only said missing on the result line",
    )
    require_speedup: bool = Field(
        False,
        description="drop (do not package) an INT8/FP16 engine slower than the "
        "FP32 engine of its backend at the largest batch; else flag it. An INT8/FP8 engine slower than "
        "the FP16 engine of its backend and device is dropped either way",
    )
    node_errors: bool = Field(
        True,
        description="plot each variant's per-node error vs FP32 along the graph "
        "(precision/node_errors.png) and name the first diverging node",
    )

    @model_validator(mode="after")
    def _required_are_made(self) -> PrecisionConfig:
        """A precision the run must deliver is one it makes: else the run would fail only after every stage ran."""
        missing = [p for p in self.required if p not in self.variants]
        if missing:
            raise ValueError(f"precision.required {missing} are not among precision.variants {self.variants}")
        return self
