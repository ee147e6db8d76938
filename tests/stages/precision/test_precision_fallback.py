"""Accuracy-driven fallback finds planted bad nodes, keeps them FP32, and records why."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from kiln.calibration.config import CalibrationConfig
from kiln.stages.accuracy.config import GatesConfig
from kiln.stages.precision.config import FallbackConfig, FP16Config
from kiln.stages.precision.gate import GateCheck
from kiln.stages.precision.variants import Source, build_fp16, build_int8
from tests.stages.precision.precision_graphs import (
    chain_graph,
    inputs,
    make_model,
    plus_minus_big_graph,
    reshape_in_range_graph,
    rng_weights,
)

NO_RANGE_CHECK = FP16Config(range_check=False)  # so only the fallback can catch the planted node


def _source(model: onnx.ModelProto, tmp: Path, batches: list[np.ndarray] | None = None) -> Source:
    return Source.prepare(model, tmp / "fp32.onnx", batches or [], tmp / "cache")


def test_fallback_finds_planted_overflow(tmp_path: Path) -> None:
    """scale_up overflows FP16 (the range check is off): fallback keeps it and its reader in FP32."""
    src = _source(chain_graph(scale=3e4), tmp_path)
    entry = build_fp16(
        src,
        tmp_path / "fp16" / "model.onnx",
        NO_RANGE_CHECK,
        FallbackConfig(nodes_per_round=1),
        inputs(256),
        CalibrationConfig(),
    )
    assert entry["fallback"]["passed"]
    assert entry["fallback"]["rounds"][0]["top1_agreement"] < 0.9  # it really was broken
    assert "scale_up" in entry["kept_fp32"]
    assert "fallback round 1" in entry["reasons"]["scale_up"]
    assert "mm1" not in entry["kept_fp32"] and "head" not in entry["kept_fp32"]  # only what it must
    assert entry["vs_fp32"]["top1_agreement"] >= 0.99


def test_fallback_can_keep_a_reshape_that_overflows(tmp_path: Path) -> None:
    """Without the range check, the ~1e5 values overflow in the FP16 Reshape between FP32 nodes: the fallback
    must be able to pick the Reshape (it once could not, and stopped with 'no node left' and NaN outputs)."""
    src = _source(reshape_in_range_graph(scale=3e4), tmp_path)
    entry = build_fp16(
        src,
        tmp_path / "fp16" / "model.onnx",
        NO_RANGE_CHECK,
        FallbackConfig(nodes_per_round=1, max_rounds=6),
        inputs(256),
        CalibrationConfig(),
    )
    assert entry["fallback"]["passed"], entry["fallback"]["rounds"]
    assert not np.isfinite(entry["fallback"]["rounds"][0]["cosine"])  # it really overflowed at first
    assert "reshape" in entry["kept_fp32"]
    assert "not finite" in entry["reasons"]["reshape"]


def test_fallback_follows_error_to_its_producer(tmp_path: Path) -> None:
    """(h + 4096) - 4096: the damage shows at the Sub but is done by the Add's FP16 rounding."""
    model = plus_minus_big_graph()
    src = _source(model, tmp_path)
    entry = build_fp16(
        src,
        tmp_path / "fp16" / "model.onnx",
        NO_RANGE_CHECK,
        FallbackConfig(nodes_per_round=1, max_rounds=4),
        inputs(256),
        CalibrationConfig(),
    )
    assert entry["fallback"]["passed"], entry["fallback"]["rounds"]
    assert {"add_big", "sub_big"} <= set(entry["kept_fp32"])
    assert "feeds sub_big" in entry["reasons"]["add_big"]


def test_fallback_disabled_reports_failure(tmp_path: Path) -> None:
    src = _source(chain_graph(scale=3e4), tmp_path)
    entry = build_fp16(
        src,
        tmp_path / "fp16" / "model.onnx",
        NO_RANGE_CHECK,
        FallbackConfig(enabled=False),
        inputs(128),
        CalibrationConfig(),
    )
    assert not entry["fallback"]["passed"] and entry["kept_fp32"] == []


def test_int8_fallback_finds_planted_node(tmp_path: Path) -> None:
    """A MatMul whose input mixes a huge-outlier channel with small ones: per-tensor INT8 activations wipe
    out the small channels, so that node (and only a few) must go back to float."""
    rng = np.random.default_rng(0)
    w1 = rng_weights(16, 32)
    nodes = [
        helper.make_node("MatMul", ["input", "w1"], ["h"], name="mm1"),
        helper.make_node("Mul", ["h", "spread"], ["hs"], name="spread"),
        helper.make_node("MatMul", ["hs", "w2"], ["logits"], name="planted"),
    ]
    spread = np.ones(32, np.float32)
    spread[0] = 2000.0  # one channel a thousand times larger than the rest
    w2 = rng_weights(32, 10, seed=1)
    w2[0] = 1e-4 * rng.standard_normal(10)  # ... that barely matters to the result
    model = make_model(nodes, {"w1": w1, "spread": spread, "w2": w2})
    x = inputs(256)
    src = _source(model, tmp_path, [x[:64], x[64:128]])
    # two compute nodes: a gate that the graph with mm1 in INT8 can meet (a sample or two flip on the rest)
    check = GateCheck.on_samples(src.model, x, gates=GatesConfig(per_precision={"int8": {"min_top1_agreement": 0.95}}))
    entry = build_int8(
        src, tmp_path / "int8" / "model.onnx", CalibrationConfig(), FallbackConfig(nodes_per_round=1), check
    )
    assert entry["fallback"]["rounds"][0]["top1_agreement"] < 0.9
    assert entry["fallback"]["passed"] and "planted" in entry["kept_fp32"]
    assert "fallback round" in entry["reasons"]["planted"]


def test_top1_agreement_counts_the_labelled_positions_given() -> None:
    """A token tagger's padding has no label (-100): a flip there is no disagreement the fallback should chase."""
    from kiln.stages.precision.compare import output_metrics

    ref = np.zeros((2, 4, 3))
    ref[..., 0] = 1.0
    got = ref.copy()
    got[:, 3] = [0.0, 2.0, 0.0]  # the last position of each row (padding) flips
    assert output_metrics([ref], [got], 0)["top1_agreement"] == 0.75
    labelled = np.array([[True, True, True, False]] * 2)
    assert output_metrics([ref], [got], 0, labelled)["top1_agreement"] == 1.0


def test_rounds_that_buy_nothing_are_dropped_and_the_search_stops(tmp_path: Path) -> None:
    """A variant whose error no node choice changes (its weights are off, whatever is kept in float): the rounds
    after round 0 gain nothing, the search stops (here when no node is left to blame, at most after PATIENCE
    rounds), and the variant is round 0's graph with no node kept."""
    from kiln.stages.precision.fallback import PATIENCE, run_fallback

    w = rng_weights(16, 10)
    fp32 = make_model([helper.make_node("MatMul", ["input", "w"], ["logits"], name="mm")], {"w": w})
    off = make_model(
        [helper.make_node("MatMul", ["input", "w"], ["logits"], name="mm")], {"w": w + rng_weights(16, 10, seed=1)}
    )
    built: list[set[str]] = []

    def build(extra: set[str]) -> Path:
        built.append(set(extra))
        path = tmp_path / "variant.onnx"
        onnx.save(off, str(path))
        return path

    check = GateCheck.on_samples(fp32, inputs(256))
    result = run_fallback(build, check, "fp16", FallbackConfig(nodes_per_round=1), {"mm"}, "test")
    assert not result.passed and result.kept == {} and built[-1] == set()
    assert 1 < len(result.rounds) <= PATIENCE + 1 and all(r.get("discarded") for r in result.rounds[1:])


@pytest.mark.parametrize("found_faster", [False, True])
def test_nodes_kept_without_a_measured_gain_go_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, found_faster: bool
) -> None:
    """Round 1 keeps 'a' and gains nothing, round 2 keeps 'b' and passes: the graph without 'a' passes too, and of the
    two the faster is kept, measured (here scripted): the pruned one, unless the other leads beyond the noise."""
    from kiln.stages.precision import fallback
    from kiln.stages.precision.gate import Verdict

    picks = iter([{"a": "round 1's pick"}, {"b": "round 2's pick"}])
    monkeypatch.setattr(fallback, "blame", lambda *args: next(picks))
    built: list[set[str]] = []

    def build(extra: set[str]) -> Path:
        built.append(set(extra))
        (tmp_path / "variant.onnx").write_text(",".join(sorted(extra)))
        return tmp_path / "variant.onnx"

    class Check:
        fp32, samples = None, np.zeros((4, 2))

        def __call__(self, path: Path, precision: str, cfg: FallbackConfig) -> Verdict:
            ok = "b" in built[-1]
            metrics = {"top1_agreement": 1.0 if ok else 0.9, "cosine": 0.9999 if ok else 0.99}
            return Verdict(metrics, [] if ok else ["top1_agreement 0.9000 < 0.97"], np.zeros((4, 2)), np.zeros((4, 2)))

        def time_graphs(self, graphs: dict[str, Path]) -> dict[str, tuple[float, float, float]]:
            assert {k: p.read_text() for k, p in graphs.items()} == {"as found": "a,b", "pruned": "b"}
            return {"as found": (1.0, 0.9, 1.1), "pruned": (2.0, 1.9, 2.1) if found_faster else (1.02, 0.9, 1.2)}

    result = fallback.run_fallback(build, Check(), "int8", FallbackConfig(nodes_per_round=1), {"a", "b"}, "test")
    assert result.passed and result.tried == ["a", "b"]
    assert set(result.kept) == ({"a", "b"} if found_faster else {"b"}) and built[-1] == set(result.kept)
    assert result.timing["kept"] == ("as found" if found_faster else "pruned")


def test_a_round_that_mends_the_worst_sample_improves_and_the_fallback_target_holds_it() -> None:
    """The gates hold min_cosine for the worst sample too: a round that lifts that sample at an equal whole-output
    cosine is progress (the search stopped on it before), and precision.fallback.min_cosine applies to it."""
    from kiln.core.records import EngineValidation
    from kiln.stages.precision.fallback import improves
    from kiln.stages.precision.gate import _extra_failures

    before = {"top1_agreement": None, "cosine": 0.99990, "sample_cosine": 0.95}
    mended = {"top1_agreement": None, "cosine": 0.99990, "sample_cosine": 0.999}
    assert improves(mended, before) and not improves(before, mended)
    assert improves({"top1_agreement": None, "cosine": 0.9999}, {"top1_agreement": None, "cosine": 0.99})
    entry = EngineValidation(name="v", backend="onnxruntime", precision="int8", device="cpu", status="validated")
    entry.cosine, entry.outputs = 0.9999, {"logits": {"sample_cosine": 0.95}}
    said = _extra_failures(entry, FallbackConfig(min_cosine=0.999))
    assert said == ["worst-sample cosine 0.950000 < fallback target 0.999"]


def test_each_round_is_said_to_the_progress_bar(tmp_path: Path) -> None:
    """A round judges a graph at every validated shape (minutes for a 500-frame vocoder) and logs at INFO only: the
    precision stage's bar says each round as it starts."""
    from kiln.stages.precision.fallback import round_notes, run_fallback

    w = rng_weights(16, 10)
    fp32 = make_model([helper.make_node("MatMul", ["input", "w"], ["logits"], name="mm")], {"w": w})
    off = make_model(
        [helper.make_node("MatMul", ["input", "w"], ["logits"], name="mm")], {"w": w + rng_weights(16, 10, seed=1)}
    )

    def build(extra: set[str]) -> Path:
        onnx.save(off, str(tmp_path / "variant.onnx"))
        return tmp_path / "variant.onnx"

    notes: list[str] = []
    with round_notes(notes.append):
        result = run_fallback(build, GateCheck.on_samples(fp32, inputs(256)), "fp16", FallbackConfig(), {"mm"}, "fp16")
    assert len(notes) == len(result.rounds) > 1 and notes[0].startswith("fp16: round 0 of at most")
    run_fallback(build, GateCheck.on_samples(fp32, inputs(256)), "fp16", FallbackConfig(), {"mm"}, "fp16")
    assert len(notes) == len(result.rounds)  # outside the block: nothing said
