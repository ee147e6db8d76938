"""`kiln serve --pytriton` binds each engine as the package's Triton configs declare it: a two-tower engine (texts and
images in counts of their own) unbatched, each request run whole. No server is started: the binding is read from a
stand-in for PyTriton's ``Triton``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kiln.serve.server import ServedEngine, _bind
from kiln.stages.engines.registry import load_engine
from tests.stages.engines.two_tower_engine import two_tower_engine, two_tower_feed

pytest.importorskip("pytriton", reason="needs the serving libraries (pip install 'kiln[serve]')")


class _Triton:
    """What ``Triton.bind`` was given."""

    def __init__(self) -> None:
        self.bound: dict[str, Any] = {}

    def bind(self, **kwargs: Any) -> None:
        self.bound = kwargs


def test_a_two_tower_engine_is_bound_unbatched_and_answers_5_texts_with_2_images(tmp_path: Path) -> None:
    from pytriton.proxy.types import Request

    engine, meta = two_tower_engine(tmp_path)
    triton = _Triton()
    feed = two_tower_feed(5, 2)
    with load_engine(engine) as runner:
        _bind(triton, ServedEngine("m", engine, meta), runner, 32, 100)
        [answer] = triton.bound["infer_func"]([Request(data=feed)])
        want = runner.infer(feed)
    config = triton.bound["config"]
    assert config.max_batch_size == 0 and not config.batching
    assert [t.shape for t in triton.bound["inputs"]] == [(-1, -1, 4), (-1, 6)]  # full shapes: each request whole
    assert {k: v.shape for k, v in answer.items()} == {"text_embeds": (5, 3), "image_embeds": (2, 3)}
    for name, array in answer.items():
        np.testing.assert_array_equal(array, want[name])
