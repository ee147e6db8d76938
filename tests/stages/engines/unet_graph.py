"""A U-Net in miniature as an ONNX graph: a 1x1 convolution, a 2x2 max pool, nearest upsampling by 2 and a
concat with the convolution's output, so its dynamic H and W run at even sizes only (an odd one pools to a map
that upsamples one short and the concat fails in ONNX Runtime)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def unet_graph(path: Path, levels: int = 1) -> Path:
    """Write the graph to ``path``: input ``input`` [batch, 3, H, W] float -> ``logits`` [batch, 4, H, W];
    ``levels`` 2x2 pools before the upsampling, so H and W run at multiples of ``2**levels`` only."""
    rng = np.random.default_rng(0)
    weights = [
        numpy_helper.from_array(rng.standard_normal((2, 3, 1, 1)).astype(np.float32), "w"),
        numpy_helper.from_array(np.zeros(2, np.float32), "b"),
        numpy_helper.from_array(np.array([1, 1, 2**levels, 2**levels], np.float32), "scales"),
    ]
    nodes = [
        helper.make_node("Conv", ["input", "w", "b"], ["conv"]),
        *(
            helper.make_node(
                "MaxPool", [f"pool{i}" if i else "conv"], [f"pool{i + 1}"], kernel_shape=[2, 2], strides=[2, 2]
            )
            for i in range(levels)
        ),
        helper.make_node("Resize", [f"pool{levels}", "", "scales"], ["up"], mode="nearest"),
        helper.make_node("Concat", ["conv", "up"], ["logits"], axis=1),
    ]
    graph = helper.make_graph(
        nodes,
        "unet",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3, "H", "W"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 4, "H", "W"])],
        weights,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def images(n: int, size: int, seed: int = 0) -> np.ndarray:
    """``n`` random images of ``size`` x ``size``: the graph's input."""
    return np.random.default_rng(seed).random((n, 3, size, size)).astype(np.float32)
