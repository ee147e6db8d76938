"""Zoo models as ONNX graphs in FP32, FP16 and INT8 (Q/DQ), made here because the precision stage is not ours.

FP16: onnxconverter-common's converter keeping LayerNormalization/Softmax/reductions in FP32 (what TensorRT 11 and
TensorRT-RTX expect: precision lives in the graph). INT8: onnxruntime.quantization.quantize_static in QDQ format,
symmetric per-channel weights, as TensorRT requires; ``int8_cpu``: uint8 activations, what ONNX Runtime's CPU
provider computes in integers throughout.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import torch

from kiln.core.records import EngineMetadata
from kiln.models.registry import build_model
from kiln.stages.export.torch_export import export_onnx

# Per model: factory params small enough for fast CPU builds, and one sample's shape / dtype.
ZOO: dict[str, tuple[dict, tuple[int, ...], str]] = {
    "cnn": ({}, (1, 8, 8), "float32"),
    "transformer": ({}, (1, 8, 8), "float32"),
    "mlp_embed": ({}, (64,), "int64"),
}
KEEP_FP32 = ["LayerNormalization", "Softmax", "ReduceMean", "ReduceSum", "Pow", "Sqrt", "Gather"]


def sample(name: str, batch: int, seed: int = 0) -> np.ndarray:
    _, shape, dtype = ZOO[name]
    rng = np.random.default_rng(seed)
    if dtype == "int64":
        return rng.integers(0, 17, size=(batch, *shape), dtype=np.int64)
    return rng.standard_normal((batch, *shape)).astype(np.float32)


def assert_runner_agrees(
    runner,
    model: torch.nn.Module,
    name: str,
    batches: tuple[int, ...],  # noqa: ANN001
    min_cosine: float = 0.999,
) -> None:
    """An FP16 engine's ``runner`` agrees with the FP32 ``model`` (the zoo model ``name``) by cosine at ``batches``."""
    for batch in batches:
        x = sample(name, batch, seed=batch)
        with torch.inference_mode():
            want = model(torch.from_numpy(x)).numpy()
        got = next(iter(runner.infer({runner.input_names[0]: x}).values()))
        assert float(np.dot(got.ravel(), want.ravel()) / np.linalg.norm(got) / np.linalg.norm(want)) > min_cosine


def assert_engine_matches(
    engine_dir: Path, model: torch.nn.Module, name: str, batches: tuple[int, ...], tol: float = 1e-4
) -> None:
    """The engine in ``engine_dir`` computes ``model`` (the zoo model ``name``) on fresh samples at ``batches``."""
    from kiln.stages.engines.registry import load_engine

    with load_engine(engine_dir) as runner:
        for batch in batches:
            x = sample(name, batch, seed=batch)
            with torch.inference_mode():
                want = model(torch.from_numpy(x)).numpy()
            got = next(iter(runner.infer({runner.input_names[0]: x}).values()))
            np.testing.assert_allclose(got, want, atol=tol, rtol=tol)


def fp32_graph(name: str, folder: Path) -> Path:
    """Export, then fold constants (what the optimize stage does): TensorRT needs constant Reduce axes."""
    torch.manual_seed(0)
    params, _, _ = ZOO[name]
    path = folder / f"{name}-export.onnx"
    export_onnx(build_model(name, params), torch.from_numpy(sample(name, 2)), path)
    graph = gs.import_onnx(onnx.load(str(path)))
    graph.fold_constants().cleanup().toposort()
    out = folder / f"{name}-fp32.onnx"
    onnx.save(gs.export_onnx(graph), str(out))
    return out


def fp16_graph(fp32: Path, out: Path) -> Path:
    from onnxconverter_common import float16

    model = float16.convert_float_to_float16(onnx.load(str(fp32)), keep_io_types=True, op_block_list=KEEP_FP32)
    onnx.save(model, str(out))
    return out


def int8_graph(fp32: Path, out: Path, name: str, cpu: bool = False) -> Path:
    """The Q/DQ graph, the exporter's zero Conv bias folded to a constant first (ONNX Runtime fuses no Q/DQ Conv
    with a computed bias into QLinearConv). ``cpu``: activations in uint8, ONNX Runtime CPU's own scheme (Kiln's
    ORT CPU graph): on x86 its CPU provider fuses every Q/DQ MatMul of those into an integer op, of int8 ones only
    those whose activation one MatMul reads (a transformer's Q, K and V projections share theirs: left in float)."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    src = out.with_suffix(".folded.onnx")
    onnx.save(_constant_conv_bias(onnx.load(str(fp32))), str(src))

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.batches = iter([{"input": sample(name, 8, seed=s)} for s in range(4)])

        def get_next(self):  # type: ignore[override]
            return next(self.batches, None)

    quantize_static(
        str(src),
        str(out),
        Reader(),
        quant_format=QuantFormat.QDQ,
        per_channel=True,
        activation_type=QuantType.QUInt8 if cpu else QuantType.QInt8,
        weight_type=QuantType.QInt8,
        op_types_to_quantize=["Conv", "MatMul", "Gemm"],
        extra_options={"ActivationSymmetric": not cpu, "WeightSymmetric": True, "QuantizeBias": False},
    )
    src.unlink()
    return out


def _constant_conv_bias(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with each CastLike of a constant to a float32 value as a Cast to float32, folded: the exporter's
    zero Conv bias (an Expand of ``CastLike(0, x)``), which gs's folding leaves computed (its second input is not
    constant)."""
    graph = gs.import_onnx(model)
    for node in graph.nodes:
        if node.op == "CastLike" and isinstance(node.inputs[0], gs.Constant) and node.inputs[1].dtype == np.float32:
            node.op, node.attrs = "Cast", {"to": onnx.TensorProto.FLOAT}
            node.inputs = node.inputs[:1]
    graph.fold_constants().cleanup().toposort()
    return gs.export_onnx(graph)


def zoo_graph(name: str, precision: str, folder: Path) -> Path:
    fp32 = folder / f"{name}-fp32.onnx"
    if not fp32.exists():
        fp32_graph(name, folder)
    if precision == "fp32":
        return fp32
    out = folder / f"{name}-{precision}.onnx"
    if not out.exists():
        fp16_graph(fp32, out) if precision == "fp16" else int8_graph(fp32, out, name, precision == "int8_cpu")
    return out


def written(meta: EngineMetadata) -> EngineMetadata:
    """``meta`` as kiln-engine.json keeps it: without the build's seconds, which the build summary holds."""
    return meta.model_copy(update={"build_seconds": 0.0})
