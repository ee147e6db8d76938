"""Which PyTorch module each ONNX node came from, read from the metadata the dynamo exporter writes on every
node (``pkg.torch.onnx.name_scopes`` / ``pkg.torch.onnx.class_hierarchy``, or the older ``namespace`` string).

No library maps an ONNX node back to its module (onnxscript writes the metadata, nothing reads it), so this
small parser does. Nodes without metadata (TorchScript exports, nodes a pass created) get no module.
"""

from __future__ import annotations

import ast

import onnx

SCOPES, CLASSES, NAMESPACE = "pkg.torch.onnx.name_scopes", "pkg.torch.onnx.class_hierarchy", "namespace"


def torch_modules(*models: onnx.ModelProto) -> dict[str, str]:
    """``{node name: "encoder.layers.0.attn (MultiheadAttention)"}``; the first model naming a node wins (pass
    the graph at hand first, then the export it came from: graph passes may drop node metadata)."""
    out: dict[str, str] = {}
    for model in models:
        for node in model.graph.node:
            if node.name not in out and (module := node_module(node)) is not None:
                out[node.name] = module
    return out


def node_module(node: onnx.NodeProto) -> str | None:
    meta = {p.key: p.value for p in node.metadata_props}
    scopes, classes = _literal_list(meta.get(SCOPES)), _literal_list(meta.get(CLASSES))
    if scopes is None and NAMESPACE in meta:  # "": root/fc: torch.nn.modules.linear.Linear/linear: aten.linear"
        parts = [p.partition(": ") for p in meta[NAMESPACE].split("/")]
        scopes, classes = [p[0] for p in parts], [p[2] for p in parts]
    if not scopes or len(scopes) < 2:
        return None
    # Scopes are qualified module names from the root ('') down, then the op itself (an aten call).
    path = scopes[-2] or "(root)"
    cls = classes[-2] if classes and len(classes) == len(scopes) else ""
    if cls.startswith("_empty_nn_module_stack"):  # a node torch.fx added (shape asserts): no module of the user's
        return None
    return f"{path} ({cls.rsplit('.', 1)[-1]})" if cls else path


def _literal_list(text: str | None) -> list[str] | None:
    if not text:
        return None
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return None
    return [str(v) for v in value] if isinstance(value, (list, tuple)) else None
