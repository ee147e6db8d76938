"""EngineMetadata.index_floors: an engine refuses an index below the start of an axis of no fixed size."""

from __future__ import annotations

import numpy as np

from kiln.core.records import EngineMetadata, first_below


def test_a_negative_node_id_is_refused_naming_where_it_lies() -> None:
    meta = EngineMetadata.model_construct(name="gcn", index_floors={"edge_index": 0}, index_ranges={})
    edges = np.zeros((1, 2, 5), np.int64)
    assert meta.outside_values({"edge_index": edges}) is None
    edges[0, 1, 3] = -1
    assert meta.outside_values({"edge_index": edges}) == (
        "input 'edge_index' holds -1 at edge_index[0, 1, 3]: engine gcn takes values from 0 there (positions along "
        "an axis it indexes: a graph's nodes, counted from 0)"
    )


def test_floats_are_held_as_a_cast_truncates_them_and_empty_inputs_pass() -> None:
    assert first_below({"t": 0}, {"t": np.array([-0.5, 3.0], np.float32)}) is None
    assert first_below({"t": 0}, {"t": np.array([np.nan, -1.5], np.float32)}) == ("t", -1.5, (1,), 0)
    assert first_below({"t": 0}, {"t": np.zeros((0, 3), np.int64)}) is None


def test_an_engine_recorded_before_floors_loads_without_any() -> None:
    fields = EngineMetadata.model_fields
    assert fields["index_floors"].is_required() is False
    assert EngineMetadata.model_construct(name="old").index_floors == {}
