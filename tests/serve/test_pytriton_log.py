"""`kiln serve --pytriton`'s log: a refused request (the client's error) is one line, not PyTriton's traceback; an
engine failure keeps its traceback; a server that exits on a stop signal is no warning. No server is started here."""

from __future__ import annotations

import logging
import signal
import traceback
from typing import Any

import numpy as np
import pytest

from kiln.serve.server import BatchFailed, RequestRefused, _filter_pytriton_log, _infer_func, _StopRequest

# What PyTriton's inference handler logs for an error of the infer function (pytriton/proxy/inference.py)
PYTRITON_SAYS = "Exception while performing inference on requests=%s: %s"


def _logged_while_handling(error: Exception, caplog: pytest.LogCaptureFixture) -> logging.LogRecord:
    """``error`` raised and logged as PyTriton's handler logs it, inside its ``except`` block."""
    logger = logging.getLogger("pytriton.proxy.inference")
    caplog.clear()
    try:
        raise error
    except Exception:
        logger.warning(PYTRITON_SAYS, "0001", traceback.format_exc())
    (record,) = caplog.records
    return record


def test_a_refused_request_is_one_line_and_an_engine_failure_keeps_its_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    remove = _filter_pytriton_log(_StopRequest())
    try:
        with caplog.at_level(logging.DEBUG):
            refused = _logged_while_handling(RequestRefused("input 'cat_id' holds 10: takes 0 to 9"), caplog)
            assert (refused.levelno, refused.getMessage()) == (
                logging.WARNING,
                "refused a request: input 'cat_id' holds 10: takes 0 to 9",
            )
            in_a_batch = RequestRefused("input 'cat_id' holds 10: takes 0 to 9")
            in_a_batch.requests = 3  # run again a request at a time: the refused one then says it
            assert _logged_while_handling(in_a_batch, caplog).levelno == logging.DEBUG
            failed = _logged_while_handling(BatchFailed("the engine failed on this batch: RuntimeError: x"), caplog)
            assert failed.levelno == logging.WARNING and "Traceback" in failed.getMessage()
    finally:
        remove()
    with caplog.at_level(logging.DEBUG):  # the filter is gone with its server
        assert "Traceback" in _logged_while_handling(RequestRefused("x"), caplog).getMessage()


def test_a_refusal_says_how_many_requests_its_batch_held() -> None:
    pytest.importorskip("pytriton", reason="needs the serving libraries (pip install 'kiln[serve]')")
    from pytriton.proxy.types import Request

    class Meta:
        def refusal(self, inputs: dict[str, Any]) -> str | None:
            return "input 'ids' holds 10" if (inputs["ids"] > 9).any() else None

    infer = _infer_func(None, {}, None, Meta())  # type: ignore[arg-type]
    requests = [Request(data={"ids": np.array([v])}) for v in (1, 10)]
    with pytest.raises(RequestRefused, match="holds 10") as refused:
        infer(requests)
    assert refused.value.requests == 2


def test_a_server_that_exits_on_a_stop_is_no_warning(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("pytriton.server.triton_server")
    stop = _StopRequest()
    remove = _filter_pytriton_log(stop)
    try:
        with caplog.at_level(logging.DEBUG):
            logger.warning("Triton Inference Server exited with failure. Please wait.")  # no stop: a failure
            stop(signal.SIGINT, None)
            logger.warning("Triton Inference Server exited with failure. Please wait.")
    finally:
        remove()
    assert [r.levelno for r in caplog.records] == [logging.WARNING, logging.DEBUG]
