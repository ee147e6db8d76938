"""What draws random numbers in an ONNX graph, and the fix for a model that does so at inference: constants only,
so that the optimizer's passes (which never fold nor merge such ops) and the checks of a model's forward read them
without loading onnx."""

from __future__ import annotations

# Ops that draw new numbers on every run. A Dropout draws only where its training_mode is true (:func:`random_nodes`):
# at inference it passes its input through.
RANDOM_OPS = frozenset(
    {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli", "Dropout"}
)

# The fix for a model that draws random numbers at inference
RANDOM_HINT = (
    "draw random numbers only in training (`if self.training:`; F.dropout(x, p, training=self.training)), and "
    "return the deterministic value at inference (a VAE's mean, mu): engines are checked by comparing their "
    "outputs with the model's, which draws of their own make impossible"
)
