"""The exporters kept quiet (:func:`kiln.stages.export.quiet.quiet_torch`): the traceback torch logs at ERROR where a
guard fails (one name on axes of different sizes) reaches Kiln's debug log, not torch's handlers on the terminal."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from kiln.stages.export.quiet import quiet_torch


class _Spy(logging.Handler):
    """Stands in for torch's own handler, which writes to the terminal."""

    def __init__(self) -> None:
        super().__init__()
        self.heard: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.heard.append(record.getMessage())


class _Pool(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean((2, 3))


def test_a_failed_guard_s_traceback_goes_to_the_debug_log(caplog: pytest.LogCaptureFixture) -> None:
    spies = {name: _Spy() for name in ("torch", "torch._dynamo")}
    for name, spy in spies.items():
        logging.getLogger(name).addHandler(spy)
    frames = torch.export.Dim("frames")
    before = {name: list(logging.getLogger(name).handlers) for name in ("torch", "torch._dynamo", "torch._guards")}
    try:
        with caplog.at_level(logging.DEBUG, logger="kiln.export"), quiet_torch():
            with pytest.raises(Exception, match="is not equal to"):  # the exporter's own error says why
                shapes = ({2: frames, 3: frames},)
                torch.export.export(_Pool(), (torch.zeros(1, 3, 4, 6),), dynamic_shapes=shapes, strict=True)
        after = {name: list(logging.getLogger(name).handlers) for name in before}
    finally:
        for name, spy in spies.items():
            logging.getLogger(name).removeHandler(spy)
    assert not any(spy.heard for spy in spies.values()), {n: s.heard[:1] for n, s in spies.items()}
    debug = "\n".join(r.getMessage() for r in caplog.records if r.name == "kiln.export")
    assert "torch._guards" in debug and "ConstraintViolationError" in debug, debug[-2000:]
    assert after == before and logging.getLogger("torch._guards").propagate, "torch's loggers restored"
