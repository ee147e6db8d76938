"""A run from an ONNX file whose graph cannot take a size signature.shapes asks for: the precision stage, which
runs the FP32 graph on validation's held-out inputs first, stops with validation's one error and fix, not with
ONNX Runtime's traceback."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kiln.core.data import DatasetSplits
from tests.pipeline.test_faults import assert_clean, invoke
from tests.stages.precision.token_graph import token_graph, token_ids


def tokens() -> DatasetSplits:
    x = torch.from_numpy(token_ids(48))
    return DatasetSplits({"input_ids": x[:32]}, None, {"input_ids": x[32:]}, None)


@pytest.mark.parametrize("variants", ["[fp32]", "[fp32,int8]"])
def test_a_size_the_graph_cannot_run_is_validations_one_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, variants: str
) -> None:
    monkeypatch.setitem(sys.modules, "refusal_data", sys.modules[__name__])
    model = token_graph(tmp_path / "pos.onnx", table=16)  # runs at seq=16 only
    config = tmp_path / "run.yaml"
    config.write_text(f"model: {{onnx: {model}}}\ndata: {{name: 'refusal_data:tokens'}}\n")
    sets = ["build.backends=[onnxruntime]", f"precision.variants={variants}", "signature.batch_sizes=[1, 8]"]
    sets.append("signature.shapes={seq: [4, 24]}")
    result = invoke("run", config, "-w", tmp_path / "w", *(a for s in sets for a in ("--set", s)))
    assert_clean(
        result, 2, "error: ONNX Runtime cannot run the reference, model.onnx pos.onnx, on the validation inputs"
    )
    assert "int64[8, 24]" in result.output and "give signature.shapes sizes the graph takes" in result.output
