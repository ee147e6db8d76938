"""What ``kiln validate ENGINE --reference ...`` says when the reference fails on the engine's inputs, shared by the
ONNX reference (:mod:`kiln.stages.validate.direct`) and the checkpoint one (:mod:`kiln.stages.validate.checkpoint`)."""

from __future__ import annotations

import numpy as np

OTHER_MODEL = (
    "validate an engine against the model it was built from (its ONNX file, or its checkpoint with model.name)"
)
RANDOM_VALUES = "random values may be ones the model rejects where the shapes are right: a box whose x0 > x1"
RANDOM_REJECTED = f"pass --inputs FILE.npz with real samples ({RANDOM_VALUES}); if real samples fail too, {OTHER_MODEL}"


def feed_shapes(feed: dict[str, np.ndarray]) -> dict[str, str]:
    """Each input's dtype and shape, as the messages name them: ``{"input": "float32[16, 8]"}``."""
    return {k: f"{v.dtype}{list(v.shape)}" for k, v in feed.items()}
