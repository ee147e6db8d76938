import numpy as np
import pytest
from kiln.core.records import EngineValidation
from kiln.stages.validate.config import ValidateConfig
from kiln.stages.validate.stage import check_gates, compare, gates_for, percentiles


def test_compare_identical_and_perturbed() -> None:
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((100, 10)).astype(np.float32)
    labels = ref.argmax(-1)
    same = compare(ref, ref.copy(), labels)
    assert same["max_abs_err"] == 0 and same["cosine"] == pytest.approx(1.0) and same["top1_agreement"] == 1.0
    flipped = ref.copy()
    flipped[:10] = -flipped[:10]  # changes the argmax of (almost surely) all 10 rows
    res = compare(ref, flipped, labels)
    assert res["top1_agreement"] == pytest.approx(0.9) and res["accuracy"] == pytest.approx(0.9)
    assert res["cosine"] < 0.9


def entry(**kw) -> EngineValidation:
    base = {"cosine": 1.0, "max_abs_err": 0.0, "top1_agreement": 1.0, "accuracy": 0.95,
            "latency_ms": {"8": {"p50": 1.0, "p90": 1.1, "p99": 1.2}}}
    return EngineValidation(name="e", backend="onnxruntime", precision="fp32", device="cpu", status="validated",
                            **{**base, **kw})


def test_gates_name_the_failing_values() -> None:
    gates = gates_for(ValidateConfig(), "fp32")
    assert check_gates(entry(), 0.95, gates, 8) == []
    fails = check_gates(entry(cosine=0.99, top1_agreement=0.5, accuracy=0.80), 0.95, gates, 8)
    assert any("cosine 0.990000 < min_cosine 0.9999" in f for f in fails)
    assert any("top1_agreement 0.5000" in f for f in fails) and any("accuracy drop 0.1500" in f for f in fails)


def test_nan_output_fails_cosine_gate() -> None:
    gates = gates_for(ValidateConfig(), "fp32")
    assert check_gates(entry(cosine=float("nan")), 0.95, gates, 8)


def test_per_precision_overrides() -> None:
    cfg = ValidateConfig()
    assert gates_for(cfg, "fp32")["min_cosine"] == 0.9999 and gates_for(cfg, "int8")["min_cosine"] == 0.99
    assert check_gates(entry(cosine=0.995), 0.95, gates_for(cfg, "int8"), 8) == []


def test_latency_budget_gate() -> None:
    cfg = ValidateConfig(gates={"max_latency_p50_ms": 0.5})
    assert any("p50 latency" in f for f in check_gates(entry(), 0.95, gates_for(cfg, "fp32"), 8))


def test_percentiles_order() -> None:
    p = percentiles(list(np.arange(1, 101, dtype=float)))
    assert p.p50 < p.p90 < p.p99
