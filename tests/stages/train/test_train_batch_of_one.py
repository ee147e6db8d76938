"""A model of one sample a call (a graph given as a batch of one, docs/byom.md) with several held-out graphs: the
train stage calls it with no more rows than training does, and a model that answers fewer rows than it was given
is one error naming the rows, not a loss's shape error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from kiln.core.data import DatasetSplits
from kiln.core.errors import ModelError
from kiln.pipeline.config import config_from_dict
from kiln.pipeline.runner import Runner
from kiln.pipeline.stage_list import STAGES
from kiln.stages.train.loop import evaluate_loss_acc, train
from tests.conftest import tiny_config_dict
from tests.stages.train.train_helpers import train_cfg

NODES, EDGES, FEATURES, CLASSES = 12, 30, 4, 3


class BatchOfOneGCN(nn.Module):
    """One message-passing layer over ``edge_index`` (``index_add_``), in byom.md's layout: x [1, nodes, F] and
    edge_index [1, 2, edges] in, per-node class logits [1, nodes, C] out; it reads row 0 of its inputs only."""

    def __init__(self, features: int = FEATURES, classes: int = CLASSES) -> None:
        super().__init__()
        self.lin = nn.Linear(features, classes)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        h, (src, dst) = self.lin(x[0]), edge_index[0]
        return h.index_add(0, dst, h[src]).unsqueeze(0)


def graphs(num: int, seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``num`` graphs of the same size, stacked on axis 0, with a class per node that its features give away."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num, NODES, FEATURES, generator=g)
    edge_index = torch.randint(0, NODES, (num, 2, EDGES), generator=g)
    return {"x": x, "edge_index": edge_index}, x[..., :CLASSES].argmax(-1)


def graph_data(train_graphs: int = 4, val_graphs: int = 6) -> DatasetSplits:
    (tx, ty), (vx, vy) = graphs(train_graphs, 0), graphs(val_graphs, 1)
    return DatasetSplits(tx, ty, vx, vy, num_classes=CLASSES)


def test_several_validation_graphs_are_evaluated_one_a_call() -> None:
    """Evaluation took 256 rows a call whatever training took: the model answered one graph for six and the loss
    raised a shape error. At train.batch_size 1 each held-out graph is evaluated on its own."""
    torch.manual_seed(0)
    model, data = BatchOfOneGCN(), graph_data()
    result = train(model, data, train_cfg(epochs=1, batch_size=1))
    loss, acc = evaluate_loss_acc(model, data.val_x, data.val_y, torch.device("cpu"), batch=1)
    assert result.history[-1].val_loss == pytest.approx(loss)
    assert result.history[-1].val_accuracy == pytest.approx(acc)


@pytest.mark.parametrize("enabled", [True, False])
def test_the_stage_takes_several_validation_graphs(tmp_path: Path, enabled: bool) -> None:
    """The stage's run as the user's config gives it, training or not (the untrained model's evaluation too)."""
    over = {"model.name": f"{__name__}:BatchOfOneGCN", "model.params": {}, "data.name": f"{__name__}:graph_data"}
    over |= {"train.batch_size": 1, "train.epochs": 1, "train.enabled": enabled, "signature.batch_sizes": [1]}
    result = Runner(config_from_dict(tiny_config_dict(**over)), tmp_path / "wd", STAGES).run(stop="train")
    assert result.ok, result.error
    assert result.records[0].summary.val_accuracy is not None


def regression_targets(y: torch.Tensor) -> torch.Tensor:
    """Float targets shaped like the logits: what mean squared error reads (it broadcast one row over many)."""
    return nn.functional.one_hot(y, CLASSES).float()


@pytest.mark.parametrize("targets", ["classes", "floats"])
def test_a_model_that_answers_fewer_rows_than_given_is_one_error(targets: str) -> None:
    """Four graphs in, one answered: the error names the rows in and out and the batch-of-one settings."""
    data = graph_data()
    y = data.val_y[:4] if targets == "classes" else regression_targets(data.val_y[:4])
    x = {k: v[:4] for k, v in data.val_x.items()}
    with pytest.raises(ModelError) as caught:
        evaluate_loss_acc(BatchOfOneGCN(), x, y, torch.device("cpu"), batch=4)
    assert "returns 1 row of output (1, 12, 3) for 4 input rows" in caught.value.message
    assert "signature.batch_sizes: [1] and train.batch_size: 1" in (caught.value.hint or "")


def test_a_batch_size_the_model_cannot_take_is_refused_before_training(tmp_path: Path) -> None:
    """train.batch_size 4 for a batch-of-one model: the check on two samples names the rows, not the logits' shape."""
    over = {"model.name": f"{__name__}:BatchOfOneGCN", "model.params": {}, "data.name": f"{__name__}:graph_data"}
    over |= {"train.batch_size": 4, "train.epochs": 1, "signature.batch_sizes": [1]}
    result = Runner(config_from_dict(tiny_config_dict(**over)), tmp_path / "wd", STAGES).run(stop="train")
    assert not result.ok and isinstance(result.error, ModelError)
    assert "returns 1 row of output (1, 12, 3) for 2 input rows" in result.error.message


def test_more_rows_than_given_are_not_said_to_be_a_batch_of_one() -> None:
    """A token classifier that flattens its logits to [N * seq, C]: the per-position check's fix, not batch-of-one's
    (such a model can only return fewer rows than it was given)."""
    from kiln.stages.train.task import Task, check_task

    with pytest.raises(ModelError) as caught:
        check_task(Task("classification"), torch.randn(14, 5), torch.randint(0, 5, (2, 7)), 5, "m:flat")
    assert "one row of class logits per labelled position" in (caught.value.hint or "")
    assert "batch_sizes: [1]" not in (caught.value.hint or "")
