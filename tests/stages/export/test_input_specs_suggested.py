"""The ``--input-shape`` flags ``kiln export -o`` suggests: a ``transformers`` model's main input (and its attention
mask), never a switch, a cache or an alternative input, nor one the model rejected; an image given channels last is
told to be given channels first."""

from __future__ import annotations

from pathlib import Path

import torch
from click.testing import CliRunner
from torch import nn

from kiln.cli import main
from kiln.stages.export.input_specs import input_shape_hint
from tests.core.test_ownership import one_error

HERE = "tests.stages.export.test_input_specs_suggested"
SKIPPED = ("cache", "inputs_embeds", "use_cache", "logits_to_keep", "output_attentions", "return_dict")


class CausalLM(nn.Module):
    """A causal LM as ``transformers`` writes one: every parameter optional, switches and a cache among them."""

    main_input_name = "input_ids"

    def __init__(self) -> None:
        super().__init__()
        self.config = {"vocab_size": 16}
        self.emb, self.head = nn.Embedding(16, 8), nn.Linear(8, 16)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        cache: object = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        return_dict: bool | None = None,
        logits_to_keep: int = 0,
    ) -> torch.Tensor:
        if use_cache:  # a tensor of several values here raises, as transformers' models do
            pass
        return self.head(self.emb(input_ids))


class Plain(nn.Module):
    """Not a ``transformers`` model: every parameter optional, a switch and an alternative among them."""

    def forward(
        self, x: torch.Tensor | None = None, x_embeds: torch.Tensor | None = None, scale: float = 1.0
    ) -> torch.Tensor:
        return x * scale


def causal_lm() -> nn.Module:
    return CausalLM()


class Image(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.conv(pixel_values).mean((2, 3))


def image() -> nn.Module:
    return Image()


def test_a_transformers_model_is_asked_for_its_main_input_and_mask() -> None:
    hint = input_shape_hint(CausalLM())
    assert "--input-shape input_ids=DIMS --input-shape attention_mask=DIMS (e.g." in hint, hint
    for name in (*SKIPPED, "position_ids", "labels"):
        assert f" {name}=" not in hint, name


def test_switches_caches_and_alternatives_are_never_suggested() -> None:
    hint = input_shape_hint(Plain())
    assert "--input-shape x=DIMS (e.g." in hint and "x_embeds" not in hint and "scale" not in hint, hint


def test_a_rejected_switch_is_not_suggested_again(tmp_path: Path) -> None:
    args = ["--input-shape", "input_ids=6:int64", "--input-shape", "use_cache=1"]
    result = CliRunner().invoke(main, ["export", "--model", f"{HERE}:causal_lm", *args, "-o", str(tmp_path / "m.onnx")])
    one_error(result, "rejects the inputs --input-shape gives", "--input-shape input_ids=DIMS (e.g.")
    assert "use_cache=DIMS" not in result.output


def test_an_image_given_channels_last_is_told_to_be_given_channels_first(tmp_path: Path) -> None:
    args = ["export", "--model", f"{HERE}:image", "--input-shape", "16,16,3", "-o", str(tmp_path / "m.onnx")]
    result = CliRunner().invoke(main, args)
    one_error(result, "rejects the inputs --input-shape gives", "looks NHWC", "--input-shape 3,16,16")
