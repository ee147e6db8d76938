"""The collector stays out of TensorRT's logger callbacks (a collection there deadlocked a test run:
a builder kept in a reference cycle was freed inside TensorRT-RTX's createInferBuilder, under its mutex)."""

import gc
import threading

import pytest

from kiln.stages.engines.tensorrt.errors import gc_pause_held, gc_paused_for_tensorrt


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


def test_a_held_pause_collects_once_for_several_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    collections: list[int] = []
    real = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *a: collections.append(1) or real(*a))
    with gc_pause_held():
        assert collections == [] and gc.isenabled()  # nothing built yet: no collection, the collector on
        for _ in range(3):
            with gc_paused_for_tensorrt():
                assert not gc.isenabled()
            assert not gc.isenabled()  # off between the builds, as inside them
    assert collections == [1] and gc.isenabled()
    with gc_paused_for_tensorrt():  # outside the block, a build pauses (and collects) on its own again
        pass
    assert collections == [1, 1] and gc.isenabled()


def test_a_held_pause_ends_with_its_block_after_an_error() -> None:
    with pytest.raises(RuntimeError):
        with gc_pause_held():
            with gc_paused_for_tensorrt():
                raise RuntimeError("build failed")
    assert gc.isenabled()
