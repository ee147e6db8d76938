"""The train section stays strict: unknown keys (also nested ones) are errors naming the valid keys."""

from __future__ import annotations

import pytest

from kiln.core.errors import ConfigError
from kiln.pipeline.config import config_from_dict
from kiln.stages.train.config import TrainConfig


@pytest.mark.parametrize(
    "section, key",
    [
        ("train", "epoch"),
        ("train.amp", "scale"),
        ("train.loader", "workers"),
        ("train.distributed", "nprocs"),
        ("train.checkpoint", "every"),
    ],
)
def test_unknown_keys_are_errors(section: str, key: str) -> None:
    data: dict = {}
    node = data
    for part in section.split("."):
        node = node.setdefault(part, {})
    node[key] = 1
    with pytest.raises(ConfigError, match=f"unknown key '{section}.{key}'"):
        config_from_dict(data)


def test_defaults_and_nested_values() -> None:
    cfg = config_from_dict(
        {
            "train": {
                "amp": {"loss_scale": 1024},
                "loader": {"num_workers": 2},
                "distributed": {"nproc_per_node": 2, "bucket_cap_mb": 50},
            }
        }
    ).train
    assert cfg.amp.loss_scale == 1024.0 and cfg.amp.init_scale == 2.0**16
    assert cfg.loader.num_workers == 2 and cfg.distributed.bucket_cap_mb == 50
    assert TrainConfig().epochs == 8 and TrainConfig().batch_size == 64  # the demo's defaults


def test_bad_values_are_errors() -> None:
    with pytest.raises(ConfigError, match="loss_scale"):
        config_from_dict({"train": {"amp": {"loss_scale": "big"}}})
    with pytest.raises(ConfigError, match="grad_accum_steps"):
        config_from_dict({"train": {"grad_accum_steps": 0}})


@pytest.mark.parametrize(
    "train, message",
    [
        ({"betas": [1.5, 0.999]}, r"'train.betas': .*each AdamW beta must be in \[0, 1\)"),
        ({"betas": [0.9, -0.1]}, r"'train.betas'"),
        ({"momentum": 1.5}, r"'train.momentum': Input should be less than 1"),
        ({"lr": 0.01, "min_lr": 0.1}, r"train.min_lr \(0.1\) is above train.lr \(0.01\)"),
    ],
)
def test_optimizer_values_out_of_range_are_config_errors(train: dict, message: str) -> None:
    """Checked when the config loads, not as a torch traceback at the first step or a rising 'decay'."""
    with pytest.raises(ConfigError, match=message):
        config_from_dict({"train": train})
    config_from_dict({"train": {"lr": 0.01, "min_lr": 0.1, "schedule": "constant"}})  # no decay: no floor


def test_warmup_longer_than_the_run_is_a_config_error() -> None:
    from kiln.stages.train.loop import train
    from tests.stages.train.train_helpers import tiny_data, tiny_net, train_cfg

    with pytest.raises(ConfigError, match=r"warmup_steps is 10 but the run has only 10 optimizer steps"):
        train(tiny_net(), tiny_data(), train_cfg(epochs=2, warmup_steps=10))  # 5 steps per epoch


def test_validation_sizes_are_not_in_trains_key(tmp_path) -> None:
    """``signature.shapes`` (the axis sizes engines are validated at) and the batch sizes change nothing training
    does: train's key stays, export's changes."""
    from kiln.pipeline.config import config_from_dict
    from kiln.pipeline.runner import cache_key
    from kiln.pipeline.stage_list import stage_named

    def keys(**signature: object) -> tuple[str, str]:
        base = {"signature": {"dynamic_axes": {"input": {2: "h"}}, **signature}}
        cfg = config_from_dict(base)
        return cache_key(stage_named("train"), cfg, tmp_path)[0], cache_key(stage_named("export"), cfg, tmp_path)[0]

    before, after = keys(shapes={"h": [8]}), keys(shapes={"h": [8, 16]})
    assert before[0] == after[0] and before[1] != after[1]
