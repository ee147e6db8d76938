"""Engine-directory helpers shared by the build stage's autotuner and `kiln validate` on files."""
import numpy as np
import pytest

from kiln.core.errors import ConfigError
from kiln.stages.engines.engines import random_feed


def test_random_feed_sets_only_a_dynamic_batch_axis() -> None:
    specs = [{"name": "x", "shape": ["batch", 3, 4], "dtype": "float32"},
             {"name": "ids", "shape": [0, 5], "dtype": "int64"}, {"name": "fixed", "shape": [1, 3], "dtype": "float32"}]
    feed = random_feed(specs, batch=7)
    assert feed["x"].shape == (7, 3, 4) and feed["x"].dtype == np.float32
    assert feed["ids"].shape == (7, 5) and set(np.unique(feed["ids"])) <= {0, 1}
    assert feed["fixed"].shape == (1, 3)  # a model exported with batch 1 keeps it


@pytest.mark.parametrize("shape", [["batch", "seq", 4], ["batch", 0, 4], [1, None]])
def test_random_feed_refuses_unknown_axes_besides_the_batch(shape) -> None:
    # Before: `kiln validate` on files filled a 0-sized axis anywhere with the batch size.
    with pytest.raises(ConfigError, match="dynamic axes") as err:
        random_feed([{"name": "x", "shape": shape, "dtype": "float32"}], batch=2, hint="pass arrays")
    assert err.value.hint == "pass arrays"
