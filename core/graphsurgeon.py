"""onnx-graphsurgeon as Kiln uses it: ``from kiln.core.graphsurgeon import gs``.

onnx-graphsurgeon logs through its own ``G_LOGGER``, which prints to stdout, where Kiln writes only results (a
pipe reading ``kiln optimize``'s answer would get ``[W] ...`` lines with it). Importing this module sends that
logger's messages to the Python logger ``onnx_graphsurgeon`` instead: on stderr, at their own level, through the
CLI's handler and its ``--verbose`` levels. The passes import onnx-graphsurgeon lazily, but only ever run on a
graph that a module importing this one made, so every message onnx-graphsurgeon logs for Kiln goes this way.
"""

from __future__ import annotations

import logging
from typing import Any

import onnx_graphsurgeon as gs
from onnx_graphsurgeon.logger import G_LOGGER, LogMode

__all__ = ["gs"]

log = logging.getLogger("onnx_graphsurgeon")


def _log(message: Any, severity: int, mode: LogMode = LogMode.EACH, stack_depth: int = 2) -> None:
    """``G_LOGGER.log`` (same arguments, the same severity threshold and log-once rule) into Python logging."""
    if severity < G_LOGGER.severity:
        return
    if mode == LogMode.ONCE:
        if hash(message) in G_LOGGER.once_logged:
            return
        G_LOGGER.once_logged.add(hash(message))
    level = severity if severity >= logging.INFO else logging.DEBUG  # gs's INFO..CRITICAL are logging's numbers
    if log.isEnabledFor(level):
        log.log(level, "%s", message() if callable(message) else message)


G_LOGGER.log = _log  # every module of onnx-graphsurgeon logs through this one instance
