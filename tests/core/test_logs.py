"""The stage warnings said once per run (their child loggers' too, the server's each time), and the root logger's
handlers kept across a library's ``logging.warning()``."""

from __future__ import annotations

import logging

import pytest

from kiln.core.logs import root_handlers_kept, warnings_said_once


def test_a_stage_warning_is_said_once_in_the_block_and_the_servers_each_time() -> None:
    heard: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: heard.append(f"{record.name}: {record.getMessage()}")  # type: ignore[method-assign]
    names = ("kiln.build.tensorrt", "kiln.validate", "kiln.serve.server")
    for name in names:
        logging.getLogger(name).addHandler(handler)
    try:
        with warnings_said_once():
            for _ in range(2):
                for name in names:
                    logging.getLogger(name).warning("said")
        logging.getLogger("kiln.validate").warning("said")  # after the block: said again
    finally:
        for name in names:
            logging.getLogger(name).removeHandler(handler)
    assert heard == [
        "kiln.build.tensorrt: said",
        "kiln.validate: said",
        "kiln.serve.server: said",
        "kiln.serve.server: said",
        "kiln.validate: said",
    ]


def test_a_libraries_basic_config_is_taken_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    monkeypatch.setattr(logging.getLogger(), "level", logging.CRITICAL)  # basicConfig's handler prints nothing here
    with root_handlers_kept():
        logging.warning("a library's module-level warning")
        assert logging.getLogger().handlers  # basicConfig gave the root logger a handler
    assert logging.getLogger().handlers == []
