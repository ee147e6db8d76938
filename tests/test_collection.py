"""Every test file is collected (pytest skips folders named 'build' by default); ``-m ""`` lists the slow tests too,
which the README's command deselects and .ci/run's second step runs. A session that collected the whole of
testpaths (as .ci/run's) already holds the answer (``tests.conftest.COLLECTED``, taken before deselection); another
(one file, a folder) asks a ``pytest --collect-only`` of its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import COLLECTED

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_every_test_file_is_collected() -> None:
    collected = set(COLLECTED)
    if not collected:
        out = subprocess.run(
            [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", ""],
            cwd=ROOT,
            capture_output=True,
            text=True,
        ).stdout
        collected = {line.split("::")[0] for line in out.splitlines() if "::" in line}
    files = {p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").rglob("test_*.py")}
    assert files - collected == set()


@pytest.fixture(scope="module")
def _made_once_per_module() -> int:
    return os.getpid()


def test_tests_sharing_a_module_fixture_run_on_one_worker(
    request: pytest.FixtureRequest, _made_once_per_module: int
) -> None:
    """tests/conftest.py puts every test that uses a module-scoped fixture in its file's pytest-xdist group; xdist
    marks the group in the test's id, and only then sends the file's tests to one worker (pytest 9.2 ignores that mark:
    pyproject.toml pins pytest below 9.2)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        pytest.skip("runs in this process (-n0): no workers to group tests on")
    assert request.node.nodeid.endswith("@test_collection.py"), request.node.nodeid


@pytest.mark.parametrize(
    ("cores", "load", "free_gib", "workers"),
    [
        (2, 0.3, 20, 2),  # quiet: one per core
        (2, 3.0, 20, 2),  # a little busy: still one per core
        (2, 9.2, 12, 6),  # busy: one per runnable process, as far as memory goes (12 GiB / 2 GiB)
        (2, 9.2, 64, 8),  # ... and up to four per core
        (16, 40.0, 256, 40),
        (2, 0.0, 1, 1),  # at least one
    ],
)
def test_auto_workers_take_the_cpu_share_of_a_busy_machine(cores: int, load: float, free_gib: int, workers: int):
    from tests.conftest import auto_workers

    assert auto_workers(cores, load, free_gib << 30) == workers


def test_the_slow_step_takes_workers_by_load_as_its_memory_allows(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from tests.conftest import pytest_xdist_auto_num_workers

    monkeypatch.delenv("PYTEST_XDIST_AUTO_NUM_WORKERS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: {0, 1})
    monkeypatch.setattr(os, "getloadavg", lambda: (9.0, 9.0, 9.0))
    monkeypatch.setattr(os, "sysconf", lambda name: 1 << 20 if name == "SC_AVPHYS_PAGES" else 4096)  # 4 GiB free

    def workers(markexpr: str) -> int:
        return pytest_xdist_auto_num_workers(SimpleNamespace(option=SimpleNamespace(markexpr=markexpr)))

    assert workers("not slow") == 2  # the README's command: by load, here as far as 4 GiB holds
    monkeypatch.setattr(os, "sysconf", lambda name: 1 << 22 if name == "SC_AVPHYS_PAGES" else 4096)  # 16 GiB
    assert workers("not slow") == 8
    assert workers("slow") == 5 and workers("") == 5  # the slow step: by load too, 3 GiB each
    monkeypatch.setattr(os, "sysconf", lambda name: 1 << 23 if name == "SC_AVPHYS_PAGES" else 4096)  # 32 GiB
    assert workers("slow") == 8
    monkeypatch.setattr(os, "getloadavg", lambda: (0.5, 0.5, 0.5))
    assert workers("slow") == 2 and workers("not slow") == 2  # quiet: one per core


def test_long_tests_and_their_groups_start_first_the_rest_in_collection_order() -> None:
    from types import SimpleNamespace

    from tests.conftest import longest_first

    def item(nodeid: str, *marks: tuple[str, tuple]) -> SimpleNamespace:
        found = {name: SimpleNamespace(args=args) for name, args in marks}
        return SimpleNamespace(nodeid=nodeid, get_closest_marker=found.get)

    grouped = ("xdist_group", ("e2e/test_byom.py",))
    items = [
        item("a"),
        item("b", grouped),
        item("c", ("long", ())),
        item("d"),
        item("e", grouped, ("long", ())),
        item("f", grouped),
    ]
    assert [i.nodeid for i in longest_first(items)] == ["b", "c", "e", "f", "a", "d"]
