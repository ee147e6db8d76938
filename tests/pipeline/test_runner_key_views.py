"""A stage's settings may key a field by what the stage makes of it (``KEY_VIEWS``) instead of by its config keys:
a change of those keys that leaves the view alike leaves the stage cached, one that changes it reruns the stage."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from kiln.core.stage import Stage, StageContext, StageSettings
from kiln.pipeline.config import config_from_dict
from kiln.pipeline.runner import Runner, cache_key, what_changed
from kiln.stages.train.config import TrainConfig
from tests.conftest import tiny_config_dict
from tests.pipeline.fake_stages import MODULE, RAN, ValueSummary


def _whole_epochs(settings: EpochSettings) -> dict[str, Any]:
    """What the stage reads of its train section: the epochs, and not the learning rate."""
    return {"epochs": settings.train.epochs}


@dataclass(frozen=True)
class EpochSettings(StageSettings):
    SOURCES = {"train": ("train.epochs", "train.lr")}
    KEY_VIEWS: ClassVar[dict[str, Any]] = {"train": _whole_epochs}
    train: TrainConfig


def epochs(ctx: StageContext[EpochSettings]) -> ValueSummary:
    RAN[ctx.name] += 1
    (ctx.out / "value.txt").write_text(str(ctx.config.train.epochs))
    return ValueSummary(value=ctx.config.train.epochs)


STAGE = Stage("viewed", f"{__name__}:epochs", (), EpochSettings, ValueSummary, (MODULE,), lambda s: {})


def run(workdir: Path, **config: Any) -> str:
    """The stage's status in a run under ``config`` (dotted keys)."""
    RAN.clear()
    cfg = config_from_dict(tiny_config_dict(**{"train.epochs": 2, **config}))
    return Runner(cfg, workdir, [STAGE]).run().records[0].status


def test_a_change_the_view_does_not_see_leaves_the_stage_cached(tmp_path: Path) -> None:
    assert run(tmp_path) == "ran"
    assert run(tmp_path, **{"train.lr": 0.5}) == "cached" and not RAN
    assert run(tmp_path, **{"train.lr": 0.5, "train.epochs": 5}) == "ran"


def test_the_view_is_keyed_under_its_section_and_named_when_it_changes(tmp_path: Path) -> None:
    parts = [cache_key(STAGE, config_from_dict(tiny_config_dict(**{"train.epochs": n})), tmp_path)[1] for n in (2, 3)]
    assert parts[0]["config"] == {"train": {"epochs": 2}}
    assert what_changed(*parts) == ["config.train"]


def test_the_train_stage_reads_gated_outputs_without_keying_on_them(tmp_path: Path) -> None:
    """Train checks validate.gates.gated_outputs on its probe (a typo fails before training) yet a gate changed
    retrains nothing: its key holds no trace of them."""
    from kiln.pipeline.runner import settings_for
    from kiln.pipeline.stage_list import stage_named

    train = stage_named("train")
    keys = [
        cache_key(train, config_from_dict(tiny_config_dict(**{"validate.gates.gated_outputs": g})), tmp_path)[0]
        for g in (None, ["logits"])
    ]
    assert keys[0] == keys[1]
    config = config_from_dict(tiny_config_dict(**{"validate.gates.gated_outputs": ["logits"]}))
    assert settings_for(train, config).gated_outputs == ["logits"]
