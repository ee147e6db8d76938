"""The build stage as the pipeline runs it: every (backend, device, precision) engine from variants.json."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kiln.core.errors import BuildError, ConfigError
from kiln.core.records import PrecisionVariant, Variants
from kiln.pipeline.config import config_from_dict
from kiln.stages.engines import stage
from kiln.stages.engines.backend import SIDECAR, read_metadata
from kiln.stages.engines.tensorrt.lib import import_tensorrt
from tests.conftest import stage_context

HAS_TRT = import_tensorrt() is not None


def _ctx(tmp_path: Path, zoo, build: dict) -> Any:
    precision_dir = tmp_path / "precision"
    variants = {}
    for p in ("fp32", "fp16", "int8"):
        (precision_dir / p).mkdir(parents=True)
        shutil.copy(zoo("cnn", p), precision_dir / p / "model.onnx")
        variants[p] = PrecisionVariant(path=f"{p}/model.onnx")
    Variants(variants=variants).write(precision_dir / "variants.json")
    cfg = config_from_dict({"build": build, "validate": {"batch_sizes": [1, 8]}})
    (tmp_path / "out").mkdir()
    return stage_context(
        "build", cfg, tmp_path, tmp_path / "out", {"precision": precision_dir}, log=logging.getLogger("test")
    )


@pytest.mark.tensorrt
def test_run_builds_every_engine(zoo, tmp_path: Path) -> None:
    ctx = _ctx(tmp_path, zoo, {"backends": ["onnxruntime", "tensorrt"]})
    result = stage.run(ctx)
    names = sorted(e.name for e in result.engines)
    assert names == sorted(
        [f"onnxruntime-cpu-{p}" for p in ("fp32", "int8")] + [f"tensorrt-{p}" for p in ("fp32", "fp16", "int8")]
    )
    assert [s for s in result.skipped if "computes 0% in fp16" not in s] == []  # ORT CPU runs FP16 in FP32
    for name in names:
        meta = read_metadata(ctx.out / name)
        assert (ctx.out / name / SIDECAR).is_file() and meta.name == name
    # Profiles default to dynamic batch 1..max(signature.batch_sizes); the cache is shared under ctx.cache_dir.
    trt = read_metadata(ctx.out / "tensorrt-fp16")
    assert trt.backend_info["profiles"][0]["input"]["max"][0] == 8 and trt.source.file == "model.onnx"
    if "path" in trt.backend_info["timing_cache"]:  # full TensorRT; TensorRT-RTX keeps no timing cache (a note says so)
        assert Path(trt.backend_info["timing_cache"]["path"]).parent == ctx.cache_dir / "tensorrt"
    else:
        assert "not used by TensorRT-RTX" in trt.backend_info["timing_cache"]["note"]


def test_run_onnxruntime_only(zoo, tmp_path: Path) -> None:
    """The CPU's FP16 engine is audited as FP32 (ORT's CPU provider casts around MatMul/Conv): skipped with the
    audit's reason, the run goes on; the CUDA one (built here, run on a GPU) is the precision stage's graph as is."""
    build = {"backends": ["onnxruntime"], "onnxruntime": {"fp16_source": "precision_graph", "devices": ["cpu", "cuda"]}}
    result = stage.run(ctx := _ctx(tmp_path, zoo, build))
    assert [e.name for e in result.engines] == [
        "onnxruntime-cpu-fp32",
        "onnxruntime-cuda-fp32",
        "onnxruntime-cuda-fp16",
        "onnxruntime-cpu-int8",
        "onnxruntime-cuda-int8",
    ]
    (said,) = [s for s in result.skipped if "onnxruntime-cpu-fp16" in s]
    assert "computes 0% in fp16" in said
    # the run's fix, not the direct build's `--precision` flag (a run sets no flag)
    assert "--precision" not in said and "precision.variants without fp16 skips the variant" in said
    ort16 = read_metadata(ctx.out / "onnxruntime-cuda-fp16")
    assert "fp16_conversion" not in ort16.builder_settings  # the precision stage's graph, used as is
    assert ort16.audit["share"] == {"fp16": 1.0} and ort16.audit["flops_per_sample"] > 0


def test_a_run_that_builds_no_engine_fails_with_each_reason(zoo, tmp_path: Path) -> None:
    """Every planned engine skipped (here the CPU's FP16 engine, which ONNX Runtime computes in FP32): the stage
    fails saying why, where it used to pass with no engine and leave validation to say nothing could be validated."""
    ctx = _ctx(tmp_path, zoo, {"backends": ["onnxruntime"], "onnxruntime": {"devices": ["cpu"]}})
    Variants(variants={"fp16": PrecisionVariant(path="fp16/model.onnx")}).write(
        tmp_path / "precision" / "variants.json"
    )
    with pytest.raises(BuildError, match="no engine was built: onnxruntime-cpu-fp16: .*computes 0% in fp16"):
        stage.run(ctx)


@pytest.mark.tensorrt
def test_bad_profile_fails_the_stage(zoo, tmp_path: Path) -> None:
    ctx = _ctx(
        tmp_path,
        zoo,
        {
            "backends": ["tensorrt"],
            "tensorrt": {"profiles": [{"x": {"min": [1, 1, 8, 8], "opt": [1, 1, 8, 8], "max": [1, 1, 8, 8]}}]},
        },
    )
    with pytest.raises(ConfigError, match="does not match the model's inputs"):
        stage.run(ctx)


def test_unknown_backend_in_direct_mode(zoo, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown backend 'tvm'"):
        stage.build_engine(zoo("cnn"), tmp_path / "e", "tvm", "cpu", "fp32", stage.BuildConfig(), tmp_path)


def test_an_index_range_reaches_below_zero_as_far_as_the_data_does() -> None:
    """PyTorch's ``table[i]`` takes -1 as the last row, as ONNX's Gather does: the negative indices the data holds
    (down to -rows) are taken; without data, 0 to rows - 1."""
    from kiln.core.records import TensorSpec
    from kiln.stages.engines.stage import _index_ranges
    from tests.core.test_onnx_io import _indexing_graph

    graph, taken = _indexing_graph(), [TensorSpec(name=n, shape=["batch"], dtype="int64") for n in ("ids", "kind")]
    assert _index_ranges(graph, taken, {}) == {"ids": [0, 9], "kind": [0, 1]}
    assert _index_ranges(graph, taken, {"ids": [-4, 9], "kind": [-7, 1]}) == {"ids": [-4, 9], "kind": [-2, 1]}
    assert _index_ranges(graph, taken[:1], {"ids": [3, 5]}) == {"ids": [0, 9]}


def test_packed_columns_keep_a_range_each_with_the_data_s_own_lows() -> None:
    """``sparse[:, i]`` into tables of 10 and 1000 rows: the engine records a range per column (the input's one
    range, the larger table's, let 50 in column 0 through to ONNX Runtime), each reaching below 0 as far as that
    column's data does (one range of data, an older record, lowers every column alike, down to its -rows)."""
    from kiln.core.records import TensorSpec
    from kiln.stages.engines.stage import _index_ranges
    from tests.core.test_index_ranges import _packed_graph

    taken = [TensorSpec(name="sparse", shape=["batch", 2], dtype="int64")]
    assert _index_ranges(_packed_graph(), taken, {}) == {"sparse": [[0, 9], [0, 999]]}
    per_column = {"sparse": [[-3, 9], [0, 996]]}
    assert _index_ranges(_packed_graph(), taken, per_column) == {"sparse": [[-3, 9], [0, 999]]}
    assert _index_ranges(_packed_graph(), taken, {"sparse": [-50, 996]}) == {"sparse": [[-10, 9], [-50, 999]]}


def test_a_shifted_column_keeps_the_rows_its_shift_leaves_it(tmp_path: Path) -> None:
    """FT-Transformer's ``emb(x_cat + offsets)``, offsets [0, 4, 14] into one table of 17 rows: column 2 takes -14 to
    2 (rows 0 to 16), as PyTorch does; a floor at -(high + 1), right for a range from 0, cut it to -3."""
    from kiln.core.records import TensorSpec
    from kiln.stages.engines.stage import _index_ranges
    from tests.core.test_onnx_io_offsets import _ft_graph

    taken = [TensorSpec(name="x_cat", shape=["batch", 3], dtype="int64")]
    data = {"x_cat": [[0, 3], [0, 9], [0, 2]]}
    assert _index_ranges(_ft_graph(tmp_path), taken, data) == {"x_cat": [[0, 16], [-4, 12], [-14, 2]]}


def test_an_edge_index_range_starts_at_0_unless_the_data_counts_from_the_end() -> None:
    """A graph neural network's ``edge_index`` reaching GatherElements and ScatterElements over 12 nodes: ONNX would
    take -1 as the last node, torch.gather refuses it; data from 0 records 0 to 11, so the engine refuses a negative
    index instead of answering from the wrong node."""
    from kiln.core.records import EngineMetadata, TensorSpec
    from kiln.stages.engines.stage import _index_ranges
    from tests.core.test_index_ranges import _gin_graph

    taken = [TensorSpec(name="edge_index", shape=["batch", 2, 6], dtype="int64")]
    ranges = _index_ranges(_gin_graph(), taken, {"edge_index": [0, 11]})
    assert ranges == {"edge_index": [0, 11]}
    assert _index_ranges(_gin_graph(), taken, {"edge_index": [-3, 11]}) == {"edge_index": [-3, 11]}
    meta = EngineMetadata.model_construct(name="gin", index_ranges=ranges)
    assert meta.outside_values({"edge_index": np.array([[[-1, 2]]])}) == (
        "input 'edge_index' holds -1: engine gin takes values from 0 to 11 "
        "(the positions of the axis it indexes: a table's rows, a graph's nodes)"
    )


def test_an_axis_given_one_size_is_recorded_as_a_range(tmp_path: Path) -> None:
    """A variant's recorded sizes (one: the data's) or a signature.shapes of one size are a range of one in the
    engine's record: its checks read [smallest, largest] and failed to unpack a list of one."""
    import onnx
    from onnx import TensorProto, helper

    from kiln.stages.engines.config import BuildConfig
    from kiln.stages.engines.stage import build_direct

    graph = helper.make_graph(
        [helper.make_node("Relu", ["input"], ["logits"])],
        "seq",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", "seq"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq"])],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), tmp_path / "m.onnx")
    meta = build_direct(tmp_path / "m.onnx", tmp_path / "e", "onnxruntime", "cpu", None, BuildConfig(), {"seq": [16]})
    assert meta.axis_ranges == {"seq": [16, 16]}
    assert meta.outside_range({"input": (2, 16)}) is None and meta.outside_range({"input": (2, 8)}) is not None
