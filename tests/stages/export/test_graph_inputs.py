"""What the exported graph does with the data's inputs: labels among them that make the model return its loss (a
scalar) are one error at export; an input the forward takes through ``**kwargs`` and never reads is one warning."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kiln.core.errors import ConfigError
from kiln.stages.export.graph_inputs import is_label_name
from kiln.stages.export.stage import export_onnx


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


@pytest.mark.parametrize(
    "name, label",
    [("labels", True), ("label", True), ("targets", True), ("mc_labels", True), ("input_ids", False), ("y", False)],
)
def test_label_names(name: str, label: bool) -> None:
    assert is_label_name(name) is label
