"""The fix ``kiln export -o`` gives for inputs it cannot make or the model rejects: the ``--input-shape`` flags it
suggests are the inputs given and the forward's required ones, never its optional alternatives or its labels; for
random values the model rejects, the way to give real samples (``--set data.name``)."""

from __future__ import annotations

from pathlib import Path

import torch
from click.testing import CliRunner
from torch import nn

from kiln.cli import main
from kiln.core.data import DatasetSplits
from kiln.stages.export.input_specs import input_shape_hint
from tests.core.test_ownership import one_error

HERE = "tests.stages.export.test_input_specs"
SHAPES = (
    "--input-shape",
    "input_ids=6:int64",
    "--input-shape",
    "bbox=6,4:int64",
    "--input-shape",
    "attention_mask=6:int64",
)


class Boxes(nn.Module):
    """A layout tagger as ``transformers`` writes one: every parameter optional, ``inputs_embeds`` an alternative to
    ``input_ids``, ``labels`` for the loss; each box's width (x1 - x0) looked up in a table, so a box whose x0 > x1
    (random 0s and 1s make some) is an IndexError."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.w_emb, self.head = nn.Embedding(16, 8), nn.Embedding(16, 8), nn.Linear(8, 3)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        bbox: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = self.emb(input_ids) if inputs_embeds is None else inputs_embeds
        return self.head(h + self.w_emb(bbox[..., 2] - bbox[..., 0]))


def boxes() -> nn.Module:
    return Boxes()


def boxes_data() -> DatasetSplits:
    """Real samples: boxes with x1 > x0."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 16, (8, 6), generator=g)
    x0 = torch.randint(0, 8, (8, 6), generator=g)
    x = {"input_ids": ids, "bbox": torch.stack([x0, x0, x0 + 4, x0 + 2], -1), "attention_mask": torch.ones_like(ids)}
    y = ids % 3
    return DatasetSplits(x, y, x, y, num_classes=3)


class Masked(nn.Module):
    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, labels: torch.Tensor | None = None):
        return x if mask is None else x * mask


def test_random_values_the_model_rejects_ask_for_real_samples_not_for_every_parameter(tmp_path: Path) -> None:
    """The inputs given are all a forward of optional parameters needs: the fix suggests no ``position_ids``,
    ``inputs_embeds`` (given with ``input_ids``, the model refuses both) or ``labels`` (refused as an input), and
    names the way to real samples, which then export."""
    out = tmp_path / "m.onnx"
    result = CliRunner().invoke(main, ["export", "--model", f"{HERE}:boxes", *SHAPES, "-o", str(out)])
    flags = "--input-shape input_ids=DIMS --input-shape bbox=DIMS --input-shape attention_mask=DIMS (e.g."
    one_error(result, "rejects the inputs --input-shape gives", "a box whose x0 > x1", "--set data.name=", flags)
    for other in ("position_ids", "inputs_embeds", "labels"):
        assert other not in result.output
    real = CliRunner().invoke(
        main, ["export", "--model", f"{HERE}:boxes", "--set", f"data.name={HERE}:boxes_data", "-o", str(out)]
    )
    assert real.exit_code == 0 and out.is_file(), real.output


def test_the_suggested_inputs_are_the_given_and_the_required_ones() -> None:
    """None given: the required ones only; a required one missing: added to those given; an unnamed shape: the
    forward's first parameter. Never the optional ``mask`` beside them, never ``labels``."""
    hint = input_shape_hint(Masked())
    assert "--input-shape x=DIMS (e.g." in hint and "mask" not in hint and "labels" not in hint
    hint = input_shape_hint(Masked(), random=True, given=["mask"])
    assert "--input-shape mask=DIMS --input-shape x=DIMS (e.g." in hint and "labels" not in hint
    hint = input_shape_hint(Masked(), random=True, given=["input"])
    assert "--input-shape x=DIMS (e.g." in hint and "mask" not in hint


class Lookup(nn.Module):
    """A numeric input beside a categorical id of one value per sample (a recommender's)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.fc = nn.Embedding(7, 4), nn.Linear(10, 1)

    def forward(self, num: torch.Tensor, site: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([num, self.emb(site)], dim=1))


def lookup() -> nn.Module:
    return Lookup()


def test_float_ids_given_to_an_embedding_are_told_to_be_int64(tmp_path: Path) -> None:
    """``--input-shape site=()`` makes float values, which an embedding refuses: the fix names site as ids, with
    its flag in int64, not "the values may be wrong"."""
    args = ["export", "--model", f"{HERE}:lookup", "--input-shape", "num=6", "--input-shape", "site=()"]
    result = CliRunner().invoke(main, [*args, "-o", str(tmp_path / "m.onnx")])
    one_error(result, "rejects the inputs --input-shape gives", "site is ids the model looks up", "site=():int64")
    assert "num=6:int64" not in result.output


def test_a_random_padding_mask_marks_padding_with_true() -> None:
    """``--input-shape padding_mask=6:bool``: PyTorch's padding mask (True marks padding) gets the inverse of a valid
    attention mask, each row's first token real; the attention mask's ones would make row 0 all padding."""
    from kiln.core.records import TensorSpec
    from kiln.stages.export.input_specs import example_inputs

    specs = [
        TensorSpec(name=n, shape=["batch", 6], dtype=d)
        for n, d in [("padding_mask", "bool"), ("attention_mask", "int64")]
    ]
    x = example_inputs(specs, 4)
    assert not x["padding_mask"][:, 0].any() and x["padding_mask"][1:, -1].all()
    assert torch.equal(x["padding_mask"], x["attention_mask"] == 0)
