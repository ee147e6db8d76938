"""Every engine carries its precision audit, and its label is what its graph computes: `kiln build` labels an
unlabelled graph from the audit and refuses a label the built engine contradicts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnxruntime.quantization import QuantFormat, quantize_static
from onnxruntime.quantization.calibrate import CalibrationDataReader

from kiln.core.errors import BuildError
from kiln.stages.engines.config import BuildConfig
from kiln.stages.engines.stage import MislabelledEngine, build_direct
from tests.stages.precision.test_audit import attention, graph


class Reader(CalibrationDataReader):
    def __init__(self) -> None:
        rng = np.random.default_rng(0)
        self.rows = iter(
            {"x": rng.standard_normal((1, 40, 8)).astype(np.float32), "img": rng.random((1, 3, 6, 6), np.float32)}
            for _ in range(4)
        )

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self.rows, None)


@pytest.fixture
def qdq(tmp_path: Path) -> Path:
    """An INT8 Q/DQ graph made by ONNX Runtime's quantizer (not by Kiln)."""
    fp32, out = tmp_path / "fp32.onnx", tmp_path / "int8.onnx"
    onnx.save(graph(), str(fp32))
    quantize_static(str(fp32), str(out), Reader(), quant_format=QuantFormat.QDQ)
    return out


def test_an_unlabelled_qdq_graph_is_built_as_int8(tmp_path: Path, qdq: Path) -> None:
    meta = build_direct(qdq, tmp_path / "engine", "onnxruntime", "cpu", None, BuildConfig())
    assert meta.precision == "int8" and meta.audit["share"]["int8"] >= 0.5 and meta.audit["flops_per_sample"] > 0


@pytest.mark.parametrize("label", ["fp32", "fp16"])
def test_a_label_the_engine_contradicts_is_refused(tmp_path: Path, qdq: Path, label: str) -> None:
    with pytest.raises(BuildError, match=f"labelled {label}"):
        build_direct(qdq, tmp_path / "engine", "onnxruntime", "cpu", label, BuildConfig())
    assert not (tmp_path / "engine").exists()  # nothing half-built left behind


def test_an_fp16_graph_on_the_cpu_provider_computes_in_fp32(tmp_path: Path) -> None:
    """ONNX Runtime's CPU provider runs FP16 MatMul/Conv through casts to FP32: an "FP16" engine that is not."""
    src = tmp_path / "fp16.onnx"
    onnx.save(graph(onnx.TensorProto.FLOAT16), str(src))
    with pytest.raises(MislabelledEngine, match="computes 0% in fp16") as err:
        build_direct(src, tmp_path / "engine", "onnxruntime", "cpu", "fp16", BuildConfig())
    # the label matches the graph: the runtime is the cause, not "--precision matching the graph"
    assert err.value.hint.startswith("the onnxruntime backend runs fp16 in another precision on CPU")


def test_a_variant_folder_is_told_of_the_runtime_and_audited_at_the_data_s_sizes(tmp_path: Path) -> None:
    """``kiln build variants/fp16`` gives no --precision (the folder labels it), so "--precision matching the graph"
    was no fix; and the audit counts at the sizes the precision stage recorded, as its own audit did."""
    from kiln.core.records import PrecisionVariant, Variants
    from kiln.stages.engines.stage import _variant_axis_sizes

    (tmp_path / "v" / "fp16").mkdir(parents=True)
    onnx.save(graph(onnx.TensorProto.FLOAT16), str(tmp_path / "v" / "fp16" / "model.onnx"))
    listing = Variants(variants={"fp16": PrecisionVariant(path="fp16/model.onnx")}, axis_sizes={"seq": [4, 32]})
    listing.write(tmp_path / "v" / "variants.json")
    assert _variant_axis_sizes(tmp_path / "v" / "fp16" / "model.onnx") == {"seq": [4, 32]}
    with pytest.raises(MislabelledEngine, match="computes 0% in fp16") as err:
        build_direct(tmp_path / "v" / "fp16", tmp_path / "engine", "onnxruntime", "cpu", None, BuildConfig())
    assert err.value.hint.startswith("the onnxruntime backend runs fp16 in another precision on CPU")


def test_an_int8_encoder_s_fp32_attention_counts_at_the_sizes_built_for(tmp_path: Path) -> None:
    """The attention MatMuls of a Q/DQ encoder run in FP32 on ONNX Runtime's CPU provider, their sizes symbolic in
    the graph: at a short sequence the engine is mostly INT8, its FLOPs per sample with attention's; at seq 32
    attention is most of its FLOPs and the INT8 label is refused (it used to read "int8 100 %")."""
    src = tmp_path / "attention.onnx"
    onnx.save(attention(quantized_x=True), str(src))
    meta = build_direct(src, tmp_path / "short", "onnxruntime", "cpu", "int8", BuildConfig(), {"seq": [4]})
    linear, attn = 3 * 2 * 4 * 8 * 8, 2 * 2 * 4 * 4 * 8
    assert meta.audit["flops_per_sample"] == linear + attn and meta.audit["share"]["int8"] == 0.75
    assert meta.audit["uncounted_nodes"] == {} and meta.audit["share_covers_nodes"] == 1.0
    with pytest.raises(MislabelledEngine, match="computes 27% in int8"):
        build_direct(src, tmp_path / "long", "onnxruntime", "cpu", "int8", BuildConfig(), {"seq": [32]})


def test_an_engine_short_of_int8_by_the_fallback_s_float_nodes_is_told_so() -> None:
    """The audit drops an engine whose graph runs too little in int8; where the accuracy fallback kept nodes in
    float for the gates (a user metric's), the fix names them and the gates, not the runtime's kernels."""
    from kiln.core.records import PrecisionVariant
    from kiln.stages.engines.stage import _kept_in_float, kept_fix

    variant = PrecisionVariant(
        path="int8/model.onnx",
        kept_fp32=["node_bmm", "node_cat", "node_head"],  # node_head: calibration.keep_output_layers, no gate
        backend_paths={"onnxruntime-cpu": "int8/model.ort_cpu.onnx"},
        report={
            "fallback": {"nodes": ["node_bmm", "node_cat"]},
            "ort_cpu": {"kept_fp32": ["node_head", "node_linear_2"], "fallback": {"nodes": ["node_linear_2"]}},
        },
    )
    assert _kept_in_float(variant, "int8/model.ort_cpu.onnx") == ["node_linear_2"]
    assert _kept_in_float(variant, "int8/model.onnx") == ["node_bmm", "node_cat"]
    bare = PrecisionVariant(path="int8/model.onnx", kept_fp32=["node_head"], report={"fallback": {"nodes": []}})
    assert _kept_in_float(bare, "int8/model.onnx") == []  # kept by the config only: the runtime's fix stands
    fix = kept_fix("int8", ["node_linear_2", "node_linear_3"])
    assert fix.startswith("the precision stage kept 2 nodes in float (node_linear_2, node_linear_3)")
    assert "validate.gates.per_precision.int8" in fix and "another precision" not in fix


def test_the_ort_cpu_graph_s_nodes_inherited_from_the_q_dq_fallback_are_named() -> None:
    """The ONNX Runtime CPU INT8 graph starts from the nodes the Q/DQ graph's fallback kept and passes at once: its
    own fallback keeps none, yet those nodes are why its engine is short of int8, and the fix names them (it said
    the backend runs int8 in another precision on CPU)."""
    from kiln.core.records import PrecisionVariant
    from kiln.stages.engines.stage import _kept_in_float

    variant = PrecisionVariant(
        path="int8/model.onnx",
        kept_fp32=["node_bmm", "node_linear_3"],
        backend_paths={"onnxruntime-cpu": "int8/model.ort_cpu.onnx"},
        report={
            "fallback": {"nodes": ["node_bmm", "node_linear_3", "node_cat"]},
            "ort_cpu": {"kept_fp32": ["node_bmm", "node_linear_3"], "fallback": {"nodes": []}},
        },
    )
    assert _kept_in_float(variant, "int8/model.ort_cpu.onnx") == ["node_bmm", "node_linear_3"]


def test_the_fix_for_int8_on_the_cpu_is_the_graph_s_not_the_runtime_s() -> None:
    """ONNX Runtime has INT8 kernels on the CPU: an INT8 engine short of int8 there is so by what its graph keeps
    in float, not by a runtime computing int8 in another precision; FP16 on the CPU is."""
    from kiln.stages.engines.stage import run_fix

    fix = run_fix("int8", "cpu")
    assert "another precision" not in fix and "calibration.op_types" in fix and "no int8 engine" in fix
    assert run_fix("fp16", "cpu").startswith("none needed where other engines are built: this backend runs fp16 in")


def test_kiln_build_of_an_int8_variant_short_after_a_loop_is_told_of_its_float_nodes(tmp_path: Path) -> None:
    """`kiln build` of an INT8 variant whose FP32 MatMuls after a Loop (a DLRM's EmbeddingBag tables) could not be
    sized: the refusal leads with the nodes it knows, and its fix is about the nodes kept in float, since ONNX
    Runtime has INT8 kernels on the CPU (it said the backend runs int8 in another precision on CPU)."""
    from kiln.core.records import PrecisionVariant, Variants
    from tests.stages.precision.test_audit_unsized import dlrm_like

    (tmp_path / "v" / "int8").mkdir(parents=True)
    onnx.save(dlrm_like(), str(tmp_path / "v" / "int8" / "model.onnx"))
    Variants(variants={"int8": PrecisionVariant(path="int8/model.onnx")}).write(tmp_path / "v" / "variants.json")
    with pytest.raises(MislabelledEngine) as err:
        build_direct(tmp_path / "v" / "int8", tmp_path / "engine", "onnxruntime", "cpu", None, BuildConfig())
    assert "2 of its 5 compute nodes run in int8 and 3 in fp32 could not be sized" in err.value.message
    assert "another precision" not in err.value.hint and "calibration.op_types" in err.value.hint


def test_a_variant_precision_did_not_make_is_refused(tmp_path: Path, qdq: Path) -> None:
    """``kiln precision`` keeps a failed variant's graph for inspection; ``kiln build`` of its folder made an engine of
    it without a word (a TensorRT INT8 engine nobody could validate on that machine)."""
    import shutil

    from kiln.core.errors import ConfigError
    from kiln.core.records import PrecisionVariant, Variants

    (tmp_path / "v" / "int8").mkdir(parents=True)
    shutil.copy(qdq, tmp_path / "v" / "int8" / "model.onnx")
    unmade = "int8 (Q/DQ graph) not made: worst sample's cosine 0.922 < min_cosine 0.99"
    variant = PrecisionVariant(path="int8/model.onnx", fallback_passed=False, unmade=unmade)
    Variants(variants={"int8": variant}).write(tmp_path / "v" / "variants.json")
    for src in (tmp_path / "v" / "int8", tmp_path / "v" / "int8" / "model.onnx"):
        with pytest.raises(ConfigError, match="did not make the int8 variant") as err:
            build_direct(src, tmp_path / "engine", "onnxruntime", "cpu", None, BuildConfig())
        assert "cosine 0.922" in err.value.message and "rerun kiln precision" in err.value.hint
