"""How `kiln serve` answers a request the engine fails on: the request's own fault (ONNX Runtime's INVALID_ARGUMENT
for an index past a table, Kiln's input check) is the client's error, HTTP 400; any other failure the server's, 500.
A real ONNX Runtime engine raises the errors; no server is started."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kiln.serve.batching import padded_infer, request_fault
from kiln.serve.server import BatchFailed, RequestRefused, engine_failure
from kiln.stages.engines.config import BuildConfig
from kiln.stages.engines.registry import load_engine
from kiln.stages.engines.stage import build_direct


@pytest.fixture(scope="module")
def lookup_engine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real ONNX Runtime CPU engine of a table lookup: ``Gather`` of 17 rows by a float feature ``code``
    [batch, 1] cast to an index and doubled inside the graph, an index no input's range records (the engine's own
    check does not follow a product)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    folder = tmp_path_factory.mktemp("lookup")
    table = numpy_helper.from_array(np.arange(34, dtype=np.float32).reshape(17, 2), "table")
    graph = helper.make_graph(
        [
            helper.make_node("Cast", ["code"], ["code_id"], to=TensorProto.INT64),
            helper.make_node("Mul", ["code_id", "two"], ["ids"]),
            helper.make_node("Gather", ["table", "ids"], ["y"]),
        ],
        "lookup",
        [helper.make_tensor_value_info("code", TensorProto.FLOAT, ["batch", 1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 1, 2])],
        [table, numpy_helper.from_array(np.array(2, np.int64), "two")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), folder / "m.onnx")
    build_direct(folder / "m.onnx", folder / "engine", "onnxruntime", "cpu", None, BuildConfig())
    return folder / "engine"


def _failure(engine_dir: Path, codes: list[float]) -> Exception:
    """The engine's own exception on a batch of ``codes``, as the server runs it."""
    with load_engine(engine_dir) as runner:
        assert padded_infer(runner, {"code": np.array([[3]], np.float32)}, None)["y"].shape == (
            1,
            1,
            2,
        )  # a good id runs
        with pytest.raises(Exception) as raised:
            padded_infer(runner, {"code": np.array([[c] for c in codes], np.float32)}, None)
    return raised.value


def test_an_index_past_the_table_is_the_requests_fault(lookup_engine: Path) -> None:
    """ONNX Runtime's INVALID_ARGUMENT on an index out of the Gather's bounds was answered as the engine failing
    (HTTP 500); it is the request that is wrong (HTTP 400), and the answer says ONNX Runtime's reason in Kiln's words
    (the engine's InputError: the node, the index, the table's rows)."""
    exc = _failure(lookup_engine, [1.0, 17.0])
    assert request_fault(exc)
    answer = engine_failure(exc)
    assert isinstance(answer, RequestRefused) and not isinstance(answer, BatchFailed)
    assert "(Gather) got index 34, outside the 17 rows" in str(answer), answer


def test_other_engine_failures_stay_the_servers() -> None:
    """An engine that fails for its own reasons (out of memory, a broken kernel) answers HTTP 500, as before."""
    exc = RuntimeError("[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Failed to allocate memory")
    assert not request_fault(exc)
    answer = engine_failure(exc)
    assert isinstance(answer, BatchFailed) and "the engine failed on this batch: RuntimeError" in str(answer)
