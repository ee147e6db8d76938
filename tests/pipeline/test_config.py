from pathlib import Path

import pytest

from kiln.core.errors import ConfigError, InputFileError
from kiln.pipeline.config import KilnConfig, config_from_dict, load_config, set_value


def test_demo_defaults_are_valid() -> None:
    cfg = load_config(None)
    assert cfg.name == "demo" and cfg.model.name == "cnn" and cfg.validate_.gates.min_cosine == 0.9999
    assert cfg.precision.variants == ["fp32", "fp16", "int8"]


def test_unknown_key_names_key_and_valid_choices() -> None:
    with pytest.raises(ConfigError) as e:
        config_from_dict({"train": {"epoch": 3}})
    assert "unknown key 'train.epoch'" in e.value.message and "epochs" in e.value.message


def test_unknown_top_level_section() -> None:
    with pytest.raises(ConfigError, match="unknown key 'trian'.*train") as e:
        config_from_dict({"trian": {}})
    assert e.value.hint.startswith("write 'train' for 'trian'")  # a file's typo gets its spelling, as --set's does
    with pytest.raises(ConfigError, match="did you mean 'token_accuracy'"):
        config_from_dict({"validate": {"metric": "token_acuracy"}})


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
    cfg = load_config(p, {"train.lr": 0.5, "signature.batch_sizes": [2]})
    assert (cfg.name, cfg.train.epochs, cfg.train.lr, cfg.signature.batch_sizes) == ("t", 3, 0.5, [2])


def test_dump_round_trips() -> None:
    cfg = load_config(None)
    assert KilnConfig.model_validate(cfg.dump()) == cfg


@pytest.mark.parametrize("batch_sizes", [[], [0], [-1, 8]])
def test_bad_batch_sizes_are_config_errors(batch_sizes) -> None:
    # Before: an empty list reached max() in the build stage and a 0 reached range(): tracebacks.
    with pytest.raises(ConfigError, match="signature.batch_sizes"):
        config_from_dict({"validate": {"batch_sizes": batch_sizes}})


def test_batch_sizes_sorted_and_unique() -> None:
    # The report and CLI read the last batch size as the largest one.
    assert config_from_dict({"validate": {"batch_sizes": [32, 1, 32]}}).signature.batch_sizes == [1, 32]
    assert config_from_dict({"signature": {"batch_sizes": [8, 1]}}).signature.batch_sizes == [1, 8]


def test_zero_max_samples_is_config_error() -> None:
    with pytest.raises(ConfigError, match="validate.max_samples"):
        config_from_dict({"validate": {"max_samples": 0}})


@pytest.mark.parametrize(
    "override, named", [({"fp16": {"min_cosin": 0.9}}, "min_cosin"), ({"fp4": {"min_cosine": 0.9}}, "fp4")]
)
def test_per_precision_gate_typos_are_errors(override, named) -> None:
    # Before: a misspelt gate or precision under per_precision was accepted and silently ignored.
    with pytest.raises(ConfigError, match=named) as e:
        config_from_dict({"validate": {"gates": {"per_precision": override}}})
    assert "validate.gates.per_precision" in e.value.message


def test_per_precision_valid_override_accepted() -> None:
    cfg = config_from_dict({"validate": {"gates": {"per_precision": {"int8": {"max_accuracy_drop": 0.05}}}}})
    assert cfg.validate_.gates.per_precision["int8"]["max_accuracy_drop"] == 0.05


@pytest.mark.parametrize("dotted", ["name.x", "model.name.deep"])
def test_override_below_a_value_is_config_error(dotted) -> None:
    # Before: TypeError ('str'/'int' object does not support item assignment).
    with pytest.raises(ConfigError, match="is a value"):
        load_config(None, {dotted: 1})


def test_override_into_empty_yaml_section(tmp_path: Path) -> None:
    p = tmp_path / "k.yaml"
    p.write_text("validate:\n")  # an empty section loads as None
    assert load_config(p, {"validate.warmup": 2}).validate_.warmup == 2


def test_binary_config_file_is_config_error(tmp_path: Path) -> None:
    # e.g. `kiln run model.onnx`: before, a UnicodeDecodeError traceback.
    p = tmp_path / "model.yaml"
    p.write_bytes(bytes(range(128, 256)))
    with pytest.raises(ConfigError, match="not a text file"):
        load_config(p)


def test_one_per_precision_override_keeps_the_other_defaults() -> None:
    # Before: the override replaced the whole mapping: fp16's min_cosine and int8's other gates were dropped.
    cfg = load_config(None, {"validate.gates.per_precision.int8.min_top1_agreement": 0.95})
    per = cfg.validate_.gates.per_precision
    assert per["int8"] == {
        "min_cosine": 0.99,
        "min_top1_agreement": 0.95,
        "max_accuracy_drop": 0.02,
        "max_systematic_err": 0.03,
    }
    assert per["fp16"] == {"min_cosine": 0.999, "max_systematic_err": 0.01}
    dumped = config_from_dict(cfg.dump())  # `kiln config` output reads back the same
    assert dumped.validate_.gates.per_precision == per


def test_the_dump_of_an_onnx_start_reads_back_as_one(tmp_path: Path, monkeypatch) -> None:
    """`kiln config` of a run from model.onnx, run back: no default model.name that turns it into a PyTorch run."""
    from kiln.models.model_io import torch_model_named

    (tmp_path / "m.onnx").write_text("")
    monkeypatch.chdir(tmp_path)
    cfg = config_from_dict({"model": {"onnx": "m.onnx"}})
    again = config_from_dict(cfg.dump())
    assert again == cfg and not torch_model_named(again.model)
    named = config_from_dict({"model": {"onnx": "m.onnx", "name": "cnn"}})
    assert torch_model_named(config_from_dict(named.dump()).model)


@pytest.mark.parametrize(
    "dotted, text, expected",
    [
        ("build.onnxruntime.transformer_fusion", "off", "off"),  # YAML: False
        ("build.onnxruntime.cuda.prefer_nhwc", "on", "on"),  # YAML: True
        ("name", "1.10", "1.10"),  # YAML: 1.1
        ("calibration.reader", "null", None),
        ("train.epochs", "3", 3),
        ("signature.batch_sizes", "[1, 8]", [1, 8]),
        ("validate.gates.per_precision.int8.min_top1_agreement", "0.95", 0.95),
        ("model.params", "{dim: 16}", {"dim": 16}),
        ("calibration.exclude_nodes", "[conv_1, off]", ["conv_1", "off"]),  # YAML: ["conv_1", False]
        ("build.backends", "[onnxruntime]", ["onnxruntime"]),
    ],
)
def test_set_values_are_read_by_the_schema_type(dotted: str, text: str, expected: object) -> None:
    assert set_value(dotted, text) == expected
    load_config(None, {dotted: set_value(dotted, text)})  # and the config takes it


def test_bare_on_and_off_in_a_yaml_file_are_the_words(write_yaml) -> None:
    """PyYAML reads `on` / `off` as booleans (YAML 1.1): an auto | on | off key takes them as the words; a real
    boolean key is untouched, and a word outside the choices is still an error."""
    path = write_yaml({})
    path.write_text(
        "calibration:\n  reduce_range: on\nbuild:\n  torch:\n    coordinate_descent: off\n"
        "    merge_linears: off\n    gemm_epilogues: off\n  onnxruntime:\n    transformer_fusion: auto\n"
        "  tensorrt:\n    enabled: no\n"
    )
    cfg = load_config(path)
    assert (cfg.calibration.reduce_range, cfg.build.torch.coordinate_descent) == ("on", "off")
    assert (cfg.build.torch.gemm_epilogues, cfg.build.tensorrt.enabled) == ("off", "never")
    assert cfg.build.torch.merge_linears is False and cfg.build.onnxruntime.transformer_fusion == "auto"
    with pytest.raises(ConfigError, match="gemm_epilogues"):  # "on" names no mode there
        config_from_dict({"build": {"torch": {"gemm_epilogues": True}}})
    with pytest.raises(ConfigError, match="reduce_range"):
        config_from_dict({"calibration": {"reduce_range": "maybe"}})


@pytest.mark.parametrize("seed", [2**63, 99999999999999999999999, -1])
def test_a_seed_torch_or_numpy_refuses_is_a_config_error(seed: int) -> None:
    """Before: accepted, then torch.manual_seed raised "Overflow when unpacking long long" in training (numpy's
    default_rng: "expected non-negative integer")."""
    for key in ("seed", "optimize.seed"):
        with pytest.raises(ConfigError) as e:
            load_config(None, {key: seed})
        assert f"invalid override {key}={seed}: a seed is a whole number from 0 to {2**63 - 1}" in e.value.message
    assert load_config(None, {"seed": 2**63 - 1, "optimize.seed": 0}).seed == 2**63 - 1


@pytest.mark.parametrize(
    "given, key, where",
    [
        ({"train": {"epochs": True}}, "train.epochs", "true is"),
        ({"train": {"lr": True}}, "train.lr", "true is"),
        ({"seed": False}, "seed", "false is"),
        ({"signature": {"batch_sizes": [True, 8]}}, "signature.batch_sizes", "true at [0] is"),
        ({"signature": {"logits_output": True}}, "signature.logits_output", "true is"),
        ({"train": {"amp": {"loss_scale": True}}}, "train.amp.loss_scale", "true is"),
        (
            {"validate": {"gates": {"per_precision": {"int8": {"min_cosine": True}}}}},
            "validate.gates.per_precision",
            "true at int8.min_cosine is",
        ),
        ({"build": {"onnxruntime": {"intra_op_threads": True}}}, "build.onnxruntime.intra_op_threads", "true is"),
    ],
)
def test_a_boolean_for_a_number_is_a_config_error(given: dict, key: str, where: str) -> None:
    """Before: pydantic read true as 1 (epochs 1, lr 1.0, batch sizes [1, 8]) without a word."""
    with pytest.raises(ConfigError) as e:
        config_from_dict(given, "c.yaml")
    assert f"'{key}" in e.value.message and f"{where} a boolean where a number is due" in e.value.message


def test_booleans_still_go_where_they_are_taken() -> None:
    cfg = config_from_dict({"train": {"compile": True, "update_graph": False}, "optimize": {"verify": False}})
    assert (cfg.train.compile, cfg.train.update_graph, cfg.optimize.verify) == (True, "off", False)
    assert config_from_dict({"model": {"params": {"pretrained": True, "width": 8}}}).model.params["pretrained"] is True


def test_a_path_given_with_set_is_relative_to_the_current_folder(tmp_path: Path, monkeypatch) -> None:
    """Before: `cd sub; kiln run ../cfgdir/c.yaml --set model.onnx=m.onnx` took cfgdir/m.onnx, not sub/m.onnx."""
    (tmp_path / "cfgdir").mkdir()
    (tmp_path / "sub").mkdir()
    config = tmp_path / "cfgdir" / "c.yaml"
    config.write_text("model: {onnx: m.onnx}\n")
    for folder in ("cfgdir", "sub"):
        (tmp_path / folder / "m.onnx").write_text(folder)
        (tmp_path / folder / "w.pt").write_text(folder)
    monkeypatch.chdir(tmp_path / "sub")
    assert load_config(config).model.onnx == str(tmp_path / "cfgdir" / "m.onnx")  # the file's: beside it
    assert load_config(config, {"model.onnx": "m.onnx"}).model.onnx == str(tmp_path / "sub" / "m.onnx")
    named = load_config(config, {"model.name": "cnn", "model.checkpoint": "w.pt"})
    assert named.model.checkpoint == str(tmp_path / "sub" / "w.pt")
    with pytest.raises(InputFileError, match=r"model.onnx not found: \S*nope.onnx \(a path given with --set"):
        load_config(config, {"model.onnx": "nope.onnx"}, given={"model.onnx": "--set model.onnx=nope.onnx"})
    with pytest.raises(InputFileError, match=r"model.onnx not found: \S*nope.onnx \(a path given with an override"):
        load_config(config, {"model.onnx": "nope.onnx"})  # a Python caller's override: no --set to speak of


def test_a_checkpoint_with_an_onnx_start_and_no_model_name_is_a_config_error(tmp_path: Path) -> None:
    """Before: the checkpoint was ignored without a word: an ONNX start with no model.name has no PyTorch model."""
    (tmp_path / "m.onnx").write_text("")
    (tmp_path / "w.pt").write_text("")
    config = tmp_path / "c.yaml"
    config.write_text("model: {onnx: m.onnx, checkpoint: w.pt}\n")
    with pytest.raises(ConfigError) as e:
        load_config(config)
    assert "model.checkpoint w.pt" in e.value.message and "no model.name" in e.value.message
    assert e.value.hint == "set model.name to the PyTorch model the checkpoint belongs to, or drop model.checkpoint"
    assert load_config(config, {"model.name": "cnn"}).model.checkpoint == str(tmp_path / "w.pt")


@pytest.mark.parametrize(
    "text, where",
    [
        ("train: [unclosed", ": line 1, column 17"),
        ("a: 1\na: 2\n", ": line 2, column 1"),
        ("name: a\x01b\n", ", position 7"),
    ],
)
def test_a_yaml_syntax_error_names_the_file(tmp_path: Path, text: str, where: str) -> None:
    """Before: 'in "<unicode string>", line 1'."""
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert str(p) in e.value.message and where in e.value.message and "<unicode string>" not in e.value.message


def test_a_key_in_both_places_is_one_clean_line(tmp_path: Path) -> None:
    """Before: "invalid config c3.yaml: '': Value error, ... (got {the whole config})"."""
    p = tmp_path / "c3.yaml"
    p.write_text("export: {dynamic_axes: {x: {1: seq}}}\nsignature: {dynamic_axes: {x: {1: seq}}}\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert e.value.message == (
        f"invalid config {p}: export.dynamic_axes and signature.dynamic_axes are both given: keep one "
        "(signature.dynamic_axes)"
    )


def test_the_demo_with_an_onnx_file_drops_the_demos_model_and_data(tmp_path: Path) -> None:
    """`kiln run --set model.onnx=X` (no config) runs X on random inputs, as a config of only model.onnx does: the
    demo's digits would not fit another graph's inputs, and its fixes would ask for data the user never gave."""
    graph = tmp_path / "m.onnx"
    graph.write_bytes(b"")  # the path is what the config checks here; the graph is read by the stages
    cfg = load_config(None, {"model.onnx": str(graph)})
    assert cfg.data.name is None and "name" not in cfg.model.model_fields_set
    kept = load_config(None, {"model.onnx": str(graph), "data.name": "digits", "model.name": "cnn"})
    assert kept.data.name == "digits" and kept.model.name == "cnn"
    assert load_config(None).data.name == "digits"  # the demo alone keeps its own
