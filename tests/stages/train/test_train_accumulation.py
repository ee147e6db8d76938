"""Gradient accumulation: K micro-batches give the update of one batch of K*B (FP32, same data order)."""

from __future__ import annotations

import pytest
import torch

from kiln.stages.train.data import micro_batches
from kiln.stages.train.loop import train
from tests.stages.train.train_helpers import max_diff, tiny_data, tiny_net, train_cfg


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("k", [2, 5])
def test_accumulation_equals_big_batch(optimizer: str, k: int) -> None:
    # 160 training samples, batch 48: the last batch of each epoch holds 16 samples, and 48 does not split
    # into 5 equal micro-batches, so the short last window and unequal micro-batches are both exercised.
    data = tiny_data(200)
    assert len(data.train_x) % 48 != 0
    ref, acc = tiny_net(), tiny_net()
    r1 = train(ref, data, train_cfg(batch_size=48, optimizer=optimizer, lr=0.01, grad_clip=0.5))
    r2 = train(acc, data, train_cfg(batch_size=48, grad_accum_steps=k, optimizer=optimizer, lr=0.01, grad_clip=0.5))
    assert max_diff(ref, acc) < 1e-6  # observed: ~1e-8 (float rounding)
    # The reported loss is the per-sample mean either way.
    assert [m.loss for m in r1.history] == pytest.approx([m.loss for m in r2.history], rel=1e-5)
    assert r1.global_step == r2.global_step == 2 * 4


def test_accumulation_differs_from_no_weighting() -> None:
    """The test above can fail: weighting every micro-batch equally (a common bug) changes the result."""
    data = tiny_data(200)
    xb, yb = data.train_x[:48], data.train_y[:48]
    loss_fn = torch.nn.CrossEntropyLoss()

    def grads(weighted: bool) -> torch.Tensor:
        model = tiny_net()
        chunks = micro_batches(xb, yb, 5)
        for cx, cy in chunks:
            w = len(cx) / len(xb) if weighted else 1 / len(chunks)
            (loss_fn(model(cx), cy) * w).backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    full = tiny_net()
    loss_fn(full(xb), yb).backward()
    want = torch.cat([p.grad.flatten() for p in full.parameters()])
    assert torch.allclose(grads(True), want, atol=1e-6)
    assert not torch.allclose(grads(False), want, atol=1e-6)


def test_micro_batches_cover_the_batch_in_order() -> None:
    x, y = torch.arange(10.0), torch.arange(10)
    chunks = micro_batches(x, y, 4)
    assert [len(c[0]) for c in chunks] == [3, 3, 4]  # a last micro-batch of one row joins the one before
    assert torch.equal(torch.cat([c[0] for c in chunks]), x)
    assert len(micro_batches(x[:2], y[:2], 4)) == 2  # a short last batch gives fewer micro-steps


def test_more_micro_batches_than_samples_is_said(caplog: pytest.LogCaptureFixture) -> None:
    """grad_accum_steps over the batch still trains exactly (micro-batches of one sample), and says to lower it."""
    data = tiny_data(40)
    with caplog.at_level("WARNING", logger="kiln.train"):
        train(tiny_net(), data, train_cfg(batch_size=8, grad_accum_steps=16, epochs=1))
    assert "train.grad_accum_steps 16 is more than the 8 samples" in caplog.text
