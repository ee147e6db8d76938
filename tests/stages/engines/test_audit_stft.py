"""`kiln build` of the ONNX Runtime CPU INT8 graph of a keyword spotter that computes its spectrogram with an
STFT, exported with a dynamic ``samples`` axis: at the sizes it is built for, the audit sizes the STFT and the
nodes after it (running the graph once) and the engine is built as INT8; where no size is given and the nodes
stay unsized, the refusal's fix says how to size them, since no gate failed."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.stages.engines.config import BuildConfig
from kiln.stages.engines.stage import MislabelledEngine, UnsizedLabel, build_direct, refuse_mislabelled
from kiln.stages.precision.audit import audit_graph
from tests.stages.precision.stft_graph import SAMPLES, export_spotter, int8_spotter


@pytest.fixture(scope="module")
def int8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("spotter")
    return int8_spotter(export_spotter(root / "fp32.onnx"), root / "int8.onnx")


def test_the_int8_stft_engine_is_built_at_the_sizes_given(tmp_path: Path, int8: Path) -> None:
    meta = build_direct(int8, tmp_path / "engine", "onnxruntime", "cpu", "int8", BuildConfig(), {"samples": [SAMPLES]})
    assert meta.precision == "int8" and meta.audit["uncounted_nodes"] == {}
    assert meta.audit["share_floor"]["int8"] >= 0.5 and meta.audit["counted_at"] == {"samples": SAMPLES}


def test_a_label_only_unsized_nodes_put_in_doubt_is_refused_with_a_fix_that_sizes_them(
    tmp_path: Path, int8: Path
) -> None:
    """No size given: samples=1, where the graph cannot run (its centring pad reflects past the signal)."""
    with pytest.raises(MislabelledEngine, match="could not be sized") as err:
        build_direct(int8, tmp_path / "engine", "onnxruntime", "cpu", "int8", BuildConfig())
    hint = err.value.hint or ""
    assert isinstance(err.value, UnsizedLabel)  # the pipeline and variant folders keep this fix: not a runtime's
    assert hint.startswith("the label is in doubt, not contradicted") and "at samples=1" in hint
    assert "signature.shapes" in hint and "loosen" not in hint and "--precision matching" not in hint


def test_a_label_counted_flops_contradict_keeps_its_fix(int8: Path) -> None:
    record = {**audit_graph(int8, {"samples": SAMPLES}).record(), "method": "source graph"}
    with pytest.raises(MislabelledEngine, match="labelled fp16") as err:
        refuse_mislabelled(record, "fp16", "e")
    assert (err.value.hint or "").startswith("build it with --precision matching the graph")
