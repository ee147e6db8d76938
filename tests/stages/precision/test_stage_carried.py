"""A model that carries its own quantization through the precision stage's pipeline entry: a fake-quant (QAT)
model's INT8 variant is its graph as exported, never quantized a second time, and its FP32 and FP16 variants are
left out (that INT8 graph, mislabelled); a graph quantized in part keeps its FP32 variant alone."""

from __future__ import annotations

from collections import Counter
from functools import partial
from pathlib import Path

import onnx
import pytest

from kiln.core.errors import ModelError
from kiln.core.records import Variants
from kiln.pipeline.config import config_from_dict
from kiln.pipeline.runner import load_dataset
from kiln.stages.precision.stage import run
from tests.conftest import stage_context, tiny_config_dict
from tests.stages.precision.carried_graphs import fake_quant_graph


def _run(workdir: Path, optimize_dir: Path, variants: list[str]) -> tuple[dict, dict]:
    cfg = config_from_dict(tiny_config_dict(**{"precision.variants": variants}))
    out = workdir / "precision"
    ctx = stage_context(
        "precision", cfg, workdir, out, {"optimize": optimize_dir}, load_dataset=partial(load_dataset, cfg)
    )
    out.mkdir(parents=True)
    summary = run(ctx).model_dump(mode="json")
    return Variants.read(out / "variants.json", hint="").variants, summary


def _qdq(path: Path) -> Counter[str]:
    ops = Counter(n.op_type for n in onnx.load(path).graph.node)
    return Counter({k: ops[k] for k in ("QuantizeLinear", "DequantizeLinear")})


def test_a_fake_quant_model_int8_variant_is_its_graph_as_exported(tmp_path: Path) -> None:
    optimized = fake_quant_graph(tmp_path / "optimize", whole=True)
    variants, summary = _run(tmp_path, optimized, ["fp32", "fp16", "int8"])
    assert set(variants) == {"int8"}, summary["failed"]
    int8 = tmp_path / "precision" / variants["int8"].path
    assert _qdq(int8) == _qdq(optimized / "model.onnx")  # its own Q/DQ pairs, none added beside them
    assert "the model carries its own quantization (4 Q/DQ pairs" in variants["int8"].report["graph"]
    assert set(summary["failed"]) == {"fp32", "fp16"}
    assert "an fp32 variant would be that int8 graph labelled fp32" in summary["failed"]["fp32"]
    assert "fp32 not made: the model carries its own quantization" in summary["failed"]["fp32"]
    assert not (tmp_path / "precision" / "fp32").exists() and not (tmp_path / "precision" / "fp16").exists()


def test_a_fake_quant_model_without_int8_among_the_variants_is_refused(tmp_path: Path) -> None:
    optimized = fake_quant_graph(tmp_path / "optimize", whole=True)
    with pytest.raises(ModelError) as raised:
        _run(tmp_path, optimized, ["fp32", "fp16"])
    assert "the graph is already int8, and precision.variants (fp32, fp16) has no int8" in raised.value.message
    assert (raised.value.hint or "").startswith("add int8 to precision.variants")


def test_a_graph_quantized_in_part_keeps_its_fp32_variant_alone(tmp_path: Path) -> None:
    optimized = fake_quant_graph(tmp_path / "optimize", whole=False)
    variants, summary = _run(tmp_path, optimized, ["fp32", "fp16", "int8"])
    assert set(variants) == {"fp32"} and set(summary["failed"]) == {"fp16", "int8"}
    assert "int8 not made: the graph is quantized in part already (2 Q/DQ pairs" in summary["failed"]["int8"]
    assert "quantizing twice" in summary["failed"]["int8"]
    assert "FP16 conversion cannot convert its Q/DQ nodes" in summary["failed"]["fp16"]
    assert _qdq(tmp_path / "precision" / "fp32" / "model.onnx") == _qdq(optimized / "model.onnx")
