"""onnx-graphsurgeon's logger, as Kiln imports the library: Python logging (stderr), never print to stdout."""

from __future__ import annotations

import logging

from onnx_graphsurgeon.logger import G_LOGGER, LogMode

import kiln.core.graphsurgeon  # noqa: F401  (routes the logger)


def test_its_messages_reach_python_logging_at_their_level_and_stdout_gets_none(capsys, caplog, monkeypatch) -> None:
    monkeypatch.setattr(G_LOGGER, "once_logged", set())
    with caplog.at_level(logging.DEBUG, logger="onnx_graphsurgeon"):
        G_LOGGER.warning("a warning")
        G_LOGGER.info(lambda: "an info, built only when logged")
        G_LOGGER.debug("below the logger's own severity (INFO): dropped")
        with G_LOGGER.suppress():
            G_LOGGER.error("suppressed by gs's own context manager")
        for _ in range(2):
            G_LOGGER.warning("said once", mode=LogMode.ONCE)
    assert capsys.readouterr().out == ""
    logged = [(r.name, r.levelno, r.getMessage()) for r in caplog.records]
    assert logged == [
        ("onnx_graphsurgeon", logging.WARNING, "a warning"),
        ("onnx_graphsurgeon", logging.INFO, "an info, built only when logged"),
        ("onnx_graphsurgeon", logging.WARNING, "said once"),
    ]
