"""Config of the optimize stage: pass names and params are checked at load, with the choices listed."""

from __future__ import annotations

import pytest
from onnx import helper as h

from kiln.core.errors import ConfigError
from kiln.pipeline.config import config_from_dict
from kiln.stages.optimize import catalog, registry
from kiln.stages.optimize.api import optimize_model
from kiln.stages.optimize.config import DEFAULT_PASSES, OptimizeConfig
from tests.stages.optimize.optimize_helpers import FLOAT, make_model, ops
from tests.stages.optimize.test_optimize_passes import TESTED


def test_unknown_pass_lists_the_available_ones():
    with pytest.raises(ConfigError) as err:
        OptimizeConfig(passes=["fold_constants", "make_it_fast"])
    assert "make_it_fast" in err.value.message and "merge_qkv" in err.value.hint


def test_unknown_pass_through_the_pipeline_config_is_a_config_error():
    with pytest.raises(ConfigError):
        config_from_dict({"optimize": {"passes": ["nope"]}})


def test_pass_params_are_typed():
    OptimizeConfig(passes=[{"name": "merge_qkv", "min_branches": 3}])
    with pytest.raises(ConfigError, match="merge_qkv"):
        OptimizeConfig(passes=[{"name": "merge_qkv", "min_branchez": 3}])
    with pytest.raises(ConfigError):
        OptimizeConfig(passes=[{"min_branches": 3}])


def test_default_pipeline_is_registered_and_every_pass_is_tested_and_described():
    assert set(DEFAULT_PASSES) <= set(catalog.available())
    assert set(catalog.available()) == TESTED, "each registered pass needs its own test"
    assert all(d and len(d) < 200 for d in catalog.describe().values())


def _relu_to_identity(graph, p):  # a deliberately wrong rewrite
    n = 0
    for node in graph.nodes:
        if node.op == "Relu":
            node.op, n = "Identity", n + 1
    return n


@pytest.fixture
def wrong_pass(monkeypatch):
    """A pass named "wrong" that changes the outputs (Relu -> Identity), registered for one test."""
    monkeypatch.setitem(
        registry.PASSES, "wrong", registry.PassSpec("wrong", _relu_to_identity, registry.NoParams, "bad")
    )


def test_a_pass_that_changes_outputs_is_rolled_back_and_named(wrong_pass):
    m = make_model([h.make_node("Relu", ["x"], ["y"])], [("x", ["N", 8], FLOAT)], ["y"], {})
    out, s = optimize_model(m, OptimizeConfig(passes=["wrong"]))
    assert s["rolled_back"] == ["wrong"] and ops(out) == ["Relu"] and "max abs error" in s["passes"][0]["reason"]
    out, s = optimize_model(m, OptimizeConfig(passes=["wrong"], verify=False))  # without the net it ships
    assert ops(out) == ["Identity"] and not s["verified"]


def test_a_crashing_pass_is_rolled_back(monkeypatch):
    def boom(graph, p):
        raise RuntimeError("bug")

    monkeypatch.setitem(registry.PASSES, "boom", registry.PassSpec("boom", boom, registry.NoParams, "crashes"))
    m = make_model([h.make_node("Relu", ["x"], ["y"])], [("x", ["N", 8], FLOAT)], ["y"], {})
    out, s = optimize_model(m, OptimizeConfig(passes=["boom", "toposort"]))
    assert s["rolled_back"] == ["boom"] and "RuntimeError" in s["passes"][0]["reason"]


def test_a_round_is_checked_once_and_a_bad_pass_in_it_is_found_by_name(wrong_pass):
    """The safety net runs the graph once on the result of all the rounds; when it differs, it replays the passes
    one by one and rolls back only the pass at fault."""
    nodes = [h.make_node("Identity", ["x"], ["a"]), h.make_node("Relu", ["a"], ["y"])]
    m = make_model(nodes, [("x", ["N", 8], FLOAT)], ["y"], {})
    out, s = optimize_model(m, OptimizeConfig(passes=["eliminate_identity", "toposort"]))
    assert ops(out) == ["Relu"] and s["checks"] == 1 and not s["rolled_back"]  # one change, one check
    out, s = optimize_model(m, OptimizeConfig(passes=["eliminate_identity", "wrong", "toposort"]))
    assert ops(out) == ["Relu"] and s["rolled_back"] == ["wrong"]  # the good pass kept, the bad one named
    assert s["checks"] == 3  # the round, then each of its two changing passes
    assert [p["name"] for p in s["passes"] if p["rolled_back"]] == ["wrong"]
