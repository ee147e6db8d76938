"""Integer labels per position beside the user's train.loss: accuracy over labelled positions, and labels that do
not follow the logits' positions (CTC targets) left to the loss, with no accuracy."""

from __future__ import annotations

import logging

import pytest
import torch

from kiln.core.data import DatasetSplits
from kiln.core.errors import ModelError
from kiln.stages.train.config import TrainConfig
from kiln.stages.train.loop import evaluate_loss_acc, train
from kiln.stages.train.task import Task, check_task

CFG = TrainConfig(epochs=2, batch_size=16, device="cpu", plot=False, precision="fp32")


class Tagger(torch.nn.Module):
    """A tag per token: [N, S] ids -> [N, S, 3] logits."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = torch.nn.Embedding(16, 8), torch.nn.Linear(8, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(ids)))


def _tagged(size: int = 40, length: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and their tags (id mod 3), each row's tail tagged -100 (padding)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 16, (size, length), generator=g)
    pad = torch.arange(length)[None, :] >= torch.randint(2, length + 1, (size, 1), generator=g)
    return x, torch.where(pad, -100, x % 3)


def _token_ce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten(), ignore_index=-100)


def test_a_user_loss_on_token_labels_scores_accuracy_over_labelled_positions() -> None:
    """The accuracy divided the correct labelled positions by the rows (1.76 for 8 labels a row), and ranked the
    epochs by it: it is the built-in loss's, over labelled positions, whichever loss trains."""
    x, y = _tagged()
    model = Tagger().eval()
    keep = y != -100
    want = (model(x).argmax(-1)[keep] == y[keep]).float().mean().item()
    cpu = torch.device("cpu")
    builtin = evaluate_loss_acc(model, x, y, cpu, batch=16, task=Task("classification"))
    user = evaluate_loss_acc(model, x, y, cpu, batch=16, task=Task("classification", None, _token_ce))
    assert builtin[1] == pytest.approx(want) and user[1] == pytest.approx(want)


class Frames(torch.nn.Module):
    """CTC-style: [N, T, 4] features -> [N, T, 5] log-probs, blank 0."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(4, 5)

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        return self.fc(feats).log_softmax(-1)


def _ctc(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """CTC on [N, T, C] log-probs and [N, S] token ids padded with -100."""
    lens = (y != -100).sum(1)
    frames = torch.full((len(y),), out.shape[1], dtype=torch.long)
    return torch.nn.functional.ctc_loss(out.transpose(0, 1), y.clamp(min=0), frames, lens, zero_infinity=True)


def _ctc_data(size: int = 32) -> DatasetSplits:
    """[N, 12, 4] frames and [N, 5] token ids (1..4), each row's tail padded with -100."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(size, 12, 4, generator=g)
    y = torch.randint(1, 5, (size, 5), generator=g)
    y[torch.arange(5)[None, :] >= torch.randint(2, 6, (size, 1), generator=g)] = -100
    n = size * 3 // 4
    return DatasetSplits(x[:n], y[:n], x[n:], y[n:], num_classes=5)


def test_ctc_targets_with_a_user_loss_train_without_accuracy(caplog: pytest.LogCaptureFixture) -> None:
    """Token ids [N, S] beside log-probs [N, T, C] were refused before training as logits of the wrong shape,
    though the user's CTC loss takes them: the loss reads them, and training scores no accuracy (said once)."""
    data, model = _ctc_data(), Frames()
    task = Task("classification", None, _ctc)
    out = model(data.train_x[:2])
    with pytest.raises(ModelError, match=r"class logits of shape \(2, 12, 5\) for labels of shape \(2, 5\)"):
        check_task(Task("classification"), out, data.train_y[:2], 5, "m")  # the built-in loss cannot take them
    with caplog.at_level(logging.INFO, logger="kiln.train"):
        check_task(task, out, data.train_y[:2], 5, "m")
    said = [r.getMessage() for r in caplog.records if "do not follow the positions" in r.getMessage()]
    assert len(said) == 1 and "_ctc" in said[0] and "no accuracy" in said[0], said
    assert task.correct(out, data.train_y[:2]) is None
    result = train(model, data, CFG, task=task)
    assert all(m.val_accuracy is None and m.val_loss is not None for m in result.history)
