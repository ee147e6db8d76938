"""A served engine as the server's notes read it: its metadata and Triton model name, no engine files."""

from __future__ import annotations

from types import SimpleNamespace

from kiln.core.records import EngineMetadata


def served(
    inputs: dict[str, tuple[list[int | str], str]], validated: list[int], name: str = "e_fp32"
) -> SimpleNamespace:
    """An ONNX Runtime CPU engine with ``inputs`` (name -> (shape, dtype)), one ``logits [batch, 4]`` output, and
    ``validated`` batch sizes, served as ``name``."""
    meta = EngineMetadata(
        name="e",
        backend="onnxruntime",
        device="cpu",
        precision="fp32",
        source={"file": "m.onnx", "sha256": "0"},
        files={"model": "engine"},
        flavour="onnxruntime",
        versions={},
        inputs=[{"name": k, "shape": shape, "dtype": dtype} for k, (shape, dtype) in inputs.items()],
        outputs=[{"name": "logits", "shape": ["batch", 4], "dtype": "float32"}],
        validated_batch_sizes=validated,
    )
    return SimpleNamespace(meta=meta, model_name=name)
