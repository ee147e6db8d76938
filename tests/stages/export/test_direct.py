"""Direct export (``kiln export --model M -o x.onnx``): the example inputs come from ``--input-shape`` or the data,
and a model whose inputs neither gives is asked for them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from kiln.core.errors import ConfigError, ModelError
from kiln.pipeline.config import load_config
from kiln.pipeline.runner import settings_for
from kiln.pipeline.stage_list import stage_named
from kiln.stages.export.input_specs import parse_input_shapes

# (model, --input-shape values that fit it, its forward's inputs)
from kiln.stages.export.stage import export_direct

# (model, --input-shape values that fit it, its forward's inputs)
MULTI_INPUT = [
    ("tests.user_models:two_in", ("x=8", "meta=3"), ["x", "meta"]),
    (
        "tests.user_models:ids_and_mask",
        ("input_ids=6:int64", "attention_mask=6:int64"),
        ["input_ids", "attention_mask"],
    ),
    ("tests.user_models:three_in", ("image=3x6x6", "vec=5", "scale=1"), ["image", "vec", "scale"]),
]


def settings(model: str, **sets: object):
    cfg = load_config(None, {"model.name": model, "data.name": None, **sets})
    return settings_for(stage_named("export"), cfg)


@pytest.mark.parametrize("model,shapes,names", MULTI_INPUT)
def test_a_multi_input_model_without_shapes_is_asked_for_each_input(
    tmp_path: Path, model: str, shapes: tuple[str, ...], names: list[str]
) -> None:
    with pytest.raises(ConfigError, match="cannot tell which inputs") as err:
        export_direct(settings(model), None, (), tmp_path / "m.onnx")
    assert all(f"--input-shape {n}=DIMS" in (err.value.hint or "") for n in names)
    assert not (tmp_path / "m.onnx").exists()


@pytest.mark.parametrize("model,shapes,names", MULTI_INPUT)
def test_data_the_model_does_not_take_is_refused_with_the_same_fix(
    tmp_path: Path, model: str, shapes: tuple[str, ...], names: list[str]
) -> None:
    with pytest.raises(ConfigError, match="rejects the inputs of dataset 'digits'") as err:
        export_direct(settings(model, **{"data.name": "digits"}), None, (), tmp_path / "m.onnx")
    assert f"--input-shape {names[0]}=DIMS" in (err.value.hint or "")


@pytest.mark.parametrize("model,shapes,names", MULTI_INPUT)
def test_one_input_shape_per_input_exports_the_model(
    tmp_path: Path, model: str, shapes: tuple[str, ...], names: list[str]
) -> None:
    summary = export_direct(settings(model), None, shapes, tmp_path / "m.onnx")
    graph = onnx.load(str(tmp_path / "m.onnx")).graph
    assert [i.name for i in graph.input] == names and summary["max_abs_err"] < 1e-4
    dtypes = {i.name: i.type.tensor_type.elem_type for i in graph.input}
    int_inputs = {s.name for s in parse_input_shapes(shapes) if s.dtype == "int64"}
    assert {n for n, t in dtypes.items() if t == onnx.TensorProto.INT64} == int_inputs


@pytest.mark.parametrize("model,shapes,names", MULTI_INPUT)
def test_shapes_that_miss_or_misname_an_input_are_refused(
    tmp_path: Path, model: str, shapes: tuple[str, ...], names: list[str]
) -> None:
    for wrong in (shapes[:-1], (*shapes[:-1], "nosuch=2")):
        with pytest.raises(ConfigError, match="rejects the inputs --input-shape gives"):
            export_direct(settings(model), None, wrong, tmp_path / "m.onnx")


@pytest.mark.parametrize(
    "values,needle",
    [
        (("3,-1",), "is not"),
        (("x=3:nodtype",), "is not"),
        (("x y=3",), "is not"),
        (("x=3", "4"), "not every one named"),
        (("x=3", "x=4"), "names an input twice"),
        (("t=int64",), "is not"),
        (("",), "is not"),
        (("t=(3",), "is not"),
    ],
)
def test_bad_input_shapes_are_config_errors(values: tuple[str, ...], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        parse_input_shapes(values)


def test_input_shape_forms() -> None:
    specs = parse_input_shapes(("image=3x224x224", "ids=128:int64"))
    assert [(s.name, s.shape, s.dtype) for s in specs] == [
        ("image", ["batch", 3, 224, 224], "float32"),
        ("ids", ["batch", 128], "int64"),
    ]
    assert [(s.name, s.shape) for s in parse_input_shapes(("1,8,8",))] == [("input", ["batch", 1, 8, 8])]
    assert [s.shape for s in parse_input_shapes(("a=(3, 8)",))] == [["batch", 3, 8]]


@pytest.mark.parametrize("value", ["t=():int64", "t=:int64", "t=( ):int64"])
def test_a_sample_without_axes_is_an_input_of_one_value_per_sample(value: str) -> None:
    """A diffusion timestep is one number per sample, ``[batch]``. Before: ``t=:int64`` was refused, and the one
    way through, ``t=1:int64``, gave ``[batch, 1]``, which the model's ``x, t`` unpacking refused."""
    assert [(s.name, s.shape, s.dtype) for s in parse_input_shapes((value,))] == [("t", ["batch"], "int64")]


def test_the_refusal_of_a_shape_says_how_to_give_one_value_per_sample() -> None:
    with pytest.raises(ConfigError, match=r"--input-shape 't=int64' is not \[NAME=\]DIMS\[:DTYPE\]") as err:
        parse_input_shapes(("t=int64",))
    assert "() for one value per sample" in (err.value.hint or "") and "t=():int64" in (err.value.hint or "")


class _Denoiser(torch.nn.Module):
    """A diffusion model's shape: ``forward(x, t)``, ``t`` one int64 step per sample, embedded sinusoidally."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        (batch,) = t.shape  # a [batch, 1] step is refused here, as a UNet's embedding refuses it
        freqs = torch.arange(4, dtype=torch.float32)
        emb = torch.cat([torch.sin(t[:, None] * freqs), torch.cos(t[:, None] * freqs)], dim=1)
        return self.lin(x) + emb.reshape(batch, 8)


def denoiser() -> torch.nn.Module:
    return _Denoiser()


def test_a_model_taking_a_step_per_sample_exports_from_input_shapes(tmp_path: Path) -> None:
    summary = export_direct(settings(f"{__name__}:denoiser"), None, ("x=8", "t=():int64"), tmp_path / "m.onnx")
    graph = onnx.load(str(tmp_path / "m.onnx")).graph
    shapes = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in graph.input}
    assert shapes == {"x": ["batch", 8], "t": ["batch"]} and summary["max_abs_err"] < 1e-4


class _WrongExport(torch.nn.Module):
    """Averages 8 features into 4 groups with scatter_reduce 'mean', which ONNX's ScatterElements lacks: its graph
    computes another function (a model that draws random numbers is refused before the export)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        index = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3]).expand(x.shape[0], 8)
        return torch.zeros(x.shape[0], 4).scatter_reduce(1, index, x, reduce="mean", include_self=False)


def wrong_export() -> torch.nn.Module:
    return _WrongExport()


def test_a_graph_beyond_the_parity_tolerance_is_an_error_not_a_result(tmp_path: Path) -> None:
    """The pipeline holds export parity to export.parity_atol; `kiln export -o` holds it to the same."""
    with pytest.raises(ModelError, match="differs from PyTorch .*: max abs error .* > export.parity_atol") as err:
        export_direct(settings(f"{__name__}:wrong_export"), None, ("x=8",), tmp_path / "m.onnx")
    assert "random inputs of the --input-shape sizes" in str(err.value)
    assert "give the config's data instead of --input-shape" in (err.value.hint or "")


class _Causal(torch.nn.Module):
    """Two attention layers over token ids under a causal and a padding mask: a row whose first token is padding
    has a query with no key to attend to, finite in PyTorch and NaN in ONNX Runtime, which the next layer spreads
    to every position (a CLIP text tower's case)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.mha = torch.nn.Embedding(4, 8), torch.nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        x, n = self.emb(input_ids), input_ids.shape[1]
        causal, pad = torch.ones(n, n, dtype=torch.bool).triu(1), attention_mask == 0
        for _ in range(2):
            x = x + self.mha(x, x, x, attn_mask=causal, key_padding_mask=pad, need_weights=False)[0]
        return x


def causal() -> torch.nn.Module:
    return _Causal()


def test_an_attention_mask_from_input_shapes_is_a_valid_one(tmp_path: Path) -> None:
    """--input-shape gives an input named like an attention mask rows of ones then zeros, the first token always
    kept (random 0/1 masked some rows' first token, and parity failed on a good graph); other integers stay 0/1."""
    from kiln.stages.export.input_specs import example_inputs

    shapes = ("input_ids=6:int64", "attention_mask=6:int64", "decoder_attention_mask=6:bool")
    x = example_inputs(parse_input_shapes(shapes), 8)
    for name in ("attention_mask", "decoder_attention_mask"):
        mask = x[name].numpy().astype(int)
        assert (mask[:, 0] == 1).all() and (np.diff(mask, axis=1) <= 0).all() and (mask == 0).any(), mask
    assert set(np.unique(x["input_ids"].numpy())) <= {0, 1}
    summary = export_direct(settings(f"{__name__}:causal"), None, shapes[:2], tmp_path / "m.onnx")
    assert summary["max_abs_err"] < 1e-4
