"""The training section of report.md."""

from __future__ import annotations

from typing import Any

from kiln.core.text import fmt


def report_section(train: Any) -> list[str]:
    """Training's part of report.md (``train``: the stage's ``TrainSummary``): the result and the loss curve."""
    warned = [f"- **Data:** {said}" for said in getattr(train, "data_warnings", None) or []]
    if train.status == "skipped":
        score = f"; validation accuracy {fmt(train.val_accuracy)}" if train.val_accuracy is not None else ""
        off = f"Training off: the weights are {train.source}{score}."
        return ["", "## Training", "", off, *(["", *warned] if warned else [])]
    if train.val_accuracy is None and not train.epochs:
        return []
    score = (
        f"validation accuracy {fmt(train.val_accuracy)}"
        if train.val_accuracy is not None  # a regression has a loss, no accuracy
        else f"validation loss {fmt(train.val_loss)}"
    )
    out = [
        "",
        "## Training",
        "",
        f"{train.precision} on {train.device}{_processes(train)}, {train.steps} steps{_rate(train)}: training loss "
        f"{fmt(train.final_loss)} in the last epoch; {_weights_of(train)}{score}"
        + (f", {train.skipped_steps} overflow-skipped steps" if train.skipped_steps else "")
        + _compile_note(train.compile)
        + _graph_note(train.update_graph)
        + _resumed(train)
        + ".",
    ]
    if warned:  # what the data checks said before training: the accuracy of the report is read with it
        out += ["", *warned]
    if "loss.png" in train.files:
        out += ["", "![loss curve](train/loss.png)"]
    return out


def _processes(train: Any) -> str:
    """ " on N processes" for a multi-process (DDP) run, nothing for one process."""
    return f" on {train.world_size} processes" if (train.world_size or 1) > 1 else ""


def _rate(train: Any) -> str:
    """The last epoch's training throughput over all processes (validation excluded), in parentheses."""
    rate = train.samples_per_s
    if rate is None or rate <= 0:
        return ""
    return f" ({rate:,.0f} samples/s in the last epoch)" if rate >= 10 else f" ({rate:.2g} samples/s in the last epoch)"


def _resumed(train: Any) -> str:
    """The checkpoint training continued from, where it resumed one (the step is in the log and in last.pt)."""
    return f"; resumed from {train.resumed_from}" if train.resumed_from else ""


def _weights_of(train: Any) -> str:
    """Which epoch's weights the engines are built from (``select: best`` may pick an earlier one than the last),
    the validation score that follows being that epoch's."""
    if train.selected_epoch is None or not train.epochs:
        return ""
    return f"weights of epoch {train.selected_epoch} of {len(train.epochs)}, "


def _compile_note(c: dict[str, Any] | None) -> str:
    """train.compile's outcome in one clause (the summary has the reasons)."""
    if not c:
        return ""
    if c.get("fallback"):
        return f"; torch.compile failed, trained eagerly ({c['fallback']})"
    return (
        f"; torch.compile ({c.get('mode')}): {c.get('graphs')} graphs, {c.get('recompiles')} recompiles, "
        f"{c.get('graph_breaks')} graph breaks, {c.get('eager_calls', 0)} calls of other shapes run eagerly"
    )


def _graph_note(g: dict[str, Any] | None) -> str:
    """train.update_graph's outcome in one clause."""
    if not g:
        return ""
    if not g.get("captured"):
        return f"; the update ran without a CUDA graph ({g.get('failure')})"
    return f"; the update after the backward pass ran as one CUDA graph from step {g.get('from_step')}"
