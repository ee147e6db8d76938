"""The collector stays out of TensorRT's logger callbacks (a collection there deadlocked a test run:
a builder kept in a reference cycle was freed inside TensorRT-RTX's createInferBuilder, under its mutex)."""

import gc
import threading

import pytest

from kiln.stages.engines.tensorrt.errors import gc_paused_for_tensorrt


class _Cycle:
    def __init__(self, freed: list) -> None:
        self.me, self.freed = self, freed

    def __del__(self) -> None:
        self.freed.append(1)


def test_garbage_is_collected_before_and_the_collector_is_off_inside() -> None:
    assert gc.isenabled()
    freed: list = []
    threshold = gc.get_threshold()
    gc.set_threshold(10**9)  # no automatic collection may free the cycle before the guard does
    try:
        _Cycle(freed)
        assert freed == []
        with gc_paused_for_tensorrt():
            assert freed == [1] and not gc.isenabled()
    finally:
        gc.set_threshold(*threshold)
    assert gc.isenabled()


def test_restored_after_an_error_and_left_off_if_it_was_off() -> None:
    with pytest.raises(RuntimeError):
        with gc_paused_for_tensorrt():
            raise RuntimeError("build failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused_for_tensorrt():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_overlapping_builds_in_threads_keep_it_off_until_the_last_ends() -> None:
    # The naive guard (each caller restores what it saw) turns the collector back on when the first build
    # ends while a second, started during it, is still inside TensorRT.
    second_in, first_done = threading.Event(), threading.Event()
    seen = {}

    def second_build() -> None:
        with gc_paused_for_tensorrt():
            second_in.set()
            first_done.wait(10)
            seen["second, after the first ended"] = gc.isenabled()

    with gc_paused_for_tensorrt():
        t = threading.Thread(target=second_build)
        t.start()
        assert second_in.wait(10)
    first_done.set()
    t.join()
    assert seen == {"second, after the first ended": False} and gc.isenabled()
