"""`kiln precision FILE` of a graph quantized or in float16 in part: the INT8 and FP16 variants it cannot be made
into are refused naming what the graph holds, never with the quantizer's or the converter's own error."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kiln.core.errors import ModelError
from kiln.pipeline.config import config_from_dict
from kiln.pipeline.runner import settings_for
from kiln.pipeline.stage_list import stage_named
from kiln.stages.precision.audit import FP32_HINT
from kiln.stages.precision.direct import precision_direct
from tests.stages.precision.carried_graphs import fake_quant_graph, half_head_graph


def _settings() -> object:
    return settings_for(stage_named("precision"), config_from_dict({}))


def _data(path: Path, shape: tuple[int, ...]) -> Path:
    np.savez(path, input=np.random.default_rng(1).random((64, *shape), dtype=np.float32))
    return path


def test_int8_of_a_graph_quantized_in_part_names_its_qdq_nodes(tmp_path: Path) -> None:
    model = fake_quant_graph(tmp_path / "part", whole=False) / "model.onnx"
    with pytest.raises(ModelError) as raised:
        precision_direct(model, tmp_path / "v", ["int8"], _data(tmp_path / "d.npz", (1, 8, 8)), _settings())
    said, fix = raised.value.message, raised.value.hint or ""
    assert (
        "int8: int8 not made: the graph is quantized in part already (2 Q/DQ pairs" in said
        and "quantizing twice" in said
    ), said
    assert fix.startswith(FP32_HINT) and "opset" not in fix


def test_fp16_and_int8_of_a_graph_in_float16_in_part_name_its_float16_weights(tmp_path: Path) -> None:
    model = half_head_graph(tmp_path / "half.onnx")
    with pytest.raises(ModelError) as raised:
        precision_direct(model, tmp_path / "v", ["fp16", "int8"], _data(tmp_path / "d.npz", (16,)), _settings())
    said = raised.value.message
    assert "fp16: fp16 not made: the graph is in float16 in part already (1 float16 weight" in said, said
    assert "onnxconverter-common refuses to convert a graph already in float16" in said
    assert "int8: int8 not made: the graph is in float16 in part already" in said and "check_fp16_ready" not in said
