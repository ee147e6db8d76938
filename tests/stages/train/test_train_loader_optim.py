"""DataLoader knobs change how batches are loaded, never which; the LR schedule follows the config."""

from __future__ import annotations

import math

import pytest
import torch

from kiln.stages.train.data import make_loader
from kiln.stages.train.dist import DistEnv
from kiln.stages.train.loop import train
from kiln.stages.train.optim import make_optimizer, make_schedule, param_groups
from tests.stages.train.train_helpers import max_diff, tiny_data, tiny_net, train_cfg


def test_worker_processes_give_the_same_training() -> None:
    data = tiny_data()
    a, b = tiny_net(), tiny_net()
    train(a, data, train_cfg())
    train(
        b,
        data,
        train_cfg(loader={"num_workers": 1, "persistent_workers": True, "prefetch_factor": 2, "pin_memory": False}),
    )
    assert max_diff(a, b) == 0.0


def test_sampler_shards_are_the_global_batch() -> None:
    """Rank r's j-th batch is elements r::W of the one-process j-th batch: the same global batches."""
    data, cfg = tiny_data(), train_cfg(batch_size=32)
    cpu = torch.device("cpu")
    one, s1 = make_loader(data.train_x, data.train_y, cfg, DistEnv(), seed=0, device=cpu)
    shards = [make_loader(data.train_x, data.train_y, cfg, DistEnv(r, 2, r), seed=0, device=cpu) for r in (0, 1)]
    for epoch in (0, 1):
        for s in [s1] + [s for _, s in shards]:
            s.set_position(epoch)
        for j, (x1, _) in enumerate(one):
            parts = [list(loader)[j][0] for loader, _ in shards]
            assert torch.equal(x1[0::2], parts[0]) and torch.equal(x1[1::2], parts[1])
    s1.set_position(0, start=64)  # resuming after two batches skips exactly those
    assert len(list(one)) == math.ceil((160 - 64) / 32)


def test_schedule_warmup_then_cosine_to_min_lr() -> None:
    model = tiny_net()
    cfg = train_cfg(lr=0.1, min_lr=0.01, warmup_steps=4, schedule="cosine", optimizer="adamw")
    opt = make_optimizer(model, cfg, torch.device("cpu"))
    sched = make_schedule(opt, cfg, total_steps=20)
    lrs = []
    for _ in range(20):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == pytest.approx(0.001)  # warm-up starts at lr/100
    assert lrs[4] == pytest.approx(0.1)  # then the peak
    assert all(x >= y for x, y in zip(lrs[4:], lrs[5:]))  # cosine decays
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01)  # down to min_lr at the end


def test_no_weight_decay_on_biases_and_norms() -> None:
    decay, no_decay = param_groups(tiny_net(), 0.1)
    assert all(p.dim() >= 2 for p in decay["params"]) and decay["weight_decay"] == 0.1
    assert all(p.dim() == 1 for p in no_decay["params"]) and no_decay["weight_decay"] == 0.0
