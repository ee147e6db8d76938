"""The export's warning for a row whose padding mask is all padding: NaN from the exported graph where PyTorch's
attention is finite."""

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from kiln.stages.export import parity
from kiln.stages.export.parity import batch_parity, empty_mask_row, exported_session, require_parity, warn_empty_masks
from kiln.stages.export.torch_export import export_onnx


class Encoder(nn.Module):
    """A sequence classifier taking PyTorch's padding mask (True marks padding); ``guard`` unmasks the first
    position of an empty row."""

    def __init__(self, guard: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.guard = guard
        self.emb = nn.Embedding(10, 8)
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(8, 3)

    def forward(self, tokens: torch.Tensor, padding_mask: torch.Tensor) -> torch.Tensor:
        if self.guard:
            empty = padding_mask.all(1, keepdim=True)
            first = torch.arange(padding_mask.shape[1]) == 0
            padding_mask = padding_mask & ~(empty & first)
        h = self.enc(self.emb(tokens), src_key_padding_mask=padding_mask)
        keep = (~padding_mask).unsqueeze(-1).to(h.dtype)
        return self.head((h * keep).sum(1) / keep.sum(1).clamp(min=1.0))


def _inputs() -> dict[str, torch.Tensor]:
    tokens = torch.randint(1, 10, (4, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.arange(6)[None, :] >= torch.tensor([6, 5, 4, 3])[:, None]
    return {"tokens": tokens, "padding_mask": mask}


@pytest.mark.parametrize("guard", [False, True])
def test_an_all_padding_row_that_is_nan_in_the_graph_is_warned_of(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, guard: bool
) -> None:
    model, x = Encoder(guard).eval(), _inputs()
    path = tmp_path / "m.onnx"
    export_onnx(model, {k: v[:2] for k, v in x.items()}, path)
    session = exported_session(path)
    with caplog.at_level("WARNING", logger="kiln.export"):
        check = batch_parity(model, path, {k: v[:2] for k, v in x.items()}, x, 1e-4, session, 1e-4)
        require_parity(check, 1e-4, 1e-4, "m.onnx")
        warn_empty_masks(model, session, x)
    said = [r.getMessage() for r in caplog.records if "all padding" in r.getMessage()]
    if guard:
        assert said == []
    else:
        assert len(said) == 1 and "input 'padding_mask'" in said[0] and "output 'logits'" in said[0]
        assert "fix: guard the all-padding case in forward" in said[0]


def test_the_parity_check_itself_runs_no_probe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe runs once the export accepts the check (require_parity), not within a check it may yet refuse."""
    model, x = Encoder().eval(), _inputs()
    path = tmp_path / "m.onnx"
    export_onnx(model, {k: v[:2] for k, v in x.items()}, path)
    probed: list[object] = []
    monkeypatch.setattr(parity, "warn_empty_masks", lambda *args: probed.append(args))
    batch_parity(model, path, {k: v[:2] for k, v in x.items()}, x, 1e-4, rtol=1e-4)
    assert probed == []


def test_the_empty_row_pads_every_mask_by_its_convention() -> None:
    feed = {
        "ids": np.ones((3, 4), np.int64),
        "attention_mask": np.ones((3, 4), np.int64),
        "key_padding_mask": np.zeros((3, 4), np.uint8),
        "flags": np.zeros((3, 4), bool),
    }
    row, masks = empty_mask_row(feed)
    assert masks == ["attention_mask", "key_padding_mask", "flags"]
    assert row["ids"].shape == (1, 4) and (row["ids"] == 1).all()
    assert (row["attention_mask"] == 0).all() and (row["key_padding_mask"] == 1).all() and row["flags"].all()
