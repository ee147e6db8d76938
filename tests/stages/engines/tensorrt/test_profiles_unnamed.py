"""kiln.stages.engines.tensorrt.profiles: the refusal of an unsized dynamic axis names the axis by its index."""

from __future__ import annotations

import pytest

from kiln.core.errors import ConfigError
from kiln.core.records import TensorSpec
from kiln.stages.engines.tensorrt.profiles import default_profiles


def test_an_unnamed_axis_is_told_by_its_index_and_shown_unknown() -> None:
    """``z [N, ?, 8]``: axis 1, whose size is unknown, not an axis 0 of size 0."""
    spec = TensorSpec(name="z", shape=["N", 0, 8], dtype="float32")
    with pytest.raises(ConfigError) as err:
        default_profiles([spec], 8, {})
    assert "(shape ['N', ?, 8]) has dynamic axes [axis 1 (unnamed)]" in err.value.message
