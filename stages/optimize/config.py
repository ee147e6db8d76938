"""Settings of the optimize stage."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from kiln.core.sections import Section, Seed
from kiln.stages.optimize.catalog import resolve

# Order matters: fold first so patterns see constants, fuse, then fold/clean again what fusions exposed.
DEFAULT_PASSES: list[str] = [
    "fold_constants",
    "split_to_sequence",
    "eliminate_identity",
    "eliminate_noop",
    "eliminate_neutral",
    "eliminate_zero_rnn_state",
    "fold_conv_bn",
    "fold_conv_add",
    "merge_transposes",
    "merge_reshapes",
    "fold_scalar_mul",
    "fuse_layernorm",
    "fuse_gelu",
    "canonical_softmax",
    "merge_qkv",
    "matmul_add_to_gemm",
    "cse",
    "fold_constants",
    "remove_unused_initializers",
    "toposort",
]


class OptimizeConfig(Section):
    passes: list[str | dict[str, Any]] = Field(
        default_factory=lambda: list(DEFAULT_PASSES),
        description="graph passes in order: names, or {name: ..., <params>} mappings "
        "(see kiln.stages.optimize.registry)",
    )
    rounds: int = Field(
        3,
        ge=1,
        description="repeat the pass list while a round still removes nodes, at most this "
        "many times (a fixpoint: fusions expose new folds)",
    )
    verify: bool = Field(
        True, description="after each pass, compare before/after in ONNX Runtime; roll back a pass that changes outputs"
    )
    rtol: float = Field(1e-4, gt=0, description="safety net: allowed error relative to the largest reference output")
    atol: float = Field(1e-5, ge=0, description="safety net: allowed absolute error")
    verify_batch: int = Field(2, ge=1, description="safety net: size given to dynamic (symbolic) input axes")
    int_high: int = Field(
        16,
        ge=0,
        description="safety net: integer inputs are drawn from [0, int_high], or from "
        "the range the data holds where the export recorded it "
        "(export/int_ranges.json)",
    )
    seed: Seed = Field(0, description="safety net: seed of the random inputs")

    @field_validator("passes")
    @classmethod
    def _known_passes(cls, v: list[str | dict[str, Any]]) -> list[str | dict[str, Any]]:
        # Raises ConfigError (listing the available passes) for unknown names or bad params, at config load.
        for entry in v:
            resolve(entry)
        return v
