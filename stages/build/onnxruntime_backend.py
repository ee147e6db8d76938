"""ONNX Runtime engines: the model optimized offline by ONNX Runtime, saved with its session settings."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import onnx

from stages.build.config import OnnxRuntimeConfig

PROVIDERS = {"cpu": ["CPUExecutionProvider"], "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"]}


def build_ort_engine(onnx_path: Path, out: Path, device: str, cfg: OnnxRuntimeConfig) -> dict[str, Any]:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.optimized_model_filepath = str(out / "engine.onnx")
    opts.intra_op_num_threads = cfg.intra_op_threads
    opts.log_severity_level = 3
    ort.InferenceSession(str(onnx_path), opts, providers=["CPUExecutionProvider"])  # writes the optimized model
    return {"files": {"model": "engine.onnx"},
            "session": {"providers": PROVIDERS[device], "intra_op_threads": cfg.intra_op_threads}}


def io_spec(model: onnx.ModelProto) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    def spec(v: onnx.ValueInfoProto) -> dict[str, Any]:
        t = v.type.tensor_type
        shape = [d.dim_param or d.dim_value for d in t.shape.dim]
        return {"name": v.name, "shape": shape, "dtype": onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name}

    inits = {i.name for i in model.graph.initializer}
    return [spec(v) for v in model.graph.input if v.name not in inits], [spec(v) for v in model.graph.output]
