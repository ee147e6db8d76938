from pathlib import Path

import onnx
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from kiln.core.errors import ModelError
from kiln.models.registry import build_model
from kiln.stages.export.parity import parity
from kiln.stages.export.torch_export import export_onnx


@pytest.mark.parametrize(
    "name,x",
    [
        ("cnn", torch.rand(2, 1, 8, 8)),
        ("transformer", torch.rand(2, 1, 8, 8)),
        ("mlp_embed", torch.randint(0, 17, (2, 64))),
    ],
)
def test_export_has_dynamic_batch_and_matches(tmp_path: Path, name: str, x: torch.Tensor) -> None:
    model = build_model(name).eval()
    path = tmp_path / "m.onnx"
    proto = export_onnx(model, x, path)
    dim0 = proto.graph.input[0].type.tensor_type.shape.dim[0]
    assert dim0.dim_param and not dim0.dim_value
    assert proto.graph.value_info, "shape inference results are stored"
    big = torch.cat([x] * 5)  # a batch size never seen at export time
    assert parity(model, path, big)["max_abs_err"] < 1e-4
    onnx.checker.check_model(str(path))


class Unexportable(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.linalg.eigvals(x).real  # no ONNX op computes eigenvalues


def test_unexportable_model_gives_model_error(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="(?s)torch.onnx.export failed.*eigvals"):
        export_onnx(Unexportable(), torch.rand(2, 3, 3), tmp_path / "m.onnx")


def test_static_batch_in_the_pipeline_is_a_config_error(tmp_path: Path) -> None:
    # Before: parity fed 256 samples to a graph fixed at batch 2: an ONNX Runtime INVALID_ARGUMENT traceback.
    from kiln.core.errors import ConfigError
    from kiln.pipeline.api import run_pipeline
    from kiln.pipeline.config import config_from_dict
    from tests.conftest import tiny_config_dict

    cfg = config_from_dict(tiny_config_dict(**{"export.dynamic_batch": False}))
    result, _ = run_pipeline(cfg, tmp_path, stop="export")
    assert isinstance(result.error, ConfigError) and "export.dynamic_batch" in result.error.message
    assert [r.status for r in result.records][0] == "failed"  # the export stage's check, before training


@pytest.mark.parametrize("opset", [13, 17, 18])
def test_the_asked_opset_is_the_one_written(tmp_path: Path, opset: int) -> None:
    """The dynamo exporter silently wrote opset 18 when asked for 13; older opsets go through TorchScript's."""
    model = build_model("cnn").eval()
    proto = export_onnx(model, torch.randn(2, 1, 8, 8), tmp_path / "m.onnx", opset)
    assert max(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")) == opset
    assert parity(model, tmp_path / "m.onnx", torch.randn(3, 1, 8, 8))["max_abs_err"] < 1e-4  # batch 3: dynamic


def test_export_leaves_no_unreferenced_external_data_and_optimize_runs_without_it(tmp_path: Path) -> None:
    # Before: the dynamo exporter's model.onnx.data stayed next to a model that had its weights inline.
    from kiln.stages.optimize.api import optimize_file
    from kiln.stages.optimize.config import OptimizeConfig

    path = tmp_path / "model.onnx"
    export_onnx(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval(), torch.randn(2, 8), path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]
    summary = optimize_file(path, tmp_path / "opt.onnx", OptimizeConfig())
    assert summary["nodes_after"] <= summary["nodes_before"] and not summary["rolled_back"]


class Embedder(nn.Module):
    """An embedding model's outputs named like the exporter's own values (its nn.Embedding's op is `embedding`)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding, self.linear = nn.Embedding(20, 8), nn.Linear(8, 2)

    def forward(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.embedding(input_ids).mean(1)
        return {"embedding": h, "linear": self.linear(h)}


@pytest.mark.parametrize("opset", [18, 17])  # the dynamo exporter, and TorchScript's
def test_outputs_named_like_internal_values_export(tmp_path: Path, opset: int) -> None:
    """Before: the dynamo exporter wrote 'embedding' twice (the Gather's result and the output): the checker's
    'Graph must be in single static assignment (SSA) form' ended the export."""
    model = Embedder().eval()
    ids = torch.randint(0, 20, (2, 5))
    proto = export_onnx(model, ids, tmp_path / "m.onnx", opset)
    assert [o.name for o in proto.graph.output] == ["embedding", "linear"]
    assert parity(model, tmp_path / "m.onnx", torch.randint(0, 20, (3, 5)))["max_abs_err"] < 1e-5
    onnx.checker.check_model(str(tmp_path / "m.onnx"), full_check=True)


class Echo(nn.Module):
    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"input": x * 2}


def test_an_output_named_like_an_input_is_a_model_error(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="named like its inputs"):
        export_onnx(Echo(), torch.rand(2, 3), tmp_path / "m.onnx")


class _Tokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.emb(tokens).mean(1)


def test_dynamic_axes_naming_no_input_says_what_the_inputs_are_called(tmp_path: Path) -> None:
    """A user names the axis after forward's parameter, but data of one tensor is the input 'input': the error says
    so and how to choose the name (a dict); with a dict of data the name is the user's."""
    from kiln.core.errors import ConfigError

    ids = torch.randint(0, 10, (2, 5))
    with pytest.raises(ConfigError, match=r"names \['tokens'\], which are not model inputs \['input'\]") as info:
        export_onnx(_Tokens(), ids, tmp_path / "a.onnx", dynamic_axes={"tokens": {1: "seq"}})
    assert "data of one tensor is the input 'input'" in info.value.hint and "as a dict" in info.value.hint
    model = export_onnx(_Tokens(), {"tokens": ids}, tmp_path / "b.onnx", dynamic_axes={"tokens": {1: "seq"}})
    dims = model.graph.input[0].type.tensor_type.shape.dim
    assert model.graph.input[0].name == "tokens" and dims[1].dim_param == "seq"


class MeanOverLength(nn.Module):
    """A mean over the length axis; ``as_int``: divided by the length as a Python int, which both exporters keep as
    the example's constant; ``fixed``: takes length 16 only."""

    def __init__(self, as_int: bool = False, fixed: bool = False) -> None:
        super().__init__()
        self.proj, self.as_int, self.fixed = nn.Linear(4, 3), as_int, fixed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fixed and x.shape[1] != 16:
            raise ValueError(f"expects length 16, got {x.shape[1]}")
        return self.proj(x).sum(1) / int(x.shape[1]) if self.as_int else self.proj(x).mean(1)


def _sizes_checked(tmp_path: Path, model: nn.Module) -> None:
    from kiln.core.data import DatasetSplits
    from kiln.core.onnx_io import ort_session
    from kiln.stages.export.sizes import check_validated_sizes

    x = torch.randn(12, 16, 4)
    data, axes = DatasetSplits(x[:8], None, x[8:], None), {"input": {1: "seq"}}
    path = tmp_path / "m.onnx"
    export_onnx(model.eval(), x[:2], path, dynamic_axes=axes)
    check_validated_sizes(model, path, ort_session(path), data, ["input"], axes, {}, 1e-4)


def test_sizes_the_later_stages_run_are_checked_at_export(tmp_path: Path) -> None:
    """Validation runs a dynamic axis at half the data's length too: a model that takes one length, or a graph
    whose exporter kept the example's length, is named at export, not deep in calibration or validation."""
    _sizes_checked(tmp_path, MeanOverLength())
    with pytest.raises(ModelError, match=r"does not compute the model at seq=8, where PyTorch runs") as err:
        _sizes_checked(tmp_path, MeanOverLength(as_int=True))
    assert "not Python ints" in (err.value.hint or "")
    with pytest.raises(ModelError, match=r"the model fails at seq=8.*expects length 16, got 8") as err:
        _sizes_checked(tmp_path, MeanOverLength(fixed=True))
    # the model fails at 17 and 32 too, which Kiln makes without cutting: it takes 16 alone, and no sizes to
    # validate at are offered, which would send the export on to fail where the model fixes the length
    hint = err.value.hint or ""
    assert hint.startswith("remove the axis from signature.dynamic_axes (axis 1 of 'input'"), hint
    assert "signature.shapes" not in hint and "cutting" not in hint, hint


class Forecaster(nn.Module):
    """Past values [N, T, 4] and a calendar id per step [N, T]: both follow the time axis."""

    def __init__(self) -> None:
        super().__init__()
        self.day, self.proj = nn.Embedding(7, 4), nn.Linear(4, 3)

    def forward(self, past: torch.Tensor, calendar: torch.Tensor) -> torch.Tensor:
        return self.proj(past + self.day(calendar)).mean(1)


def test_an_input_left_out_of_a_varied_axis_it_follows_is_named_in_the_fix(tmp_path: Path) -> None:
    from kiln.core.data import DatasetSplits
    from kiln.core.onnx_io import ort_session
    from kiln.stages.export.sizes import check_validated_sizes

    x = {"past": torch.randn(12, 16, 4), "calendar": torch.randint(0, 7, (12, 16))}
    take = lambda rows: {k: v[rows] for k, v in x.items()}  # noqa: E731
    data, axes = DatasetSplits(take(slice(0, 8)), None, take(slice(8, 12)), None), {"past": {1: "time"}}
    path, model = tmp_path / "m.onnx", Forecaster().eval()
    export_onnx(model, take(slice(0, 2)), path, dynamic_axes=axes)
    with pytest.raises(ModelError, match=r"the model fails at time=8") as err:
        check_validated_sizes(model, path, ort_session(path), data, ["past", "calendar"], axes, {}, 1e-4)
    assert (err.value.hint or "").startswith(
        "if input 'calendar' (axis 1: 16 in the data, as time) varies with it, declare that too, "
        "signature.dynamic_axes: {calendar: {1: time}}; else"
    )


class MaskedAttention(nn.Module):
    """Attention over a key padding mask: a sample whose keys are all masked is zeros in PyTorch's attention."""

    def __init__(self) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        return self.mha(x, x, x, key_padding_mask=pad, need_weights=False)[0].sum(1)


def test_nan_where_pytorch_is_finite_is_named_with_its_samples(tmp_path: Path) -> None:
    """A NaN error passes every tolerance check (nan > atol is false): the samples it hits are named instead."""
    model, x = MaskedAttention().eval(), {"x": torch.randn(4, 5, 8), "pad": torch.zeros(4, 5, dtype=torch.bool)}
    x["pad"][2] = True  # sample 2: every key masked
    export_onnx(model, x, tmp_path / "m.onnx")
    assert torch.isfinite(model(**x)).all()
    with pytest.raises(ModelError, match=r"answers 1 of 4 samples with NaN or infinity in output 'logits'.*sample 2"):
        parity(model, tmp_path / "m.onnx", x)
    x["pad"][2] = False
    assert parity(model, tmp_path / "m.onnx", x)["max_abs_err"] < 1e-4


class MaskedLogits(nn.Module):
    """Logits with -inf where masked out: the same -inf in PyTorch and in the graph is equal, not a NaN error."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        return y.masked_fill(y < 0, float("-inf"))


def test_a_shared_infinity_is_no_parity_error(tmp_path: Path) -> None:
    model, x = MaskedLogits().eval(), torch.randn(8, 4)
    export_onnx(model, x, tmp_path / "m.onnx")
    assert torch.isinf(model(x)).any()
    assert parity(model, tmp_path / "m.onnx", x)["max_abs_err"] < 1e-5


class _Branchy(nn.Module):
    """A data-dependent branch: torch.export cannot take it, the TorchScript exporter can."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.abs().sum() >= 0:
            return self.lin(x)
        return -self.lin(x)


def test_a_failed_dynamo_attempt_prints_nothing(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """torch.export printed the graph it failed on to stderr, twice, before Kiln's own line about the fallback
    (whose trace of a branch on the inputs' values is then refused: test_traced_branch.py)."""
    with pytest.raises(ModelError, match="decides a branch from its inputs' values"):
        export_onnx(_Branchy().eval(), torch.randn(2, 4), tmp_path / "m.onnx")
    out, err = capfd.readouterr()
    assert "def forward" not in err + out and "GraphModule" not in err + out, err[-2000:]


class _TinyUNet(nn.Module):
    """Pooling, upsampling and a skip connection: an odd height or width cannot meet its skip again."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.down = nn.Conv2d(1, 4, 3, padding=1), nn.Sequential(nn.MaxPool2d(2), nn.Conv2d(4, 4, 1))
        self.up, self.head = nn.Upsample(scale_factor=2), nn.Conv2d(8, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.enc(x)
        return self.head(torch.cat([e, self.up(self.down(e))], dim=1))


def test_the_sizes_a_unet_takes_are_found_in_steps() -> None:
    """Heights and widths of 8 to 16, of which the U-Net takes the even ones: [step 2, offset 0] each."""
    from kiln.core.data import DatasetSplits
    from kiln.stages.export.size_steps import size_steps

    x = torch.rand(4, 1, 16, 16)
    data = DatasetSplits(x, None, x, None)
    axes, shapes = {"input": {2: "height", 3: "width"}}, {"height": [8, 16], "width": [8, 16]}
    assert size_steps(_TinyUNet().eval(), data, ["input"], axes, shapes) == {"height": [2, 0], "width": [2, 0]}
    plain = nn.Sequential(nn.Conv2d(1, 3, 3, padding=1)).eval()
    assert size_steps(plain, data, ["input"], axes, shapes) == {}


class _RoundingFPN(nn.Module):
    """Stride-2 convolutions (which round odd sizes up) and two upsamplings to meet them again: runs at 29-32,
    45-48, 61-64, ... (a run of sizes per period of 16), no progression of one step."""

    def __init__(self) -> None:
        super().__init__()
        self.down = nn.ModuleList([nn.Conv2d(1, 1, 3, 2, 1) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.down[0](x)
        b = self.down[1](a)
        c = self.down[2](b)
        d = self.down[3](c)
        return b + F.interpolate(c + F.interpolate(d, scale_factor=2.0), scale_factor=2.0)


def test_sizes_that_run_in_runs_are_recorded_as_remainders_of_their_period() -> None:
    """The data's 64 runs, 36 does not: the pattern is [16, 0, 13, 14, 15], which takes 64 and 45 and refuses 38.
    Before: the first size after 32 that ran (45) was taken as a step of 13, which refused 64, the data's own."""
    from kiln.core.data import DatasetSplits
    from kiln.core.records import takes_size
    from kiln.stages.export.size_steps import size_steps

    x = torch.rand(2, 1, 64, 64)
    model = _RoundingFPN().eval()
    found = size_steps(model, DatasetSplits(x, None, x, None), ["input"], {"input": {2: "h"}}, {})
    assert found == {"h": [16, 0, 13, 14, 15]}
    for h in range(32, 65):
        try:
            model(torch.rand(1, 1, h, 32))
            ran = True
        except RuntimeError:
            ran = False
        assert takes_size(found["h"], h) == ran, h


def test_a_range_with_no_period_is_recorded_size_by_size_and_a_model_that_runs_everywhere_not_at_all() -> None:
    from kiln.core.records import takes_size
    from kiln.stages.export.size_steps import size_pattern

    odd = {10, 11, 13, 17, 18}  # no period fits: the range, probed whole, is its own period
    pattern = size_pattern(lambda size: size in odd, 10, 18)
    assert pattern is not None and [s for s in range(10, 19) if takes_size(pattern, s)] == sorted(odd)
    tried: list[int] = []
    assert size_pattern(lambda size: tried.append(size) or True, 1, 512) is None
    assert len(tried) <= 11  # a few sizes, not the range


class NoLoss(nn.Module):
    """Research code's forward without targets: ``(logits, None)``; ``aux_from``: a second output that is a tensor
    from that batch size on and None below it."""

    def __init__(self, aux_from: int | None = None) -> None:
        super().__init__()
        self.proj, self.aux_from = nn.Linear(4, 3), aux_from

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits = self.proj(x)
        aux = logits.sum(1) if self.aux_from is not None and x.shape[0] >= self.aux_from else None
        return logits, aux


def test_a_none_output_is_left_out_of_the_export_and_the_reference(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: 'returns output 'output_1' as NoneType, not a tensor'. The None is left out (said in one info line),
    the logits keep their name, and the graph and PyTorch's outputs pair up at another batch."""
    from kiln.stages.export.parity import batch_parity

    model, x = NoLoss().eval(), torch.randn(8, 4)
    with caplog.at_level("INFO", logger="kiln.export"):
        proto = export_onnx(model, x[:2], tmp_path / "m.onnx")
    assert [o.name for o in proto.graph.output] == ["output_0"]
    assert [r.getMessage() for r in caplog.records if "left out" in r.getMessage()] == [
        "left out output ['output_1']: the model returns None there (an ONNX graph has no None outputs)"
    ]
    check = batch_parity(model, tmp_path / "m.onnx", x[:2], x, 1e-4)
    assert list(check["per_output"]) == ["output_0"] and check["max_abs_err"] < 1e-5


def test_an_output_that_is_none_on_some_calls_only_is_a_model_error(tmp_path: Path) -> None:
    """None at the export's example (batch 2) and a tensor at batch 8: the graph cannot have it both ways."""
    from kiln.stages.export.parity import batch_parity

    model, x = NoLoss(aux_from=4).eval(), torch.randn(8, 4)
    export_onnx(model, x[:2], tmp_path / "m.onnx")
    with pytest.raises(ModelError, match=r"returns output 'output_1' a tensor at batch 8, but not on the example"):
        batch_parity(model, tmp_path / "m.onnx", x[:2], x, 1e-4)


class PerImage(nn.Module):
    """torchvision's detector contract: a list with one {boxes, scores, labels} dict per image of the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        out = self.proj(x)
        return [{"boxes": row[:4].reshape(1, 4), "scores": row[4:], "labels": row[4:].long()} for row in out]


def test_a_list_of_outputs_whose_length_follows_the_batch_is_named_as_such(tmp_path: Path) -> None:
    """The graph traced at batch 2 has two dicts of outputs, PyTorch at batch 8 eight: said as a list whose length
    follows the batch, not as outputs that are None on some calls."""
    from kiln.stages.export.parity import batch_parity

    model, x = PerImage().eval(), torch.randn(8, 4)
    export_onnx(model, x[:2], tmp_path / "m.onnx")
    with pytest.raises(ModelError) as info:
        batch_parity(model, tmp_path / "m.onnx", x[:2], x, 1e-4)
    assert info.value.message == (
        "the model returns a list of outputs whose length follows the batch (output_<i>: 8 items at batch 8, 2 on the "
        "example the graph was exported with), which is not supported: a graph has a fixed number of outputs"
    )
    assert "boxes [K, 4], scores [K], labels [K] and an image index [K]" in info.value.hint


class MaskedIds(nn.Module):
    """Token ids and their mask, cut to the mask's length as a Python int: the exporter keeps the example's length,
    and PyTorch runs ids and a mask of other lengths."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, 4)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        n = int(attention_mask.shape[1])
        return (self.emb(input_ids)[:, :n] * attention_mask[..., None]).sum(1)


def test_two_names_for_axes_the_data_gives_at_one_size_are_told_to_be_one_name(tmp_path: Path) -> None:
    """``{input_ids: {1: seq}, attention_mask: {1: len}}``, both 16 in every row of the data: the graph fails where
    they differ, and the fix says to give them one name before blaming the model's code."""
    from kiln.core.data import DatasetSplits
    from kiln.core.onnx_io import ort_session
    from kiln.stages.export.sizes import check_validated_sizes

    x = {"input_ids": torch.randint(0, 5, (12, 16)), "attention_mask": torch.ones(12, 16, dtype=torch.int64)}
    take = lambda rows: {k: v[rows] for k, v in x.items()}  # noqa: E731
    data = DatasetSplits(take(slice(0, 8)), None, take(slice(8, 12)), None)
    axes = {"input_ids": {1: "seq"}, "attention_mask": {1: "len"}}
    path, model = tmp_path / "m.onnx", MaskedIds().eval()
    export_onnx(model, take(slice(0, 2)), path, dynamic_axes=axes)
    with pytest.raises(ModelError, match=r"does not compute the model at .*where PyTorch runs") as err:
        check_validated_sizes(model, path, ort_session(path), data, list(x), axes, {}, 1e-4)
    assert (err.value.hint or "").startswith(
        "axes seq and len have one size in every row of the data (16): if they must be equal, give them one name, "
        "signature.dynamic_axes: {input_ids: {1: seq}, attention_mask: {1: seq}}; else keep sizes in forward"
    ), err.value.hint


class _Casts(nn.Module):
    """Casts its input to its weights' dtype, as Hugging Face's vision models do: float64 data runs."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, pixels: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.fc(pixels.to(self.fc.weight.dtype)) + ids[:, :1]


def test_float64_inputs_of_a_float32_model_are_said(caplog: pytest.LogCaptureFixture) -> None:
    from kiln.stages.export.model_checks import warn_wide_inputs

    x = {"pixels": torch.randn(2, 3, dtype=torch.float64), "ids": torch.zeros(2, 4, dtype=torch.long)}
    with caplog.at_level("WARNING", logger="kiln"):
        warn_wide_inputs(_Casts(), x)
        warn_wide_inputs(_Casts(), {**x, "pixels": x["pixels"].float()})  # float32: nothing to say
        warn_wide_inputs(_Casts().double(), x)  # a float64 model takes float64
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "inputs ['pixels'] are float64" in said[0] and "x.float()" in said[0], said


class _Positives(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2, torch.nonzero(x > 0)


def test_outputs_whose_length_the_values_decide_are_compared_in_an_order_of_their_values(tmp_path: Path) -> None:
    """An output whose axis 0 no input has (torch.nonzero's, NMS's detections) is told apart by parity, which
    compares it in one order of its values (runtimes order tied scores apart) and names it where parity fails."""
    x = torch.randn(4, 3)
    export_onnx(_Positives(), x, tmp_path / "m.onnx", 18, True)
    check = parity(_Positives(), tmp_path / "m.onnx", x)
    assert check["max_abs_err"] == 0.0 and len(check["by_value"]) == 1, check


class OneLengthEigen(nn.Module):
    """Takes one length (its own shape check, as Whisper's on its mel frames) and computes what no exporter writes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] != 4:
            raise ValueError(f"expects 4 frames, got {x.shape[1]}")
        return torch.linalg.eigvals(x).real


def test_a_model_that_takes_one_size_is_named_when_both_exporters_fail(tmp_path: Path) -> None:
    """Both exporters fail on the op; PyTorch itself refuses the other validated size: that is what is said, with
    the fix for an axis the model does not let vary, not the exporters' "an op ONNX cannot express"."""
    from kiln.core.data import DatasetSplits
    from kiln.stages.export.sizes import export_at_sizes

    x = torch.randn(12, 4, 4)
    data, axes = DatasetSplits(x[:8], None, x[8:], None), {"input": {1: "frames"}}
    with pytest.raises(ModelError, match=r"the model fails at frames=2.*expects 4 frames, got 2") as err:
        export_at_sizes(OneLengthEigen().eval(), x[:2], tmp_path / "m.onnx", 18, data, axes, {})
    assert "remove the axis from signature.dynamic_axes" in (err.value.hint or "")
    with pytest.raises(ModelError, match="torch.onnx.export failed"):  # no axis varies: the exporters' error
        export_at_sizes(OneLengthEigen().eval(), x[:2], tmp_path / "m.onnx", 18, data, None, {})
