"""Reading, checking and running ONNX models, with user-facing errors instead of library tracebacks."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx

from kiln.core.errors import InputFileError, ModelError

# ONNX's protobuf limit: larger models must keep their weights in external data files.
PROTOBUF_LIMIT = 2**31 - 1


def load_onnx(path: str | Path, load_external_data: bool = True) -> onnx.ModelProto:
    p = Path(path)
    if not p.is_file():
        raise InputFileError(f"ONNX file not found: {p}", hint="check the path")
    try:
        return onnx.load(str(p), load_external_data=load_external_data)
    except Exception as exc:
        raise InputFileError(f"{p} is not a readable ONNX model ({type(exc).__name__}: {str(exc)[:200]})",
                             hint="re-export the model; the file may be truncated or not ONNX") from None


def check_onnx(model: onnx.ModelProto | str | Path, what: str = "model") -> None:
    """onnx.checker with full checks; paths are checked in place (works for > 2 GB models)."""
    try:
        onnx.checker.check_model(str(model) if isinstance(model, Path) else model, full_check=True)
    except Exception as exc:
        raise ModelError(f"{what} fails the ONNX checker: {str(exc).splitlines()[0][:300]}",
                         hint="re-export with a supported opset, or report the model to Kiln") from None


def infer_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    try:
        return onnx.shape_inference.infer_shapes(model, check_type=True, data_prop=True)
    except Exception as exc:
        raise ModelError(f"ONNX shape inference failed: {str(exc).splitlines()[0][:300]}",
                         hint="the graph has a shape mismatch; check the model's input shapes") from None


def save_onnx(model: onnx.ModelProto, path: Path) -> None:
    """Save, moving weights to an external data file when the model would exceed the protobuf limit."""
    path.parent.mkdir(parents=True, exist_ok=True)
    large = model.ByteSize() > PROTOBUF_LIMIT if _has_no_external(model) else True
    if large:
        (path.parent / (path.name + ".data")).unlink(missing_ok=True)  # onnx appends to an existing data file
        onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=path.name + ".data", size_threshold=1024)
    else:
        onnx.save_model(model, str(path))


def _has_no_external(model: onnx.ModelProto) -> bool:
    try:
        return model.ByteSize() >= 0
    except ValueError:  # protobuf refuses to size messages over 2 GB
        return False


def ort_session(model: onnx.ModelProto | str | Path, threads: int = 0, providers: list[str] | None = None,
                optimization: str = "all") -> Any:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.log_severity_level = 3
    opts.graph_optimization_level = {
        "none": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }[optimization]
    src = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    try:
        return ort.InferenceSession(src, opts, providers=providers or ["CPUExecutionProvider"])
    except Exception as exc:
        raise ModelError(f"ONNX Runtime cannot load the model: {str(exc).splitlines()[0][:300]}",
                         hint="an op or type may be unsupported by ONNX Runtime; try another opset") from None


def ort_run(session: Any, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    return session.run(None, feed)


def input_feed(session: Any, x: np.ndarray) -> dict[str, np.ndarray]:
    """Kiln models have a single input; name it from the session."""
    return {session.get_inputs()[0].name: x}
