"""Issue 31 rule 1: every value a user hands Kiln is checked where it enters, against what it will be used for,
as one `error:` naming the value and where it came from and one `fix:` (never a traceback, never exit 0)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from kiln.cli import main
from kiln.core.data import DataContractError, DatasetSplits, check_splits
from kiln.core.errors import InputFileError
from kiln.models.model_io import check_onnx_takes
from tests.pipeline.test_faults import assert_clean, tiny_onnx


def invoke(*args: object):
    return CliRunner().invoke(main, [str(a) for a in args])


def _arrays(kind: str) -> np.ndarray:
    x = np.random.default_rng(0).random((8, 4), dtype=np.float32)
    if kind == "nan":
        x[2, 1] = np.nan
    if kind == "inf":
        x[0, 0] = -np.inf
    return {"nan": x, "inf": x, "empty": x[:0], "float64": x.astype(np.float64), "wide": np.ones((8, 5), np.float32)}[
        kind
    ]


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("engine")
    model = tiny_onnx(folder / "m.onnx")
    assert invoke("build", model, "-o", folder / "engine").exit_code == 0
    return model, folder / "engine"


@pytest.mark.parametrize(
    "kind, needle",
    [
        ("nan", "1 NaN values"),
        ("inf", "1 infinite values"),
        ("empty", "no rows"),
        ("float64", "float64[8, 4]"),
        ("wide", "[8, 5]"),
    ],
)
def test_an_inputs_file_is_checked_naming_the_file(engine, tmp_path: Path, kind: str, needle: str) -> None:
    model, built = engine
    feed = tmp_path / f"{kind}.npz"
    np.savez(feed, input=_arrays(kind))
    assert_clean(invoke("validate", built, "--reference", model, "--inputs", feed), 2, needle, str(feed))


@pytest.mark.parametrize("kind", ["nan", "empty"])
def test_a_calibration_file_is_checked_against_the_model(tmp_path: Path, kind: str) -> None:
    model = tiny_onnx(tmp_path / "m.onnx")
    feed = tmp_path / "calib.npz"
    np.savez(feed, input=_arrays(kind))
    out = invoke("precision", model, "-o", tmp_path / "v", "--variants", "int8", "--calibration", feed)
    assert_clean(out, 2, str(feed))


def _splits(**change: object) -> DatasetSplits:
    x = torch.rand(16, 3, 4, 4)
    y = torch.randint(0, 3, (16,))
    parts = {"train_x": x[:12], "train_y": y[:12], "val_x": x[12:], "val_y": y[12:], "num_classes": 3}
    return DatasetSplits(**(parts | change))


def _with(t: torch.Tensor, value: float) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[3] = value
    return t


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"train_x": _with(torch.rand(12, 3, 4, 4), float("nan"))}, "train_x holds 1 NaN"),
        ({"val_x": _with(torch.rand(4, 3, 4, 4), float("inf"))}, "val_x holds 1 infinite"),
        ({"val_x": torch.rand(4, 3, 4, 4).to(torch.complex64)}, "complex"),
        ({"train_y": _with(torch.rand(12), float("nan")), "val_y": torch.rand(4)}, "train_y holds 1 NaN"),
        ({"val_y": torch.tensor([0, 1, 2, 3])}, "outside 0..2"),
        (
            {"train_y": torch.zeros(12, 2, dtype=torch.long), "val_y": torch.full((4, 2), -100)},
            "every label of val_y is -100",
        ),
    ],
)
def test_dataset_values_are_checked(change: dict, needle: str) -> None:
    with pytest.raises(DataContractError, match=needle.replace(".", r"\.")):
        check_splits(_splits(**change), "mine:data")


@pytest.mark.parametrize("axis", [3, 7])
def test_a_dynamic_axis_beyond_the_inputs_rank(axis: int) -> None:
    splits = _splits(train_x=torch.rand(12, 3), val_x=torch.rand(4, 3))
    with pytest.raises(DataContractError, match=f"axis {axis}, but dataset 'd' gives it 2 axes"):
        check_splits(splits, "d", {"input": {axis: "seq"}})


@pytest.mark.parametrize(
    "axes, needle",
    [
        ("{input: {1: batch}}", "named 'batch'"),  # the channel axis would become the engines' batch axis
        ("{input: {0: seq}}", "axis 0"),
        ("{input: {-1: seq}}", "axis -1"),
    ],
)
def test_dynamic_axes_that_would_move_the_batch_axis(axes: str, needle: str) -> None:
    assert_clean(invoke("config", "--set", f"signature.dynamic_axes={axes}"), 2, needle, "signature.dynamic_axes")


@pytest.mark.parametrize("given", ["--set", "file"])
def test_a_first_axis_of_its_own_is_refused_with_the_way_that_takes_it(tmp_path: Path, given: str) -> None:
    """Kiln's export ties every input's axis 0 to one batch; a two-tower model is told how to keep them apart, in
    the fix line (it once said only to give the key a value it takes, or to see `kiln config`)."""
    if given == "file":
        cfg = tmp_path / "c.yaml"
        cfg.write_text("signature: {dynamic_axes: {pixel_values: {0: images}}}\n")
        out = invoke("config", cfg)
    else:
        out = invoke("config", "--set", "signature.dynamic_axes={pixel_values: {0: images}}")
    assert_clean(out, 2, "axis 0", "signature.dynamic_axes")
    fix = next(ln for ln in out.output.splitlines() if ln.startswith("fix:"))
    assert "counts of their own" in fix and "give it as model.onnx, whose axis names Kiln keeps" in fix, fix
    assert "{'pixel_values': {0: 'images'}" in fix, fix


@pytest.mark.parametrize("shapes", ["{seq: [-2]}", "{seq: []}", "{batch: [0]}"])
def test_signature_shapes_need_sizes_of_0_or_more_and_no_empty_batch(shapes: str) -> None:
    assert_clean(invoke("config", "--set", f"signature.shapes={shapes}"), 2, "signature.shapes")


@pytest.mark.parametrize("suffix", [".YAML", ".Yml", ".JSON", ".Toml"])
def test_config_kinds_in_any_case(tmp_path: Path, suffix: str) -> None:
    text = (
        '{"train": {"epochs": 1}}'
        if suffix.lower() == ".json"
        else ("[train]\nepochs = 1\n" if suffix.lower() == ".toml" else "train: {epochs: 1}\n")
    )
    path = tmp_path / f"run{suffix}"
    path.write_text(text)
    out = invoke("config", path)
    assert out.exit_code == 0 and "epochs: 1" in out.output, out.output


@pytest.mark.parametrize("name", ["run.txt", "run.cfg", "run"])
def test_a_config_of_another_kind_is_refused(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    path.write_text("train: {epochs: 1}\n")
    assert_clean(invoke("config", path), 2, str(path), ".yaml")


@pytest.mark.parametrize(
    "x, needle",
    [
        (torch.rand(4, 8, 8, 3), "float32[4, 8, 8, 3]"),  # channels last for a channels-first graph
        (torch.rand(4, 3, 8, 8).double(), "float64"),
        ({"image": torch.rand(4, 3, 8, 8)}, "not those of model.onnx"),
    ],
)
def test_an_onnx_start_checks_the_data_against_the_files_inputs(tmp_path: Path, x: object, needle: str) -> None:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.ones((2, 3, 3, 3), np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["input", "w"], ["logits"])],
        "conv",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3, 8, 8])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 2, 6, 6])],
        [w],
    )
    path = tmp_path / "conv.onnx"
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    with pytest.raises((InputFileError, DataContractError), match=needle.replace("[", r"\[").replace(".", r"\.")):
        check_onnx_takes(path, DatasetSplits(x, None, x, None), "mine:data")
