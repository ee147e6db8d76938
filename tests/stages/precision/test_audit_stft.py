"""A keyword spotter computing its spectrogram with an STFT, exported with a dynamic ``samples`` axis: neither
shape inference sizes the STFT or the nodes after it, so the audit runs the graph once at the sizes it counts at
and reads their shapes; where even that run fails, they stay uncounted and a label they put in doubt is told so."""

from __future__ import annotations

from math import log2
from pathlib import Path

import onnx
import pytest

from kiln.stages.precision.audit import audit_graph, doubt_fix, in_doubt
from tests.stages.precision.stft_graph import CLASSES, HOP, MELS, N_FFT, SAMPLES, export_spotter, int8_spotter

FRAMES = 1 + SAMPLES // HOP  # the centring pad adds N_FFT // 2 on each side
STFT = round(FRAMES * 2.5 * N_FFT * log2(N_FFT))  # a real FFT of N_FFT per frame
MEL = 2 * FRAMES * MELS * (N_FFT // 2 + 1)
CONV = 2 * (16 * FRAMES * MELS) * 9  # 16 channels, a 3x3 kernel on one channel
HEAD = 2 * CLASSES * 16


@pytest.fixture(scope="module")
def graphs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("spotter")
    fp32 = export_spotter(root / "fp32.onnx")
    return fp32, int8_spotter(fp32, root / "int8.onnx")


def test_the_stft_and_the_nodes_after_it_are_counted_at_the_sizes_given(graphs: tuple[Path, Path]) -> None:
    fp32, _ = graphs
    assert any(
        t.data_location == onnx.TensorProto.EXTERNAL
        for t in onnx.load(str(fp32), load_external_data=False).graph.initializer
    )
    for model in (fp32, onnx.load(str(fp32))):  # its file with external data; in memory, big weights and all
        audit = audit_graph(model, {"samples": SAMPLES})
        assert audit.uncounted == {} and audit.total == STFT + MEL + CONV + HEAD


def test_the_int8_graph_is_int8_by_the_flops_of_every_node(graphs: tuple[Path, Path]) -> None:
    _, int8 = graphs
    audit = audit_graph(int8, {"samples": SAMPLES})
    ops = sorted((op, precision, flops) for op, precision, flops in audit.by_node.values())
    assert ops == [
        ("ConvInteger", "int8", CONV),
        ("MatMul", "fp32", MEL),
        ("MatMulInteger", "int8", HEAD),
        ("STFT", "fp32", STFT),
    ]
    assert audit.uncounted == {} and audit.label() == "int8"
    assert audit.share()["int8"] == round((CONV + HEAD) / (STFT + MEL + CONV + HEAD), 4)


def test_a_graph_that_cannot_run_at_the_sizes_leaves_them_uncounted_and_its_label_in_doubt(
    graphs: tuple[Path, Path],
) -> None:
    """At samples=1 (no size given) the centring pad reflects past the signal: the run fails, nothing is raised,
    and the fix for the label in doubt is to give the axis its size, not to loosen a gate."""
    _, int8 = graphs
    record = audit_graph(int8).record()
    assert record["uncounted_ops"] == {"ConvInteger": {"int8": 1}, "MatMul": {"fp32": 1}, "STFT": {"fp32": 1}}
    assert record["flops_per_sample"] == HEAD and record["share"] == {"int8": 1.0}  # the head alone counted
    assert record["counted_at"] == {"samples": 1} and in_doubt(record, "int8") and not in_doubt(record, "fp32")
    fix = doubt_fix(record, "int8")
    assert fix is not None and fix.startswith("the label is in doubt, not contradicted")
    assert "at samples=1" in fix and "signature.shapes" in fix and "loosen" not in fix
