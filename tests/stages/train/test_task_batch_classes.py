"""Class logits whose class axis follows the batch (CLIP's ``logits_per_image``) are refused before a step trains on
them, and the fixes of the checks before training name what is wrong."""

from __future__ import annotations

import pytest
import torch

from kiln.core.errors import ConfigError, ModelError
from kiln.stages.train.task import Task, check_task


def _similarity(rows: int) -> dict[str, torch.Tensor]:
    """An [images, texts] similarity of ``rows`` pairs: as wide as the batch."""
    emb = torch.randn(rows, 8)
    return {"logits_per_image": emb @ emb.T, "image_embeds": emb}


def test_class_logits_that_follow_the_batch_are_refused_at_the_first_batch_of_another_size() -> None:
    """With two classes, the probe's [2, 2] passed the class-count check and cross-entropy trained on [N, N]."""
    task = Task("classification", "logits_per_image")
    check_task(task, _similarity(2), torch.tensor([0, 1]), 2, "m:clip")
    with pytest.raises(ConfigError, match="as long as the batch") as caught:
        task.loss(_similarity(8), torch.randint(0, 2, (8,)))
    assert "signature.logits_output names it" in caught.value.message


def test_two_class_logits_beside_a_batch_of_two_still_train() -> None:
    """A real classifier of two classes is as wide as the probe's batch of two, and no wider at other batches."""
    task = Task("classification")
    check_task(task, torch.randn(2, 2), torch.tensor([0, 1]), 2, "m:two")
    loss = task.loss(torch.randn(8, 2, requires_grad=True), torch.randint(0, 2, (8,)))
    assert loss.ndim == 0


def test_too_few_class_logits_named_in_logits_output_do_not_ask_to_name_it() -> None:
    """The fix asked to name the logits output in signature.logits_output, which already named it."""
    task = Task("classification", "logits_per_image")
    with pytest.raises(ModelError, match="as long as the batch") as caught:
        check_task(task, _similarity(2), torch.tensor([0, 3]), 4, "m:clip")
    assert "name the logits output" not in (caught.value.hint or "")
    assert "name an output whose last axis holds" in (caught.value.hint or "")


def test_a_label_free_loss_that_returns_a_vector_is_told_to_reduce_it_without_targets() -> None:
    """The fix suggested mse_loss(outputs[...], targets) to a loss called with targets=None."""
    task = Task("regression", None, lambda out, y: out["logits_per_image"].diag(), labels=False)
    with pytest.raises(ConfigError, match=r"shape \[4\]") as caught:
        task.loss(_similarity(4), torch.zeros(4))
    hint = caught.value.hint or ""
    assert ".mean()" in hint and "targets" not in hint
