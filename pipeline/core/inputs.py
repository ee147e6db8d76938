"""The one maker of random model inputs, from declared input specs (an engine's metadata or a graph's inputs)."""
from __future__ import annotations

import numpy as np
from kiln.core.errors import ConfigError
from kiln.core.records import TensorSpec


def random_inputs(specs: list[TensorSpec], batch: int, dynamic: int | None = None, int_high: int = 1, seed: int = 0,
                  hint: str = "pass concrete input arrays") -> dict[str, np.ndarray]:
    """One array per input: ``batch`` on a symbolic first (batch) axis, ``dynamic`` on any other symbolic axis
    (``None``: such an axis is an error naming ``hint``); integers in [0, ``int_high``] (1 by default, so any
    embedding accepts them), booleans at random, floats standard normal. A fixed axis keeps its size."""
    rng = np.random.default_rng(seed)
    feed: dict[str, np.ndarray] = {}
    for spec in specs:
        shape = [_size(d, i, batch, dynamic, spec, hint) for i, d in enumerate(spec.shape)]
        dtype = np.dtype(spec.dtype)
        if dtype == np.bool_:
            feed[spec.name] = rng.random(shape) < 0.5
        elif dtype.kind in "iu":
            feed[spec.name] = rng.integers(0, int_high + 1, size=shape).astype(dtype)
        else:
            feed[spec.name] = rng.standard_normal(shape).astype(dtype)
    return feed


def _size(dim: int | str, axis: int, batch: int, dynamic: int | None, spec: TensorSpec, hint: str) -> int:
    if isinstance(dim, int) and dim >= 1:
        return dim
    if axis == 0:
        return batch
    if dynamic is None:
        raise ConfigError(f"input '{spec.name}' has dynamic axes {spec.shape} besides the batch axis", hint=hint)
    return dynamic
