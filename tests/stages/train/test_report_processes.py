"""The report's training sentence names a multi-process run, its throughput and the checkpoint it resumed."""

from __future__ import annotations

from typing import Any

from kiln.stages.train.report import report_section
from kiln.stages.train.stage import TrainSummary


def _sentence(**fields: Any) -> str:
    summary = {"precision": "bf16", "device": "cpu", "steps": 24, "final_loss": 1.2, "val_accuracy": 0.32}
    return report_section(TrainSummary.model_validate(summary | fields))[3]


def test_two_processes_their_samples_per_second_and_the_resumed_checkpoint() -> None:
    said = _sentence(world_size=2, samples_per_s=7337.4, resumed_from="/runs/a/last.pt")
    assert said.startswith("bf16 on cpu on 2 processes, 24 steps (7,337 samples/s in the last epoch): training loss")
    assert said.endswith("validation accuracy 0.3200; resumed from /runs/a/last.pt.")


def test_one_process_says_no_process_count_and_a_slow_rate_keeps_its_digits() -> None:
    said = _sentence(world_size=1, samples_per_s=3.456)
    assert said.startswith("bf16 on cpu, 24 steps (3.5 samples/s in the last epoch): training loss 1.2000")
    assert "resumed" not in said and "processes" not in said
