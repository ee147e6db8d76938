"""A model's named outputs, computed as the graph an exporter or compiler traces computes them."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import torch
from torch import nn

from kiln.core.errors import ConfigError, ModelError
from kiln.core.outputs import flatten_outputs, logits_flag, logits_name, named_outputs


class _Tagger(nn.Module):
    """torch's own TransformerEncoder with a key padding mask: in eval mode its fast path runs nested tensors."""

    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, dropout=0.0)
        self.enc = nn.TransformerEncoder(layer, 1)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        return self.enc(x, src_key_padding_mask=pad)


def _inputs() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    pad = torch.zeros(4, 6, dtype=torch.bool)
    pad[1:, 4:] = True
    return {"x": torch.randn(4, 6, 16), "pad": pad}


@pytest.mark.slow  # an export of the encoder (its dynamo attempt, then TorchScript)
def test_padded_positions_are_computed_as_an_exported_graph_computes_them(tmp_path: Path) -> None:
    from kiln.core.onnx_io import ort_run, ort_session
    from kiln.stages.export.torch_export import export_onnx

    torch.manual_seed(0)
    model, x = _Tagger().eval(), _inputs()
    with torch.inference_mode():
        fast = model(**x)  # the fast path: zeros where the mask pads
    assert torch.backends.mha.get_fastpath_enabled()
    assert float(fast[1:, 4:].abs().max()) == 0.0
    with torch.inference_mode():  # as validation takes its reference
        got = named_outputs(model, x)["logits"]
    assert torch.backends.mha.get_fastpath_enabled()  # restored after the call
    assert float(got[1:, 4:].abs().max()) > 0.1  # computed, as every engine computes them
    torch.testing.assert_close(got[~x["pad"]], fast[~x["pad"]], atol=1e-5, rtol=1e-5)  # the rest agrees
    export_onnx(model, x, tmp_path / "m.onnx")
    exported = ort_run(ort_session(tmp_path / "m.onnx"), {k: v.numpy() for k, v in x.items()})[0]
    torch.testing.assert_close(torch.from_numpy(exported), got, atol=1e-4, rtol=1e-4)


def test_none_outputs_are_left_out_and_the_others_keep_their_names() -> None:
    """nanoGPT's forward without targets returns ``(logits, None)``: the None is left out, as torch.onnx.export
    leaves it out, and the logits stay ``output_0`` (as in the graph), wherever in the structure the None is."""
    a, b = torch.zeros(2, 3), torch.ones(2, 1)
    left_out: list[str] = []
    assert list(flatten_outputs((a, None), left_out=left_out)) == ["output_0"] and left_out == ["output_1"]
    left_out.clear()
    assert list(flatten_outputs((None, (b, None), {"loss": None, "y": a}), left_out=left_out)) == [
        "output_1.0",
        "output_2.y",
    ]
    assert left_out == ["output_0", "output_1.1", "output_2.loss"]
    assert list(flatten_outputs({"logits": a, "loss": None})) == ["logits"]
    with pytest.raises(ModelError, match="returns no tensor"):
        flatten_outputs((None, None))
    with pytest.raises(ModelError, match="returns output 'output_1' as str, not a tensor"):
        flatten_outputs((a, "loss"))


def test_a_namedtuple_output_is_named_by_its_fields() -> None:
    """A NamedTuple's fields name its outputs, as a dict's keys do (they were output_0, output_1, and
    signature.logits_output: logits was refused)."""
    from typing import NamedTuple

    class Out(NamedTuple):
        logits: torch.Tensor
        feats: torch.Tensor

    x = torch.zeros(2, 3)
    assert list(flatten_outputs(Out(x, x))) == ["logits", "feats"]
    assert list(flatten_outputs({"head": Out(x, x)})) == ["head.logits", "head.feats"]
    assert list(flatten_outputs((x, x))) == ["output_0", "output_1"]  # a plain tuple as before


def test_a_number_that_is_an_outputs_name_names_that_output() -> None:
    """The TorchScript exporter names outputs ``1`` and ``0``: ``signature.logits_output=0`` (a number, as YAML and
    --set read it) took the output at index 0, the one named ``1``."""
    assert logits_name(["1", "0"], 0) == "0" and logits_name(["1", "0"], "1") == "1"
    assert logits_name(["18"], 18) == "18"
    assert logits_name(["hidden", "logits"], 1) == "logits" and logits_name(["a", "b"], -1) == "b"
    with pytest.raises(ConfigError, match="out of range") as err:
        logits_name(["a", "b"], 2)
    assert "--set signature.logits_output=a" in err.value.hint


@pytest.mark.parametrize("name", ["18", "0", "logits", "true", "null", "1.5", "a b", "it's", "output:0", "[x]"])
def test_the_suggested_flag_names_the_output_through_the_clis_set_parser(name: str) -> None:
    """A warning suggested ``signature.logits_output=18``, which --set read as the index 18 (out of range)."""
    from kiln.pipeline.config import config_from_dict, set_value
    from tests.conftest import tiny_config_dict

    flag = logits_flag(name)
    option, given = shlex.split(flag)
    key, _, text = given.partition("=")
    assert option == "--set" and key == "signature.logits_output"
    setting = config_from_dict(tiny_config_dict(signature={"logits_output": set_value(key, text)})).signature
    names = ["other", name]
    assert logits_name(names, setting.logits_output) == name
