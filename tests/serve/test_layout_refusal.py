"""A request whose axes are in another order than the engine's (``[B, 3, N]`` sent to a point-cloud model taking
``[B, N, 3]``) reaches the engine's own check, whose refusal names the transpose, not Triton's shape error."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np

from kiln.serve.server import any_fixed_size, write_repository
from tests.serve.served import served


def _points(tmp_path: Path) -> SimpleNamespace:
    engine = served({"points": (["batch", "N", 3], "float32")}, [1, 4])
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "kiln-engine.json").write_text(engine.meta.model_dump_json())
    return SimpleNamespace(meta=engine.meta, model_name=engine.model_name, engine_dir=tmp_path / "engine")


def test_triton_is_told_any_size_where_the_engine_fixes_one_so_kiln_refuses_a_transposed_request(
    tmp_path: Path,
) -> None:
    engine = _points(tmp_path)
    write_repository(tmp_path / "repo", [engine], None, 1, 4, 100)
    config = (tmp_path / "repo" / "e_fp32" / "config.pbtxt").read_text()
    assert "dims: [ -1, -1 ]" in config and "dims: [ -1, 3 ]" not in config
    assert "dims: [ 4 ]" in config  # the outputs as the engine declares them
    # what the stub then answers, from the engine's own kiln-engine.json
    why = engine.meta.refusal({"points": np.zeros((1, 3, 1024), np.float32)})
    assert why is not None and "axis 2 is 1024" in why and "x.transpose(0, 2, 1)" in why
    assert engine.meta.refusal({"points": np.zeros((1, 1024, 3), np.float32)}) is None


def test_only_the_config_frees_the_fixed_sizes() -> None:
    meta = served({"points": (["batch", "N", 3], "float32")}, [1, 4]).meta
    freed = any_fixed_size(meta)
    assert freed.inputs[0].shape[:2] == ["batch", "N"] and not isinstance(freed.inputs[0].shape[2], int)
    assert meta.inputs[0].shape == ["batch", "N", 3] and freed.outputs == meta.outputs
