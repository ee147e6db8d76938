"""Shared fixtures: tiny configs that run the real pipeline in seconds."""

from __future__ import annotations

import gc
import importlib.util
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# PyTorch on one thread, here and in every process a test starts (kiln commands, benchmark scripts, servers): the
# models are tiny, and on a 2-core machine shared with other work a second OpenMP thread mostly waits for a core
# (CI runs the suite at a load average of 8). Set before torch is imported; an explicit OMP_NUM_THREADS wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import onnxruntime.transformers  # noqa: E402, F401 - see below
import pytest  # noqa: E402
import torch  # noqa: E402
import torch._inductor.codecache  # noqa: E402, F401 - see below

from kiln.core.ownership import inductor_cache_dir  # noqa: E402

# Inductor's cache stays in torch's own folder for the whole session, runs included, as for a user who sets
# TORCHINDUCTOR_CACHE_DIR (here and in the processes tests start): in a run's scratch every compile inside a run
# would start cold, its precompiled header built again with g++ for every torch engine. Imported now, Inductor's
# headers' folder is taken from the system's temporary folder too.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", inductor_cache_dir())

# onnxruntime.transformers appends its own folder to sys.path when first imported (its optimizer then imports
# `fusion_options` as a top-level module). Imported here, before any test snapshots and restores sys.path
# (monkeypatch.syspath_prepend), so the entry survives and the tests do not depend on their order.
from kiln.pipeline.config import KilnConfig, config_from_dict  # noqa: E402

HAS_TRT = any(importlib.util.find_spec(m) is not None for m in ("tensorrt", "tensorrt_rtx"))


def _build_the_exporters_op_table_once() -> None:
    """``torch.onnx.export`` (dynamo) builds its table of ONNX functions for ATen ops at every call, reading and
    parsing the source of some 500 onnxscript functions: much of a tiny model's export, and the suite exports many
    models in this process. Built once per opset here; every export still gets a table of its own (a copy: the
    exporter adds a user's custom ops to it), with the same entries a fresh build gives."""
    try:
        from torch.onnx._internal.exporter import _constants, _registration
    except ImportError:  # another torch: exports build their own table, as they do for users
        return
    build = _registration.ONNXRegistry.from_torchlib.__func__
    built: dict[tuple[type, int], Any] = {}

    def from_torchlib(cls: type, opset_version: int = _constants.TORCHLIB_OPSET) -> Any:
        if (cls, opset_version) not in built:
            built[cls, opset_version] = build(cls, opset_version)
        table = cls()
        table._opset_version = built[cls, opset_version]._opset_version
        table.functions = {op: list(decomps) for op, decomps in built[cls, opset_version].functions.items()}
        return table

    _registration.ONNXRegistry.from_torchlib = classmethod(from_torchlib)


_build_the_exporters_op_table_once()


def tiny_config_dict(**overrides: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "name": "tiny",
        "model": {"name": "cnn", "params": {"width": 8, "depth": 2}},
        "train": {"epochs": 2, "batch_size": 128},
        "signature": {"batch_sizes": [1, 8]},
        "validate": {"warmup": 1, "iterations": 3, "max_samples": 128},
        "build": {"backends": ["onnxruntime"]},
        "precision": {"variants": ["fp32"]},
    }
    for dotted, value in overrides.items():
        node = cfg
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return cfg


def stage_context(name: str, config: KilnConfig, workdir: Path, out: Path, inputs: dict[str, Path], **kw: Any) -> Any:
    """The context the runner hands stage ``name``: its declared settings of ``config``, not the whole config."""
    from kiln.core.stage import StageContext
    from kiln.pipeline.runner import settings_for
    from kiln.pipeline.stage_list import stage_named

    return StageContext(name, settings_for(stage_named(name), config), workdir, out, inputs, **kw)


@pytest.fixture
def tiny_config() -> KilnConfig:
    return config_from_dict(tiny_config_dict())


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    """Every test starts on one intra-op thread (a test that sets more, for what it checks, gets one again)."""
    torch.set_num_threads(1)


_PRISTINE = (logging.getLogger("kiln").level, list(logging.getLogger("kiln").handlers))


@pytest.fixture(autouse=True)
def _kiln_logger() -> Iterator[None]:
    """A CLI call in-process sets Kiln's logger (level, handler, no propagation), in a test or in a module-scoped
    fixture before it: every test starts and ends with the logger as it was before any CLI call, so ``caplog`` sees
    Kiln's records whatever ran before."""
    logger = logging.getLogger("kiln")

    def reset() -> None:
        logger.setLevel(_PRISTINE[0])
        logger.handlers[:], logger.propagate = list(_PRISTINE[1]), True

    reset()
    yield
    reset()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Every object alive once the tests are imported (torch's, ONNX's and the other libraries' modules: millions)
    moves to the collector's permanent generation (``gc.freeze``): each collection then scans only what the tests
    made since, not all of that again, and code under test collects at times (the TensorRT builds' guard, the
    memory tests). Nothing frozen is garbage yet: it is what the imports keep."""
    gc.collect()
    gc.freeze()


# Memory one test worker may need at its peak (a worker's imports, a `kiln run` it starts, a server it holds).
WORKER_MEMORY = 2 << 30


def auto_workers(cores: int, load: float, available: int, memory: int = WORKER_MEMORY) -> int:
    """How many workers ``-n auto`` starts: one per core on a quiet machine; on a busy one (a 1-minute load average
    above the cores), one per runnable process up to four per core, so the suite gets the share of the CPU it would
    have had idle rather than 2 of ``load + 2`` slices; never more than the free memory holds at ``memory`` each."""
    wanted = cores if load <= cores + 1 else min(4 * cores, int(load + 0.5))
    return max(1, min(wanted, available // memory))


# A slow test's peak: a whole `kiln run` of a transformers model, a server with its stubs, or a Ray cluster.
SLOW_WORKER_MEMORY = 3 << 30


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # optional: pytest without xdist runs the tests in-process
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist's own hook reads it
    cores = len(os.sched_getaffinity(0))
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    fast = "not slow" in (config.option.markexpr or "")
    # The slow tests start process trees of their own (kiln runs, servers, a Ray cluster): more memory per worker.
    return auto_workers(cores, os.getloadavg()[0], free, WORKER_MEMORY if fast else SLOW_WORKER_MEMORY)


# Folders whose every test is slow: whole runs of `kiln` and the benchmark scripts (run by .ci/run's second step).
SLOW_FOLDERS = ("e2e", "benchmarks")


# The test files this session collected, before any deselection, when it collected the whole of testpaths: what
# tests/test_collection.py checks (else it asks a `pytest --collect-only` of its own).
COLLECTED: set[str] = set()


@pytest.hookimpl(tryfirst=True)  # before `-m "not slow"` deselects
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tests = Path(__file__).parent
    whole = config.args_source == pytest.Config.ArgsSource.TESTPATHS
    if whole and not (config.option.ignore or config.option.ignore_glob):
        COLLECTED.update(item.path.relative_to(tests.parent).as_posix() for item in items)
    for item in items:
        if item.path.relative_to(tests).parts[0] in SLOW_FOLDERS:
            item.add_marker(pytest.mark.slow)
        if _shares_a_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.path.relative_to(tests).as_posix()))
    items[:] = longest_first(items)
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; none is visible")
    skip_trt = pytest.mark.skip(reason="needs the tensorrt or tensorrt_rtx Python package (pip install 'kiln[rtx]')")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if "tensorrt" in item.keywords and not HAS_TRT:
            item.add_marker(skip_trt)


def longest_first(items: list[pytest.Item]) -> list[pytest.Item]:
    """The tests marked ``long`` first, with every test of their xdist group, the rest in collection order. xdist
    hands out tests in collection order, so a long test collected last (tests/test_install.py) would start when the
    others are done and the step would wait for it alone; started first, the short tests fill in around it."""
    groups = {_group(i) for i in items if i.get_closest_marker("long")}
    return sorted(items, key=lambda i: _group(i) not in groups)  # stable: collection order within each part


def _group(item: pytest.Item) -> str:
    marker = item.get_closest_marker("xdist_group")
    return marker.args[0] if marker else item.nodeid


def _shares_a_module_fixture(item: pytest.Item) -> bool:
    """Does ``item`` use a fixture made once per module or class (a server, a pipeline run)? pytest-xdist's
    ``loadgroup`` (pyproject.toml) then runs its module's tests on one worker, so the fixture is made once, not once
    per worker; every other test goes to whichever worker is free."""
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.values() if info else []
    return any(d.scope in ("module", "class") for group in defs for d in group)


@pytest.fixture
def write_yaml(tmp_path: Path):
    import yaml

    def _write(data: dict[str, Any], name: str = "kiln.yaml") -> Path:
        p = tmp_path / name
        p.write_text(yaml.safe_dump(data))
        return p

    return _write
