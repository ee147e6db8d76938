"""The ONNX checker's part of the safety net (:class:`kiln.stages.optimize.verify.Verifier`) on a graph that lists its
initializers as inputs too (an export with ``keep_initializers_as_inputs=True``): the big weights the checker
reads as inputs are not listed a second time, so the input model passes it and passes stay checked by it."""

from __future__ import annotations

import onnx
from onnx import helper as h

from kiln.stages.optimize.config import OptimizeConfig
from kiln.stages.optimize.verify import Verifier
from tests.stages.optimize.optimize_helpers import FLOAT, f32, make_model


def test_initializers_listed_as_inputs_still_pass_the_checker() -> None:
    m = make_model([h.make_node("MatMul", ["x", "W"], ["y"])], [("x", ["N", 64], FLOAT)], ["y"], {"W": f32(64, 64)})
    m.graph.input.append(h.make_tensor_value_info("W", FLOAT, [64, 64]))  # 16 KB: stubbed for the checker
    onnx.checker.check_model(m)
    assert Verifier(m, OptimizeConfig()).check_graph
