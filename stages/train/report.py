"""The training section of report.md."""

from __future__ import annotations

from typing import Any

from kiln.core.text import fmt


def report_section(summary: dict[str, Any]) -> list[str]:
    """Training's part of report.md: the result and the loss curve."""
    out: list[str] = []
    train = summary
    if train.get("val_accuracy") is not None or train.get("epochs"):  # a regression has a loss, no accuracy
        score = (
            f"validation accuracy {fmt(train.get('val_accuracy'))}"
            if train.get("val_accuracy") is not None
            else f"validation loss {fmt(train.get('val_loss'))}"
        )
        out += [
            "",
            "## Training",
            "",
            f"{train.get('precision')} on {train.get('device')}, {train.get('steps', '?')} steps: final loss "
            f"{fmt(train.get('final_loss'))}, {score}"
            + (f", {train['skipped_steps']} overflow-skipped steps" if train.get("skipped_steps") else "")
            + _compile_note(train.get("compile"))
            + _graph_note(train.get("update_graph"))
            + ".",
        ]
        if "loss.png" in train.get("files", []):
            out += ["", "![loss curve](train/loss.png)"]
    return out


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
