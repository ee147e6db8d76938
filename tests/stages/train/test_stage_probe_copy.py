"""The checks before training run their forward passes on a copy of the model: a model whose first call sets it up
(a paper's data-aware initialization from its first batch) trains from its first training batch, not from the
checks' two rows; lazy modules are still made by those checks."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from kiln.core.data import DatasetSplits
from kiln.pipeline.config import config_from_dict
from kiln.pipeline.runner import load_dataset, settings_for
from kiln.pipeline.stage_list import stage_named
from kiln.stages.train.stage import probe_copy, train_to
from tests.conftest import tiny_config_dict


class FirstBatchInit(nn.Module):
    """Sets its bias from the mean of the first batch it sees, once (NODE's data-aware init, in small)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2)
        self.register_buffer("initialized", torch.zeros(()))
        self.seen = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.initialized:
            self.seen = len(x)
            with torch.no_grad():
                self.linear.bias.fill_(float(x.mean()))
            self.initialized.fill_(1)
        return self.linear(x)


def test_a_model_that_initializes_on_its_first_call_is_not_initialized_by_the_checks() -> None:
    model = FirstBatchInit()
    probed = probe_copy(model)
    probed(torch.ones(2, 4))  # the checks' forward on two rows
    assert probed is not model and probed.seen == 2
    assert model.seen == 0 and not model.initialized  # left to initialize on its first training batch
    model(torch.full((32, 4), 3.0))
    assert model.seen == 32 and torch.allclose(model.linear.bias, torch.full((2,), 3.0))


def test_lazy_modules_are_probed_themselves_so_their_parameters_exist_for_the_optimizer() -> None:
    model = nn.Sequential(nn.LazyLinear(3))
    probe_copy(model)(torch.ones(2, 5))
    assert model[0].weight.shape == (3, 5)


class FirstRows(nn.Module):
    """Records in a buffer how many rows its first call had (what a data-aware initialization would start from)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2)
        self.register_buffer("first_rows", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.first_rows:
            self.first_rows.fill_(len(x))
        return self.linear(x)


def build() -> nn.Module:
    return FirstRows()


def load() -> DatasetSplits:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 4, generator=g), torch.randint(0, 2, (64,), generator=g)
    return DatasetSplits(x[:48], y[:48], x[48:], y[48:], num_classes=2)


def test_training_starts_from_the_first_training_batch_not_the_checks_rows(tmp_path: Path) -> None:
    me = "tests.stages.train.test_stage_probe_copy"
    cfg = config_from_dict(
        tiny_config_dict(**{"model.name": f"{me}:build", "model.params": {}, "data.name": f"{me}:load"})
        | {"train": {"epochs": 1, "batch_size": 16, "compile": "off"}}
    )
    (tmp_path / "out").mkdir()
    train_to(tmp_path / "out", settings_for(stage_named("train"), cfg), load_dataset(cfg), tmp_path / "ck")
    assert int(load_file(str(tmp_path / "out" / "model.safetensors"))["first_rows"]) == 16
