"""`kiln validate ENGINE --reference CHECKPOINT` without --inputs, where the reference rejects Kiln's random values:
a layout model looks up each box's width (x1 - x0), and coordinates drawn each on its own make boxes whose
x0 > x1. The error says the inputs were random and asks for real samples, not data made for a larger vocabulary."""

from __future__ import annotations

import io
import warnings
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from torch import nn

from tests.pipeline.test_faults import assert_clean, invoke

HERE = "tests.stages.validate.test_direct_random_values"


class Boxes(nn.Module):
    """Boxes [N, 6, 4] (x0, y0, x1, y1 in 0..15) -> [N, 6, 3]: x0 and the width looked up in tables of 16 rows."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.x_emb, self.w_emb, self.head = nn.Embedding(16, 8), nn.Embedding(16, 8), nn.Linear(8, 3)

    def forward(self, bbox: torch.Tensor) -> torch.Tensor:
        return self.head(self.x_emb(bbox[..., 0]) + self.w_emb(bbox[..., 2] - bbox[..., 0]))


def boxes() -> nn.Module:
    return Boxes()


def _engine(tmp_path: Path) -> tuple[Path, Path]:
    """An ONNX Runtime engine of :class:`Boxes` (exported by torch, as elsewhere) and the model's checkpoint."""
    f = io.BytesIO()
    real = torch.tensor([[[1, 2, 5, 4]] * 6] * 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            Boxes().eval(),
            (real,),
            f,
            dynamo=False,
            input_names=["bbox"],
            output_names=["logits"],
            dynamic_axes={"bbox": {0: "batch"}, "logits": {0: "batch"}},
        )
    (tmp_path / "m.onnx").write_bytes(f.getvalue())
    assert invoke("build", tmp_path / "m.onnx", "-o", tmp_path / "e").exit_code == 0
    save_file(Boxes().state_dict(), str(tmp_path / "w.safetensors"))
    return tmp_path / "e", tmp_path / "w.safetensors"


def test_a_reference_that_rejects_random_values_asks_for_real_samples(tmp_path: Path) -> None:
    engine, weights = _engine(tmp_path)
    model = ("--model", f"{HERE}:boxes")
    result = invoke("validate", engine, "--reference", weights, *model)
    said = "raised IndexError: index out of range in self"
    fix = "fix: pass --inputs FILE.npz with real samples (random values may be ones the model rejects"
    assert_clean(result, 2, said, "while running the reference model on Kiln's RANDOM inputs", fix, "x0 > x1")
    assert "larger vocabulary" not in result.output
    x0 = np.random.default_rng(0).integers(0, 8, (4, 6, 1))
    np.savez(tmp_path / "x.npz", bbox=np.concatenate([x0, x0, x0 + 4, x0 + 2], -1).astype(np.int64))
    given = invoke("validate", engine, "--reference", weights, *model, "--inputs", tmp_path / "x.npz")
    assert given.exit_code == 0, given.output


def test_a_random_feed_torch_rejects_in_a_model_of_kilns_own_is_said_to_be_random(tmp_path: Path) -> None:
    """A model with no frame in the user's file (a zoo model) fails in torch: said as the random feed it met too."""
    from types import SimpleNamespace

    from kiln.stages.validate.checkpoint import OTHER_MODEL, _reference_error

    cfg = SimpleNamespace(model=SimpleNamespace(name="tagger"))  # the settings' one field the message reads
    feed = {"bbox": np.zeros((2, 6, 4), np.int64)}
    err = _reference_error(tmp_path / "w.safetensors", cfg, feed, IndexError("index out of range in self"), True)
    assert "fails on Kiln's RANDOM inputs of the engine's shapes {'bbox': 'int64[2, 6, 4]'}" in err.message
    assert err.hint.startswith("pass --inputs FILE.npz with real samples") and err.hint.endswith(OTHER_MODEL)
