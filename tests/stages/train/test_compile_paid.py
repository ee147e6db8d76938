"""train.compile's verdict on whether compiling paid: the decision from given numbers, never from a timed run."""

from __future__ import annotations

from torch import nn

from kiln.stages.train.compile import CompiledModel, compile_paid, unpaid_warning
from kiln.stages.train.config import CompileConfig


def test_compile_did_not_pay_when_it_took_longer_than_the_training_after_it() -> None:
    assert not compile_paid(62.0, 15.0)  # the CPU probe: 62 s compiling, 15 s of training after it
    assert compile_paid(20.0, 300.0)
    assert compile_paid(0.0, 0.0)  # nothing compiled, nothing trained: no verdict against it


def test_unpaid_warning_names_the_numbers_and_the_setting() -> None:
    said = unpaid_warning({"compile_s": 62.4, "after_compile_s": 15.2, "paid": False}, "cpu")
    assert said == (
        "train.compile took 62 s to compile and training ran 15 s after it: on this CPU it did not pay; "
        "set train.compile: false"
    )
    assert "in a run this short" in (unpaid_warning({"compile_s": 9, "after_compile_s": 3, "paid": False}, "cuda:0"))
    assert unpaid_warning({"compile_s": 1.0, "after_compile_s": 30.0, "paid": True}, "cpu") is None
    assert unpaid_warning({"compile_s": 1.0, "fallback": "InductorError: x"}, "cpu") is None  # no verdict: eager


def test_summary_records_the_verdict_given_the_loop_time() -> None:
    net = CompiledModel(nn.Linear(2, 2), CompileConfig())  # compiled lazily: nothing compiled yet, compile_s 0
    summary = net.summary(run_s=4.0)
    assert summary is not None and summary["paid"] is True and summary["after_compile_s"] == 4.0
    assert "paid" not in (net.summary() or {})  # no loop time: no verdict
