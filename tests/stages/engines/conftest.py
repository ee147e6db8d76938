"""Fixtures of the build-stage tests: zoo graphs in every precision, made once per session."""

from __future__ import annotations

import pytest

from tests.stages.engines.build_graphs import zoo_graph


@pytest.fixture(scope="session")
def zoo(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("zoo")
    return lambda name, precision="fp32": zoo_graph(name, precision, folder)
