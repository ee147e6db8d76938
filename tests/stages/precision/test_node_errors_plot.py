"""The per-node error plot: fixed margins (no text measured to fit them) that still hold every label."""

from __future__ import annotations

from pathlib import Path

import pytest
from matplotlib.figure import Figure

from kiln.stages.precision.node_errors import plot_node_errors


def _drawn(monkeypatch: pytest.MonkeyPatch) -> list[Figure]:
    """The figures saved from here on; fitting margins to the text (``tight_layout``) fails the test."""
    figures: list[Figure] = []
    save = Figure.savefig
    monkeypatch.setattr(Figure, "tight_layout", lambda *a, **k: pytest.fail("margins fitted by measuring text"))
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: figures.append(self) or save(self, *a, **k))
    return figures


def assert_text_inside(fig: Figure) -> None:
    """Every label, shown tick label and title of the figure lies inside it: none is cut at an edge."""
    renderer = fig.canvas.get_renderer()
    box = fig.bbox
    for ax in fig.axes:
        texts = [ax.title, ax.xaxis.label, ax.yaxis.label, *_shown_ticks(ax.xaxis), *_shown_ticks(ax.yaxis)]
        for text in texts:
            if text.get_text() and text.get_visible():
                ext = text.get_window_extent(renderer)
                inside = ext.x0 >= box.x0 and ext.y0 >= box.y0 and ext.x1 <= box.x1 and ext.y1 <= box.y1
                assert inside, f"{text.get_text()!r} at {ext} outside the figure {box}"


def _shown_ticks(axis) -> list:
    """Tick labels of ticks inside the axis's view (matplotlib also lays out ticks beyond it, not drawn)."""
    low, high = sorted(axis.get_view_interval())
    return [t.label1 for t in axis.get_major_ticks() if low <= t.get_loc() <= high]


@pytest.mark.parametrize(
    "name", ["n{}", "/features/block{}/conv/Conv", "/model/encoder/layers.{}/attn/out_proj/" + "x" * 60]
)
@pytest.mark.parametrize("nodes", [6, 30, 60])
def test_names_fit_without_fitting_margins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, nodes: int
) -> None:
    figures = _drawn(monkeypatch)
    order = [(name.format(i), f"t{i}") for i in range(nodes)]
    curves = {"fp16": [1e-4 * (i + 1) for i in range(nodes)], "int8": [0.0] * (nodes - 1) + [float("nan")]}
    path = plot_node_errors(order, curves, tmp_path / "node_errors.png", {"int8": {order[1][0]}})
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (fig,) = figures
    assert_text_inside(fig)
