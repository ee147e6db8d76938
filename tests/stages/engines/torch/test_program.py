"""The compiled flavour's program at load (kiln.stages.engines.torch.program): what the recorded builder settings
make of it, without compiling (torch.compile compiles at the first call)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.stages.engines.torch.build import PROGRAM
from kiln.stages.engines.torch.program import compile_program

torch = pytest.importorskip("torch")


def test_a_loaded_engine_adopts_the_algorithms_its_build_recorded(tmp_path: Path, monkeypatch) -> None:
    """``gemm_algorithm_choices`` as kiln-engine.json holds it (after a JSON round trip) reaches the binding when the
    program is compiled for a load; an engine built with the heuristic adopts nothing."""
    from kiln.stages.engines.torch import cublaslt

    model = torch.nn.Sequential(torch.nn.Linear(16, 4)).eval()
    torch.export.save(torch.export.export(model, (torch.randn(3, 16),)), str(tmp_path / PROGRAM))
    recorded = {"gpu": "NVIDIA H200", "cublaslt": 130100, "algorithms": {"4096,768,768,2,4,2,2": 3}}
    adopted = []
    monkeypatch.setattr(cublaslt, "adopt", adopted.append)
    settings = {"gemm_epilogues": "bias", "gemm_algorithms": "measured", "gemm_algorithm_choices": recorded}
    compile_program(tmp_path / PROGRAM, json.loads(json.dumps(settings)))
    assert adopted == [recorded]
    compile_program(tmp_path / PROGRAM, {**settings, "gemm_algorithms": "heuristic"})
    assert len(adopted) == 1
