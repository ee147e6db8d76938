"""The train section stays strict: unknown keys (also nested ones) are errors naming the valid keys."""
from __future__ import annotations

import pytest

from pipeline.config import config_from_dict
from pipeline.errors import ConfigError
from stages.train.config import TrainConfig


@pytest.mark.parametrize("section, key", [("train", "epoch"), ("train.amp", "scale"), ("train.loader", "workers"),
                                          ("train.distributed", "nprocs"), ("train.checkpoint", "every")])
def test_unknown_keys_are_errors(section: str, key: str) -> None:
    data: dict = {}
    node = data
    for part in section.split("."):
        node = node.setdefault(part, {})
    node[key] = 1
    with pytest.raises(ConfigError, match=f"unknown key '{section}.{key}'"):
        config_from_dict(data)


def test_defaults_and_nested_values() -> None:
    cfg = config_from_dict({"train": {"amp": {"loss_scale": 1024}, "loader": {"num_workers": 2},
                                      "distributed": {"nproc_per_node": 2, "bucket_cap_mb": 50}}}).train
    assert cfg.amp.loss_scale == 1024.0 and cfg.amp.init_scale == 2.0**16
    assert cfg.loader.num_workers == 2 and cfg.distributed.bucket_cap_mb == 50
    assert TrainConfig().epochs == 8 and TrainConfig().batch_size == 64  # the demo's defaults


def test_bad_values_are_errors() -> None:
    with pytest.raises(ConfigError, match="loss_scale"):
        config_from_dict({"train": {"amp": {"loss_scale": "big"}}})
    with pytest.raises(ConfigError, match="grad_accum_steps"):
        config_from_dict({"train": {"grad_accum_steps": 0}})
