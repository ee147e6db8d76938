"""The report's training section names what torch.compile did (train.compile), or that it fell back to eager."""

from __future__ import annotations

from kiln.stages.train.report import report_section
from kiln.stages.train.stage import TrainSummary


def _train(compile_summary: dict | None) -> str:
    summary = {
        "precision": "bf16",
        "device": "cpu",
        "steps": 23,
        "final_loss": 0.5,
        "val_accuracy": 0.9,
        "files": [],
        "compile": compile_summary,
    }
    return "\n".join(report_section(TrainSummary.model_validate(summary)))


def test_training_section_reports_compile_counts_or_fallback() -> None:
    assert "torch.compile" not in _train(None)
    counts = {"mode": "default", "graphs": 3, "recompiles": 2, "graph_breaks": 0, "fallback": None}
    assert "23 steps: training loss 0.5000 in the last epoch; validation accuracy 0.9000" in _train(counts)
    assert (
        "; torch.compile (default): 3 graphs, 2 recompiles, 0 graph breaks, 0 calls of other shapes run eagerly."
        in _train(counts)
    )
    failed = dict(counts, fallback="InductorError: no C++ compiler")
    assert "torch.compile failed, trained eagerly (InductorError: no C++ compiler)." in _train(failed)


def test_training_section_says_whether_the_update_ran_as_a_cuda_graph() -> None:
    summary = {"precision": "fp16", "device": "cuda", "steps": 23, "final_loss": 0.5, "val_accuracy": 0.9, "files": []}
    assert "CUDA graph" not in "\n".join(report_section(TrainSummary.model_validate({**summary, "update_graph": None})))
    graphed = {"captured": True, "from_step": 4, "captures": 1, "eager_steps_after_capture": 0, "failure": None}
    assert "; the update after the backward pass ran as one CUDA graph from step 4." in "\n".join(
        report_section(TrainSummary.model_validate({**summary, "update_graph": graphed}))
    )
    failed = {**graphed, "captured": False, "failure": "operation not permitted when stream is capturing"}
    assert "; the update ran without a CUDA graph (operation not permitted when stream is capturing)." in "\n".join(
        report_section(TrainSummary.model_validate({**summary, "update_graph": failed}))
    )


def test_training_off_says_so_and_where_the_weights_came_from() -> None:
    skipped = TrainSummary(status="skipped", source="weights.safetensors", val_accuracy=0.75)
    assert report_section(skipped) == [
        "",
        "## Training",
        "",
        "Training off: the weights are weights.safetensors; validation accuracy 0.7500.",
    ]


def test_the_epoch_whose_weights_were_kept_is_named_beside_its_score() -> None:
    """select: best may keep an earlier epoch: its validation accuracy is that epoch's, the loss the last one's."""
    summary = {"precision": "fp32", "device": "cpu", "steps": 30, "final_loss": 0.2, "val_accuracy": 1.0}
    epochs = [{"epoch": i} for i in (1, 2, 3)]
    text = "\n".join(report_section(TrainSummary.model_validate(summary | {"epochs": epochs, "selected_epoch": 2})))
    assert "training loss 0.2000 in the last epoch; weights of epoch 2 of 3, validation accuracy 1.0000" in text
