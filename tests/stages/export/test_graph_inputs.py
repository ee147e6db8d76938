"""What the exported graph does with the data's inputs: labels among them that make the model return its loss (a
scalar) are one error at export; an input the forward takes through ``**kwargs`` and never reads is one warning."""

from __future__ import annotations

import logging
from pathlib import Path

import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import helper
from torch import nn

from kiln.core.errors import ConfigError
from kiln.stages.export.graph_inputs import is_label_name, unread_inputs, unused_inputs
from kiln.stages.export.torch_export import export_onnx


class Classifier(nn.Module):
    """Hugging Face's shape: ``forward(input_ids, labels=None, **kwargs)``, the loss beside the logits when given
    labels (``mean``: a scalar; ``none``: one loss per row), and any other key taken and ignored."""

    def __init__(self, reduction: str = "mean") -> None:
        super().__init__()
        self.embed, self.head, self.reduction = nn.Embedding(20, 8), nn.Linear(8, 3), reduction

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, **kwargs: torch.Tensor) -> dict:
        logits = self.head(self.embed(input_ids).mean(1))
        if labels is None:
            return {"logits": logits}
        if self.reduction == "none":  # one loss per row (by hand: the exporter's per-row cross-entropy fails a check)
            return {"loss": -logits.log_softmax(-1).gather(1, labels[:, None])[:, 0], "logits": logits}
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


def ids(n: int = 2) -> torch.Tensor:
    return torch.randint(0, 20, (n, 5), generator=torch.Generator().manual_seed(0))


def test_labels_among_the_inputs_that_make_a_scalar_loss_are_one_error(tmp_path: Path) -> None:
    """Before: the export passed with a ``labels`` input and a 0-d ``loss`` output, and precision/validation
    failed with a traceback (``zero-dimensional arrays cannot be concatenated``)."""
    x = {"input_ids": ids(), "labels": torch.tensor([0, 2])}
    with pytest.raises(ConfigError) as err:
        export_onnx(Classifier().eval(), x, tmp_path / "m.onnx")
    assert "output 'loss' is a scalar, computed from its input 'labels'" in err.value.message
    assert "keep 'labels' out of the data's inputs (x)" in err.value.hint
    assert "return only per-sample outputs" in err.value.hint


def test_labels_that_make_per_sample_outputs_export(tmp_path: Path) -> None:
    """An input named like labels is no error by itself (a class-conditional model takes one): only an output
    without a batch axis computed from it is."""
    x = {"input_ids": ids(), "labels": torch.tensor([0, 2])}
    proto = export_onnx(Classifier("none").eval(), x, tmp_path / "m.onnx")
    assert [o.name for o in proto.graph.output] == ["loss", "logits"]


class Mean(nn.Module):
    def forward(self, x: torch.Tensor) -> dict:
        return {"logits": x * 2, "mean": x.mean()}


def test_a_scalar_output_not_computed_from_labels_exports(tmp_path: Path) -> None:
    """Kiln serves an output without a batch axis unbatched; it is refused only where it comes from labels."""
    proto = export_onnx(Mean().eval(), torch.rand(2, 3), tmp_path / "m.onnx")
    assert [o.name for o in proto.graph.output] == ["logits", "mean"]


def test_an_input_the_forward_never_reads_is_one_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A forward with ``**kwargs`` takes any key (a BERT tokenizer's ``token_type_ids`` beside a DistilBERT):
    the data's contract check cannot tell, the graph can. Before: nothing said it, and every engine took it."""
    x = {"input_ids": ids(), "token_type_ids": torch.zeros(2, 5, dtype=torch.long)}
    with caplog.at_level(logging.WARNING, logger="kiln.export"):
        proto = export_onnx(Classifier().eval(), x, tmp_path / "m.onnx")
    warned = [r.getMessage() for r in caplog.records if "never reads" in r.getMessage()]
    assert warned == [
        "the model never reads input 'token_type_ids': the exported graph and every engine still take it, so each "
        "client must send it; drop 'token_type_ids' from the data's inputs (the keys of x the data function returns)"
    ]
    assert "token_type_ids" in [i.name for i in proto.graph.input]


def test_inputs_the_forward_reads_give_no_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kiln.export"):
        export_onnx(Classifier().eval(), {"input_ids": ids()}, tmp_path / "m.onnx")
    assert not [r for r in caplog.records if "never reads" in r.getMessage()]


class TwoTower(nn.Module):
    """CLIP's shape: texts and images through towers of their own, ``**kwargs`` taking any other key. Where a
    tower needs the batch size (the class token's expand), the dynamo exporter may read it from any input with the
    batch axis (``insert_deferred_runtime_asserts``): here from the ignored ``token_type_ids``, through a Shape."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.conv, self.cls = nn.Embedding(20, 8), nn.Conv2d(3, 8, 4, 4), nn.Parameter(torch.randn(8))

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, pixel_values: torch.Tensor, **kwargs: torch.Tensor
    ) -> dict:
        text = (self.embed(input_ids) * attention_mask[..., None]).mean(1)
        patches = self.conv(pixel_values).flatten(2).transpose(1, 2)
        image = torch.cat([self.cls.expand(pixel_values.shape[0], 1, -1), patches], 1)[:, 0]
        return {"text": text, "image": image}


def test_an_input_read_only_for_its_shape_is_one_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Before: its only reader, a Shape node, counted as a use, and nothing was said (a CLIPModel given a
    tokenizer's ``token_type_ids``): every engine required an input whose values change nothing."""
    x = {
        "input_ids": ids(),
        "attention_mask": torch.ones(2, 5, dtype=torch.long),
        "pixel_values": torch.rand(2, 3, 8, 8),
        "token_type_ids": torch.zeros(2, 5, dtype=torch.long),
    }
    with caplog.at_level(logging.WARNING, logger="kiln.export"):
        proto = export_onnx(TwoTower().eval(), x, tmp_path / "m.onnx")
    readers = [n.op_type for n in proto.graph.node if "token_type_ids" in n.input]
    assert readers == ["Shape"]  # the case under test: read, but only for its shape
    warned = [r.getMessage() for r in caplog.records if "never reads" in r.getMessage()]
    assert warned == [
        "the model never reads input 'token_type_ids' (only its shape is read): the exported graph and every engine "
        "still take it, so each client must send it; drop 'token_type_ids' from the data's inputs (the keys of x "
        "the data function returns)"
    ]
    assert "token_type_ids" in [i.name for i in proto.graph.input]  # a warning only: the graph keeps it


def _graph(nodes: list[onnx.NodeProto], inputs: list[str], shapes: dict | None = None) -> onnx.GraphProto:
    """A graph of float inputs ``inputs`` (shaped [batch, 3] unless ``shapes`` says otherwise) and one output."""
    info = [
        helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, (shapes or {}).get(n, ["batch", 3])) for n in inputs
    ]
    out = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)
    return helper.make_graph(nodes, "g", info, [out])


def test_inputs_read_for_their_values_or_only_their_shapes() -> None:
    """``a`` is read for its values; ``s`` by Shape and Size only; ``n`` by nothing; ``b`` by a Shape and an Add:
    only ``s`` and ``n`` are unread, and only ``n`` unused (the export's warning tells them apart)."""
    nodes = [
        helper.make_node("Shape", ["s"], ["s_shape"]),
        helper.make_node("Size", ["s"], ["s_size"]),
        helper.make_node("Shape", ["b"], ["b_shape"]),
        helper.make_node("Add", ["a", "b"], ["ab"]),
        helper.make_node("Reshape", ["ab", "s_shape"], ["y"]),
    ]
    graph = _graph(nodes, ["a", "s", "n", "b"])
    assert unread_inputs(graph) == ["s", "n"]
    assert unused_inputs(graph) == ["n"]


def test_an_input_whose_shape_alone_gives_a_size_is_read() -> None:
    """``length`` is read only through a Shape, but its axis ``steps`` is no axis of an input whose values are read:
    its shape is what the graph takes from it (dropping it would lose that size), so it is not called unread."""
    nodes = [helper.make_node("Shape", ["length"], ["steps"]), helper.make_node("Expand", ["a", "steps"], ["y"])]
    graph = _graph(nodes, ["a", "length"], {"length": ["batch", "steps"]})
    assert unread_inputs(graph) == []


def test_an_input_read_only_for_its_shape_inside_a_subgraph_is_unread() -> None:
    """A branch of an If that reads an outer input only through a Shape reads none of its values."""
    then = helper.make_graph(
        [helper.make_node("Shape", ["s"], ["t"])], "then", [], [helper.make_value_info("t", onnx.TypeProto())]
    )
    other = helper.make_graph(
        [helper.make_node("Neg", ["a"], ["e"])], "else", [], [helper.make_value_info("e", onnx.TypeProto())]
    )
    nodes = [
        helper.make_node("ReduceSum", ["a"], ["c"]),
        helper.make_node("Cast", ["c"], ["cond"], to=onnx.TensorProto.BOOL),
        helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other),
    ]
    assert unread_inputs(_graph(nodes, ["a", "s"], {"s": ["batch", 4]})) == ["s"]


@pytest.mark.parametrize(
    "name, label",
    [("labels", True), ("label", True), ("targets", True), ("mc_labels", True), ("input_ids", False), ("y", False)],
)
def test_label_names(name: str, label: bool) -> None:
    assert is_label_name(name) is label


class Forecaster(nn.Module):
    """A time-series forecaster shaped like Hugging Face's PatchTST: ``forward(past_values, **kwargs)`` forecasts 4
    steps of 2 channels, and where given the future (the keyword ``label``) either returns the scalar loss against
    it (``loss``) or reads it as known covariates into every forecast (not ``loss``)."""

    def __init__(self, label: str = "future_values", loss: bool = True) -> None:
        super().__init__()
        self.head, self.label, self.loss = nn.Linear(16, 8), label, loss

    def forward(self, past_values: torch.Tensor, **kwargs: torch.Tensor) -> dict:
        prediction = self.head(past_values.flatten(1)).view(-1, 4, 2)
        future = kwargs.get(self.label)
        if future is None:
            return {"prediction_outputs": prediction}
        if not self.loss:
            return {"prediction_outputs": prediction + future}
        return {"loss": F.mse_loss(prediction, future), "prediction_outputs": prediction}


def series(label: str = "future_values") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"past_values": torch.randn(2, 8, 2, generator=g), label: torch.randn(2, 4, 2, generator=g)}


def test_a_forecasters_future_values_that_make_it_return_its_loss_are_one_error(tmp_path: Path) -> None:
    """``future_values`` is the label argument of Hugging Face's forecasters. Before: the export passed, and every
    engine took the future as an input and answered a scalar ``loss``, served unbatched."""
    with pytest.raises(ConfigError) as err:
        export_onnx(Forecaster().eval(), series(), tmp_path / "m.onnx")
    assert "output 'loss' is a scalar, computed from its input 'future_values'" in err.value.message
    assert "keep 'future_values' out of the data's inputs (x)" in err.value.hint


def test_an_input_only_a_scalar_loss_reads_is_the_labels_whatever_its_name(tmp_path: Path) -> None:
    """A 0-d ``loss`` (Hugging Face's ModelOutput.loss) computed from an input that no per-sample output reads:
    that input is the labels, named like them or not."""
    with pytest.raises(ConfigError) as err:
        export_onnx(Forecaster("horizon").eval(), series("horizon"), tmp_path / "m.onnx")
    assert "output 'loss' is a scalar, computed from its input 'horizon'" in err.value.message
    assert "keep 'horizon' out of the data's inputs (x)" in err.value.hint


def test_future_values_a_forecaster_reads_into_its_forecast_export(tmp_path: Path) -> None:
    """An input named like labels that makes no loss (known future covariates) is an input like any other."""
    proto = export_onnx(Forecaster(loss=False).eval(), series(), tmp_path / "m.onnx")
    assert [i.name for i in proto.graph.input] == ["past_values", "future_values"]


class Regularised(nn.Module):
    """A scalar ``loss`` computed from the one input that the per-sample output reads too: no input is labels."""

    def forward(self, x: torch.Tensor) -> dict:
        return {"y": x * 2, "loss": x.pow(2).mean()}


def test_a_scalar_loss_of_an_input_the_outputs_read_exports(tmp_path: Path) -> None:
    proto = export_onnx(Regularised().eval(), torch.rand(2, 3), tmp_path / "m.onnx")
    assert [o.name for o in proto.graph.output] == ["y", "loss"]


@pytest.mark.slow
def test_hugging_faces_patchtst_given_its_future_values_is_one_error(tmp_path: Path) -> None:
    """The user's case: transformers' PatchTSTForPrediction, with ``future_values`` among the data's inputs."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.PatchTSTConfig(
        num_input_channels=2,
        context_length=16,
        prediction_length=4,
        patch_length=4,
        patch_stride=4,
        d_model=8,
        num_attention_heads=2,
        num_hidden_layers=1,
        ffn_dim=16,
    )
    torch.manual_seed(0)
    model = transformers.PatchTSTForPrediction(cfg).eval()
    x = {"past_values": torch.randn(2, 16, 2), "future_values": torch.randn(2, 4, 2)}
    with pytest.raises(ConfigError) as err:
        export_onnx(model, x, tmp_path / "m.onnx")
    assert "output 'loss' is a scalar, computed from its input 'future_values'" in err.value.message
