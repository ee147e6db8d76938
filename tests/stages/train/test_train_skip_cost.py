"""A skipped training's cost: the model built once, and scored on a few held-out rows, not the whole split."""

from __future__ import annotations

from pathlib import Path

import pytest

import kiln.models.registry as registry
import kiln.stages.train.stage as train_stage
from kiln.pipeline.config import config_from_dict
from kiln.pipeline.runner import Runner
from kiln.pipeline.stage_list import STAGES
from tests.conftest import tiny_config_dict


def test_skipped_training_builds_once_and_scores_a_few_held_out_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    built: list[str] = []
    scored: list[int] = []
    factory, evaluate = registry._call_factory, train_stage.evaluate_loss_acc

    def counted(ref, table, *args, **kwargs):  # noqa: ANN001, ANN202 - passes through
        if table is registry.MODELS:
            built.append(ref)
        return factory(ref, table, *args, **kwargs)

    def evaluated(model, x, y, *args, **kwargs):  # noqa: ANN001, ANN202 - passes through
        scored.append(len(y))
        return evaluate(model, x, y, *args, **kwargs)

    monkeypatch.setattr(registry, "_call_factory", counted)
    monkeypatch.setattr(train_stage, "evaluate_loss_acc", evaluated)
    monkeypatch.setattr(train_stage, "SKIP_SCORED_ROWS", 4)
    cfg = config_from_dict(tiny_config_dict(**{"train.enabled": False}))
    rec = Runner(cfg, tmp_path / "wd", STAGES).run(stop="train").records[0]
    assert rec.status == "skipped" and 0.0 <= rec.summary.val_accuracy <= 1.0
    assert len(built) == 1, built
    assert scored == [4]
