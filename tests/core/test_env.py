"""The device's facts in cache keys: asked of torch once, then read back from the workdir's cache while what
decides them (this boot, the interpreter, torch, the driver, the GPU-selecting variables) stays the same."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kiln.core import env


@pytest.fixture(autouse=True)
def _facts_not_kept() -> Iterator[None]:
    yield
    env.keep_facts_in(None)


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    asked: list[int] = []
    real = env._torch_facts

    def torch_facts() -> dict[str, Any]:
        asked.append(1)
        return real()

    monkeypatch.setattr(env, "_torch_facts", torch_facts)
    return asked


def test_facts_are_asked_of_torch_once_then_read_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if env._identity() is None:
        pytest.skip("this system has no boot id to key the facts by: they are asked of torch every time")
    asked = _counting(monkeypatch)
    env.keep_facts_in(tmp_path / "cache")
    first = env.device_facts()
    env.keep_facts_in(tmp_path / "cache")  # a new process, as far as the in-memory cache goes
    assert env.device_facts() == first and len(asked) == 1
    assert (tmp_path / "cache" / env.FACTS_FILE).is_file()


def test_a_variable_that_selects_gpus_asks_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if env._identity() is None:
        pytest.skip("this system has no boot id to key the facts by")
    asked = _counting(monkeypatch)
    env.keep_facts_in(tmp_path)
    env.device_facts()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    env.keep_facts_in(tmp_path)
    env.device_facts()
    assert len(asked) == 2


@pytest.mark.parametrize("damage", ["garbage", '{"identity": 1}', "[]"])
def test_a_damaged_file_is_asked_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str) -> None:
    asked = _counting(monkeypatch)
    (tmp_path / env.FACTS_FILE).write_text(damage)
    env.keep_facts_in(tmp_path)
    assert env.device_facts()["machine"] and len(asked) == 1


def test_nothing_is_written_without_a_folder_or_through_a_link(tmp_path: Path) -> None:
    env.keep_facts_in(None)
    env.device_facts()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "cache").symlink_to(tmp_path / "elsewhere")
    env.keep_facts_in(tmp_path / "cache")
    env.device_facts()
    assert not any((tmp_path / "elsewhere").iterdir())
