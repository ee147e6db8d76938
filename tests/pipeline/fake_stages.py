"""Small fake stages for the runner's rules: each reads its upstream's ``value.txt``, adds a number from the run
config and writes its own. Real config sections drive them, so a setting change reaches exactly the stages that
declare it; a counter records which stages did work."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from kiln.core.errors import BuildError
from kiln.core.records import Summary
from kiln.core.stage import Stage, StageContext, StageSettings
from kiln.models.config import ModelConfig
from kiln.stages.optimize.config import OptimizeConfig
from kiln.stages.train.config import TrainConfig

RAN: Counter[str] = Counter()


@dataclass(frozen=True)
class FirstSettings(StageSettings):
    seed: int
    train: TrainConfig


@dataclass(frozen=True)
class SecondSettings(StageSettings):
    optimize: OptimizeConfig


@dataclass(frozen=True)
class ModelSettings(StageSettings):
    model: ModelConfig


class ValueSummary(Summary):
    value: int


class GatedSummary(ValueSummary):
    failures: list[str]

    def gate_failures(self) -> list[str]:
        return self.failures


def _upstream(ctx: StageContext) -> int:
    return sum(int((path / "value.txt").read_text()) for path in ctx.inputs.values())


def _write(ctx: StageContext, value: int) -> None:
    RAN[ctx.name] += 1
    (ctx.out / "value.txt").write_text(str(value))


def first(ctx: StageContext[FirstSettings]) -> ValueSummary:
    value = ctx.config.seed + ctx.config.train.epochs
    _write(ctx, value)
    return ValueSummary(value=value)


def first_with_a_plot(ctx: StageContext[FirstSettings]) -> ValueSummary:
    """``first``, and a note for people whose content follows ``train.plot`` (as the train stage's loss.png)."""
    (ctx.out / "plot.txt").write_text(f"plot {ctx.config.train.plot}")
    return first(ctx)


def second(ctx: StageContext[SecondSettings]) -> ValueSummary:
    value = _upstream(ctx) + ctx.config.optimize.rounds
    _write(ctx, value)
    return ValueSummary(value=value)


def gated(ctx: StageContext[FirstSettings]) -> GatedSummary:
    """Fails its gate when the value is odd (seed + epochs + rounds)."""
    value = _upstream(ctx)
    _write(ctx, value)
    return GatedSummary(value=value, failures=[f"value {value} is odd"] if value % 2 else [])


def modelled(ctx: StageContext[ModelSettings]) -> ValueSummary:
    _write(ctx, 0)
    return ValueSummary(value=0)


def broken(ctx: StageContext) -> ValueSummary:
    """A stage that fails half-way through writing its folder."""
    (ctx.out / "half-written.bin").write_bytes(b"x")
    raise BuildError("simulated failure")


MODULE = __name__


def fake_stages() -> list[Stage]:
    """first -> second -> third (gated)."""
    return [
        Stage("first", f"{MODULE}:first", (), FirstSettings, ValueSummary, (MODULE,), lambda s: {}),
        Stage("second", f"{MODULE}:second", ("first",), SecondSettings, ValueSummary, (MODULE,), lambda s: {}),
        Stage("third", f"{MODULE}:gated", ("second",), FirstSettings, GatedSummary, (MODULE,), lambda s: {}),
    ]
