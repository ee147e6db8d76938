"""Where the dynamo exporter stopped at a branch on the inputs' values, the fix is that branch written with tensor
ops, whatever the TorchScript exporter then said: its trace would hold one side of the branch only, and the op it
failed on (one it cannot write, an error of its own) is not what to change."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from kiln.core.errors import ModelError
from kiln.stages.export.torch_export import DATA_BRANCH_FIX, _export_failed_hint, export_onnx, fixed_places

# The Reformer export's reasons (transformers' LSH attention), as the export stage said them
REFORMER = [
    "dynamo exporter: Could not guard on data-dependent expression u1 < 64 (unhinted: u1 < s31*s9).  (Size-like "
    "symbols: none)",
    "torchscript exporter: unordered_map::at",
]


def test_a_data_dependent_guard_gets_the_branch_fix_though_the_fallback_failed_on_its_own() -> None:
    hint = _export_failed_hint(REFORMER, 18)
    assert hint == f"the dynamo exporter stopped at a branch on the inputs' values: {DATA_BRANCH_FIX}"
    assert _export_failed_hint(["dynamo exporter: boom", "torchscript exporter: unordered_map::at"], 18) == (
        "the model may use an op ONNX cannot express; see the message above"
    )


class BranchThenI0e(nn.Module):
    """A branch on the inputs' values (dynamo stops), then an op the TorchScript exporter cannot write."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # BRANCH
            x = x * 2
        return torch.special.i0e(x)


BRANCH_AT = f"test_torch_export_data_dependent.py:{BranchThenI0e.forward.__code__.co_firstlineno + 1}"


def test_a_model_that_branches_on_its_values_is_told_to_write_the_branch_with_tensor_ops(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="data-dependent") as caught:
        export_onnx(BranchThenI0e(), torch.rand(2, 4), tmp_path / "m.onnx")
    assert "special_i0e" in caught.value.message  # the TorchScript exporter's own reason is still said
    hint = caught.value.hint or ""
    assert hint.startswith("the dynamo exporter stopped at a branch on the inputs' values, in forward() at "), hint
    assert f"{BRANCH_AT}: {DATA_BRANCH_FIX}" in hint


def test_the_places_a_fixed_axis_failure_names_are_read_back() -> None:
    funnel = (
        "it fixed input 'input_ids' axis 1 (seq), input 'attention_mask' axis 1 (seq), which signature.dynamic_axes "
        "makes dynamic, at modeling_funnel.py:152"
    )
    assert fixed_places(funnel) == "modeling_funnel.py:152"
    assert fixed_places("Cannot find a compatible OpOverload for aten.sub, at x.py:3") == ""
