"""The config as Python callers give it: ``config_from_dict`` and ``load_config`` with overrides but no ``given``.
They get the checks a config file gets, and errors worded for Python (no ``--set``, no empty source)."""

from pathlib import Path

import pytest

from kiln.core.errors import ConfigError, InputFileError
from kiln.pipeline.config import config_from_dict, load_config


@pytest.fixture
def onnx_start(tmp_path: Path) -> Path:
    """A folder with a model.onnx and a checkpoint (their content is never read by the config checks)."""
    (tmp_path / "m.onnx").write_text("")
    (tmp_path / "w.safetensors").write_text("")
    return tmp_path


def _error(kind: type[Exception], *args, **kwargs) -> ConfigError:
    with pytest.raises(kind) as e:
        config_from_dict(*args, **kwargs)
    assert "\n" not in e.value.message and e.value.hint and "\n" not in e.value.hint
    return e.value


def test_a_dict_with_an_onnx_start_and_a_checkpoint_is_refused(onnx_start: Path) -> None:
    """Before: accepted, and the checkpoint silently unused (load_config refuses the same config)."""
    model = {"onnx": str(onnx_start / "m.onnx"), "checkpoint": str(onnx_start / "w.safetensors")}
    err = _error(ConfigError, {"model": model})
    assert "model.checkpoint w.safetensors" in err.message and "no model.name" in err.message, err.message
    assert config_from_dict({"model": {**model, "name": "cnn"}}).model.checkpoint == model["checkpoint"]


def test_a_dict_with_an_onnx_start_and_the_torch_backend_is_refused(onnx_start: Path) -> None:
    """Before: accepted; the run failed in build on a missing train/model.safetensors after three stages."""
    err = _error(ConfigError, {"model": {"onnx": str(onnx_start / "m.onnx")}, "build": {"backends": ["torch"]}})
    assert "build.backends ['torch']" in err.message and "drop torch from build.backends" in err.hint


def test_a_dicts_relative_paths_are_the_current_folders_or_bases(onnx_start: Path, monkeypatch) -> None:
    monkeypatch.chdir(onnx_start)
    assert config_from_dict({"model": {"onnx": "m.onnx"}}).model.onnx == str(onnx_start.resolve() / "m.onnx")
    monkeypatch.chdir(onnx_start.parent)
    based = config_from_dict({"model": {"onnx": "m.onnx"}}, base=onnx_start)
    assert based.model.onnx == str(onnx_start.resolve() / "m.onnx")
    err = _error(InputFileError, {"model": {"onnx": "m.onnx"}})
    assert "model.onnx not found: m.onnx (a relative path in a config dict is relative to the current folder)" in (
        err.message
    ), err.message


def test_a_dicts_misspelt_builtin_name_is_refused() -> None:
    err = _error(ConfigError, {"model": {"name": "cnnn"}})
    assert err.message == "unknown model 'cnnn'", err.message


def test_a_dicts_error_names_it_a_config_dict() -> None:
    """Before: "invalid config : 'validate.gates.min_cosine' ..." (no source by default)."""
    err = _error(ConfigError, {"validate": {"gates": {"min_cosine": "x"}}})
    assert err.message.startswith("invalid config (config dict): 'validate.gates.min_cosine'"), err.message


@pytest.mark.parametrize(
    "key, value, fix",
    [
        ("signature.batch_sizes", "1,8", "give the list as a Python list: {'signature.batch_sizes': [1, 8]}"),
        ("precision.variants", "fp32", "give the list as a Python list: {'precision.variants': ['fp32']}"),
        ("train.epoch", 3, "write 'train.epochs' for 'train.epoch' in the overrides"),
        ("train.epochs", "abc", "give the override train.epochs a value the key takes"),
    ],
)
def test_a_python_override_is_said_as_python_wrote_it(key: str, value: object, fix: str) -> None:
    """Before: "invalid --set signature.batch_sizes=1,8 ... fix: write the list in brackets: --set ..." to a Python
    caller who typed no --set."""
    with pytest.raises(ConfigError) as e:
        load_config(None, {key: value})
    assert e.value.message.startswith(f"invalid override {key}={value!r}: "), e.value.message
    assert fix in e.value.hint and "--set" not in e.value.message + e.value.hint, e.value.hint


def test_the_command_lines_words_still_name_its_sets() -> None:
    """The CLI passes ``given`` (empty without a --set): a key it set otherwise is still said as a --set."""
    with pytest.raises(ConfigError) as e:
        load_config(None, {"signature.batch_sizes": "1,8"}, given={})
    assert e.value.message.startswith("invalid --set signature.batch_sizes=1,8: "), e.value.message
    assert e.value.hint == "write the list in brackets: --set signature.batch_sizes=[1,8]"
