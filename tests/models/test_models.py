import numpy as np
import pytest
import torch

from kiln.core.data import call, rows, take, tensors
from kiln.core.errors import ConfigError
from kiln.core.outputs import flatten_outputs
from kiln.models.registry import DATASETS, DEFAULT_DATASET, MODELS, build_model, load_dataset, resolve_callable

SMALL = {
    "resnet18": {"width": 8, "num_classes": 10},
    "bert_base": {"layers": 1, "dim": 64, "heads": 4, "ffn": 128, "in_features": 16, "seq_len": 8},
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_model_runs_on_its_default_dataset_shape(name: str) -> None:
    model = build_model(name, SMALL.get(name)).eval()
    if DEFAULT_DATASET[name] in ("synthetic_rgb", "synthetic_tokens"):
        shape = (3, 32, 32) if name == "resnet18" else (8, 16)
        x = torch.randn(2, *shape)
    else:
        x = take(load_dataset(DEFAULT_DATASET[name]).val_x, slice(0, 2))
    for out in flatten_outputs(call(model, x)).values():
        assert out.shape[0] == 2 and torch.isfinite(out).all()


@pytest.mark.parametrize("name", sorted(DATASETS))
def test_datasets_split_and_label(name: str) -> None:
    d = load_dataset(name)
    assert rows(d.train_x) > rows(d.val_x) > 0
    assert int(d.train_y.max()) < d.num_classes if d.classification else d.num_classes == 0
    assert len(set(map(tuple, tensors(d.val_x)[0].flatten(1).tolist()[:50]))) > 1


def test_digits_is_deterministic_per_seed() -> None:
    a, b, c = (
        load_dataset("digits", {"seed": 1}),
        load_dataset("digits", {"seed": 1}),
        load_dataset("digits", {"seed": 2}),
    )
    assert torch.equal(a.val_y, b.val_y) and not torch.equal(a.val_y, c.val_y)


def named_factory(width: int = 4, depth: int = 1) -> torch.nn.Module:
    return torch.nn.Linear(width, depth)


def test_import_path_and_errors() -> None:
    assert resolve_callable("kiln.models.cnn:small_cnn", MODELS, "model") is resolve_callable("cnn", MODELS, "model")
    with pytest.raises(ConfigError, match="(?s)unknown model 'nope'.*cnn"):
        resolve_callable("nope", MODELS, "model")
    with pytest.raises(ConfigError, match="cannot import module") as err:
        resolve_callable("no_such_pkg.x:f", MODELS, "model")
    assert "from Python (load_config, run_pipeline), add its folder to sys.path" in err.value.hint  # no config dir
    with pytest.raises(ConfigError, match="rejected its params"):
        build_model("cnn", {"wdith": 3})
    with pytest.raises(ConfigError, match="rejected its params") as err:  # a factory whose parameters are named
        build_model("tests.models.test_models:named_factory", {"wdith": 3})
    assert err.value.hint.startswith("write 'width' for 'wdith' in model.params"), err.value.hint
    with pytest.raises(ConfigError, match="is not defined") as err:
        resolve_callable("kiln.models.cnn:smal_cnn", MODELS, "model")
    assert err.value.hint == "write 'kiln.models.cnn:small_cnn' for 'kiln.models.cnn:smal_cnn'"


@pytest.mark.parametrize("name", sorted(MODELS))
def test_default_dataset_fits_the_default_model(name: str) -> None:
    # Before: resnet18 and bert_base defaulted to 1x8x8 `synthetic` data and training died in a conv/linear.
    x = take(load_dataset(DEFAULT_DATASET[name]).val_x, slice(0, 2))
    with torch.inference_mode():
        outs = flatten_outputs(call(build_model(name).eval(), x))
    assert all(out.shape[0] == 2 and torch.isfinite(out).all() for out in outs.values())


@pytest.mark.parametrize(
    "params, named", [({"dim": 64, "heads": 5}, "divisible"), ({"input_kind": "img"}, "input_kind")]
)
def test_bad_transformer_params_are_config_errors(params, named) -> None:
    # Before: an AssertionError traceback (heads) or a silently wrong model (input_kind).
    with pytest.raises(ConfigError, match=named):
        build_model("transformer", params)


@pytest.mark.parametrize("data", ["synthetic", "digits", "synthetic_rgb"])
def test_built_in_datasets_follow_the_run_seed(data: str) -> None:
    # Every built-in dataset is split by the run's seed, not only those some model defaults to.
    from kiln.pipeline.config import config_from_dict
    from kiln.pipeline.runner import load_dataset

    a, b = (load_dataset(config_from_dict({"seed": s, "data": {"name": data}})) for s in (1, 2))
    assert not torch.equal(a.val_y, b.val_y)


@pytest.mark.parametrize(
    "kind,function",
    [("model", "build"), ("dataset", "load"), ("data", "load"), ("train.loss", "loss"), ("calibration", "batches")],
)
def test_import_path_hints_show_a_path_of_the_kind_asked_for(kind: str, function: str) -> None:
    """A data function's hint used to show the model factory's form ('mymodule:build')."""
    for ref in ("kiln.models.cnn:nosuch", "kiln.models.cnn:__name__", "kiln.models.cnn:nn"):
        with pytest.raises(ConfigError) as err:
            resolve_callable(ref, {}, kind)
        assert f"'kiln.models.cnn:{function}'" in (err.value.hint or ""), err.value.hint
        assert function == "build" or ":build" not in (err.value.hint or "")
    table = MODELS if kind == "model" else DATASETS if kind in ("dataset", "data") else {}
    with pytest.raises(ConfigError) as err:
        resolve_callable("no_colon_nor_builtin", table, kind)
    assert f":{function}'" in (err.value.hint or "")


def test_a_bad_data_function_in_a_config_gets_a_data_function_hint(tmp_path) -> None:
    from kiln.core.signature import Signature
    from kiln.models.config import DataConfig, ModelConfig
    from kiln.models.model_io import dataset_for

    for name in ("kiln.models.datasets:nosuch", "kiln.models.datasets:np"):
        with pytest.raises(ConfigError) as err:
            dataset_for(ModelConfig(name="cnn"), DataConfig(name=name), Signature(), 0)
        assert "'kiln.models.datasets:load'" in (err.value.hint or "") and "data function" in err.value.message


def test_a_user_file_named_like_a_module_python_imports_first_is_said(tmp_path, monkeypatch) -> None:
    (tmp_path / "json.py").write_text("def build():\n    return None\n")  # Python's json is imported, not this
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"module 'json' for model 'json:build' is imported from .*json/__init__.py"):
        resolve_callable("json:build", {}, "model")
    with pytest.raises(ConfigError) as err:
        resolve_callable("json:build", {}, "model")
    assert str(tmp_path / "json.py") in err.value.message and "rename json.py" in err.value.hint
    (tmp_path / "json.py").unlink()
    with pytest.raises(ConfigError, match="is not defined, so there is no"):  # no such file: the usual error
        resolve_callable("json:build", {}, "model")


def test_digits_read_from_scikit_learns_file_are_its_load_digits() -> None:
    from sklearn.datasets import load_digits

    from kiln.models.datasets import digits_arrays

    pixels, labels = digits_arrays()
    bunch = load_digits()
    assert np.array_equal(pixels, bunch.data) and np.array_equal(labels, bunch.target) and labels.dtype == np.int64


def test_an_unnamed_user_dataset_is_named_by_its_function(tmp_path, monkeypatch) -> None:
    """Messages about the data ("dataset ... has no labels") name the function that made it, not 'dataset'."""
    (tmp_path / "kiln_unnamed_data.py").write_text(
        "import torch\nfrom kiln import DatasetSplits\n\n"
        "def load():\n    x = torch.zeros(8, 4)\n    return DatasetSplits(x[:6], None, x[6:], None)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_dataset("kiln_unnamed_data:load").name == "kiln_unnamed_data:load"
    assert load_dataset("digits").name != "kiln_unnamed_data:load"


def test_a_dot_for_the_colon_of_an_import_path_gets_the_path_with_the_colon(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """'pkg.build' for 'pkg:build' said only 'unknown model' and listed the built-ins; the module is found on the
    import path without importing it (a config check runs no user code)."""
    import sys

    from kiln.models.registry import check_name

    (tmp_path / "dotpkg_s26").mkdir()
    (tmp_path / "dotpkg_s26" / "__init__.py").write_text("raise SystemExit('imported')\n")
    (tmp_path / "dotpkg_s26" / "nets.py").write_text("def build():\n    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for ref, fixed in [("dotpkg_s26.build", "dotpkg_s26:build"), ("dotpkg_s26.nets.build", "dotpkg_s26.nets:build")]:
        with pytest.raises(ConfigError, match=f"unknown model '{ref}'") as err:
            check_name(ref, MODELS, "model")
        assert err.value.hint.startswith(f"write '{fixed}' for '{ref}'"), err.value.hint
    assert "dotpkg_s26" not in sys.modules
    with pytest.raises(ConfigError) as err:
        resolve_callable("kiln.models.cnn.small_cnn", MODELS, "model")
    assert err.value.hint.startswith("write 'kiln.models.cnn:small_cnn' for 'kiln.models.cnn.small_cnn'")
    with pytest.raises(ConfigError, match="unknown model 'no_such_pkg_s26.build'") as err:  # no such module: as before
        check_name("no_such_pkg_s26.build", MODELS, "model")
    assert "cnn" in err.value.hint and "mymodels:build" in err.value.hint
