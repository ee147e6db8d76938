from pathlib import Path

import pytest

from pipeline.config import KilnConfig, config_from_dict, load_config
from pipeline.errors import ConfigError, InputFileError


def test_demo_defaults_are_valid() -> None:
    cfg = load_config(None)
    assert cfg.name == "demo" and cfg.model.name == "cnn" and cfg.validate_.gates.min_cosine == 0.9999
    assert cfg.precision.variants == ["fp32", "fp16", "int8"]


def test_unknown_key_names_key_and_valid_choices() -> None:
    with pytest.raises(ConfigError) as e:
        config_from_dict({"train": {"epoch": 3}})
    assert "unknown key 'train.epoch'" in e.value.message and "epochs" in e.value.message


def test_unknown_top_level_section() -> None:
    with pytest.raises(ConfigError, match="unknown key 'trian'.*train"):
        config_from_dict({"trian": {}})


def test_wrong_type_and_bad_choice() -> None:
    with pytest.raises(ConfigError) as e:
        config_from_dict({"train": {"epochs": "many", "precision": "fp8"}})
    assert "train.epochs" in e.value.message and "train.precision" in e.value.message and "bf16" in e.value.message


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(InputFileError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")


def test_missing_checkpoint(write_yaml) -> None:
    with pytest.raises(InputFileError, match="model.checkpoint not found"):
        load_config(write_yaml({"model": {"checkpoint": "missing.pt"}}))


def test_yaml_syntax_error(tmp_path: Path) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text("train: [unclosed")
    with pytest.raises(ConfigError, match="cannot parse config"):
        load_config(p)


def test_toml_and_overrides(tmp_path: Path) -> None:
    p = tmp_path / "k.toml"
    p.write_text('name = "t"\n[train]\nepochs = 3\n')
    cfg = load_config(p, {"train.lr": 0.5, "validate.batch_sizes": [2]})
    assert (cfg.name, cfg.train.epochs, cfg.train.lr, cfg.validate_.batch_sizes) == ("t", 3, 0.5, [2])


def test_dump_round_trips() -> None:
    cfg = load_config(None)
    assert KilnConfig.model_validate(cfg.dump()) == cfg
