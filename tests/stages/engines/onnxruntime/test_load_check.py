"""The ONNX Runtime build opens the engine it wrote the way its runner will, and falls back when ORT refuses.

The graph below is the smallest found that ONNX Runtime (1.32) optimizes offline into a file it cannot optimize
again: flat detections from ``nonzero`` (row and column of each hit, and the row once more as the image index, a
duplicate Gather that keeps ORT from fusing the index Gathers offline) beside a Gather + Slice of one tensor, which
ORT fuses into Split + Squeeze with a new initializer named ``squeeze_axes``. Opened again at ``extended`` or
``all``, ORT merges the duplicate, fuses the index Gathers the same way, names their axes initializer
``squeeze_axes`` too and refuses the session ("Attempt to replace the existing tensor").
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.core.errors import BuildError, ModelError
from kiln.core.onnx_io import ort_session
from kiln.stages.engines.backend import read_metadata
from kiln.stages.engines.config import BuildConfig
from kiln.stages.engines.onnxruntime import autotune as ort_autotune
from kiln.stages.engines.onnxruntime.build import build_ort_engine
from kiln.stages.engines.onnxruntime.config import OnnxRuntimeConfig, OrtAutotuneConfig
from kiln.stages.engines.onnxruntime.record import OrtRecord
from kiln.stages.engines.onnxruntime.runner import OrtCpuRunner, session_options
from kiln.stages.engines.stage import build_engine

REPLACE = "Attempt to replace the existing tensor"


def flat_detections(path: Path) -> Path:
    """``x [batch, 2, 4]``: ``x[:, :1]`` (Slice) and, where ``x[:, 1]`` (Gather) is non-zero, row + column and the
    row again as ``image`` (the Gathers of ``nonzero``'s output, the duplicate last)."""
    vi = helper.make_tensor_value_info
    nodes = [
        helper.make_node("Gather", ["x", "one"], ["score"], axis=1),
        helper.make_node("Slice", ["x", "zeros", "ones", "ones"], ["boxes"]),
        helper.make_node("NonZero", ["score"], ["hits"]),
        helper.make_node("Gather", ["hits", "zero"], ["row"]),
        helper.make_node("Gather", ["hits", "one"], ["col"]),
        helper.make_node("Gather", ["hits", "zero"], ["image"]),
        helper.make_node("Add", ["row", "col"], ["where"]),
    ]
    consts = {"zero": 0, "one": 1, "zeros": [0], "ones": [1]}
    graph = helper.make_graph(
        nodes,
        "flat_detections",
        [vi("x", TensorProto.FLOAT, ["batch", 2, 4])],
        [
            vi("boxes", TensorProto.FLOAT, None),
            vi("where", TensorProto.INT64, None),
            vi("image", TensorProto.INT64, None),
        ],
        [numpy_helper.from_array(np.array(v, np.int64), k) for k, v in consts.items()],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(path))
    return path


def build(src: Path, out: Path, cfg: OnnxRuntimeConfig | None = None, **kw) -> dict:
    """The backend's build function itself (no build stage around it)."""
    out.mkdir()
    return build_ort_engine(src, out, "cpu", "fp32", cfg or OnnxRuntimeConfig(), name="flat", **kw)


def ort_optimizes_again(engine: Path) -> bool:
    """Whether this onnxruntime opens the file it optimized offline at load level "all" (1.32 does not)."""
    try:
        ort_session(engine, optimization="all")
    except ModelError:
        return False
    return True


def run(session, x: np.ndarray) -> list[np.ndarray]:
    return session.run(None, {"x": x})


def x_with_zeros(batch: int = 3) -> np.ndarray:
    x = np.random.default_rng(0).standard_normal((batch, 2, 4)).astype(np.float32)
    x[:, 1, ::2] = 0  # some scores are no hit: the detections' count depends on the values
    return x


def assert_engine_computes_the_source(src: Path, out: Path, session: dict) -> None:
    """The engine file opens with ``session`` as recorded, as the runner opens it, and computes what ``src``
    computes, at two batch sizes."""
    engine = ort_session(out / "engine.onnx", options=session_options(session))
    source = ort_session(src, optimization="none")
    for batch in (1, 3):
        x = x_with_zeros(batch)
        for got, want in zip(run(engine, x), run(source, x)):
            np.testing.assert_array_equal(got, want)


def test_an_engine_ort_cannot_optimize_again_loads_as_recorded_and_computes_the_same(tmp_path: Path) -> None:
    src = flat_detections(tmp_path / "src.onnx")
    built = build(src, tmp_path / "e")
    session = built["session"]
    assert_engine_computes_the_source(src, tmp_path / "e", session)
    fallback = built["builder_settings"].get("load_fallback")
    assert (fallback is None) == (session["load_optimization"] == "all")  # a fallback is always in the record
    if fallback:  # this ORT refuses its own offline output at "all": the file stays, at a level that opens it
        assert session["offline_optimization"] == "extended" and REPLACE in fallback[0]["error"]
        assert session["load_optimization"] in ("extended", "basic", "none")


def test_without_a_lower_level_that_opens_the_engine_is_the_unoptimized_graph(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No lower load level to try: the graph before ORT's offline optimization, which ORT optimizes at load."""
    from kiln.stages.engines.onnxruntime import loading

    monkeypatch.setattr(loading, "LOAD_LEVELS", ("all", "extended"))
    src = flat_detections(tmp_path / "src.onnx")
    built = build(src, tmp_path / "e")
    session = built["session"]
    assert_engine_computes_the_source(src, tmp_path / "e", session)
    if built["builder_settings"].get("load_fallback"):
        assert (session["offline_optimization"], session["load_optimization"]) == ("none", "all")
        ops = [n.op_type for n in onnx.load(str(tmp_path / "e" / "engine.onnx")).graph.node]
        assert ops == [n.op_type for n in onnx.load(str(src)).graph.node]


def test_an_engine_nothing_opens_is_one_build_error(tmp_path: Path) -> None:
    from kiln.stages.engines.onnxruntime import loading

    src = flat_detections(tmp_path / "src.onnx")
    built = build(src, tmp_path / "e")
    path = tmp_path / "e" / "engine.onnx"
    if ort_optimizes_again(path):
        pytest.skip("this onnxruntime optimizes its own offline output again")
    optimized = onnx.load(str(path))
    session = {**built["session"], "offline_optimization": "extended", "load_optimization": "all"}
    with pytest.raises(BuildError) as err:  # the "un-optimized" graph here is ORT's optimized one: nothing opens
        loading.settle_load(path, session, lambda: optimized, "flat", lower=False)
    assert "engine flat (engine.onnx)" in err.value.message and REPLACE in err.value.message
    assert "opset" not in err.value.hint and "onnxruntime" in err.value.hint


def test_the_runner_says_to_rebuild_an_engine_ort_cannot_optimize_again(tmp_path: Path) -> None:
    """An engine recorded to open at "all" that ORT refuses there (one built before the build checked): the fix
    is a rebuild with this onnxruntime, not another opset (the graph is ORT's own output)."""
    src = flat_detections(tmp_path / "src.onnx")
    cfg = BuildConfig(backends=["onnxruntime"], onnxruntime=OnnxRuntimeConfig())
    build_engine(src, tmp_path / "e", "onnxruntime", "cpu", "fp32", cfg, tmp_path / "cache")
    meta = read_metadata(tmp_path / "e")
    if ort_optimizes_again(tmp_path / "e" / "engine.onnx"):
        pytest.skip("this onnxruntime optimizes its own offline output again")
    info = OrtRecord(session={**meta.backend_info["session"], "load_optimization": "all"})
    with pytest.raises(BuildError) as err:
        OrtCpuRunner(tmp_path / "e", meta, info).activate()
    assert err.value.message.startswith(f"ONNX Runtime cannot load engine {meta.name}: ") and REPLACE in str(err.value)
    assert "opset" not in err.value.hint and "rebuild" in err.value.hint


def test_a_cpu_autotune_reuses_the_load_checks_session(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The configured settings (the first candidate) run on the session the load check opened: the check costs
    no session where the build autotunes."""
    opened = []
    real = ort_autotune.open_session
    monkeypatch.setattr(ort_autotune, "open_session", lambda *a, **k: opened.append(a[2]["settings"]) or real(*a, **k))
    tune = OrtAutotuneConfig(cpu=True, cpu_knobs={"intra_op_threads": [0, 1]}, iterations=3, warmup=1)
    src = flat_detections(tmp_path / "src.onnx")
    built = build(src, tmp_path / "e", OnnxRuntimeConfig(autotune=tune), max_batch=2)
    trials = built["autotune"]["trials"]
    assert [t["knobs"]["intra_op_threads"] for t in trials] == [0, 1] and all(t["agrees"] for t in trials)
    assert [s["intra_op_threads"] for s in opened] == [1, 1]  # batches 1 and 2 of the second candidate only
