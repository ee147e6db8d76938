"""The load test's requests: the run's validation data for every engine whose inputs they cover, random arrays
(said so, with the reason) for the others. No server: the pool is made before the first request."""

from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from kiln.core.data import feed_for_graph, take
from kiln.models.registry import build_model, load_dataset
from kiln.pipeline.config import config_from_dict
from kiln.serve.loadtest import Collections, CpuMeter, merged_collections, merged_cpu, request_pool, tail_windows
from kiln.serve.server import ServedEngine
from kiln.stages.engines.backend import read_metadata
from kiln.stages.engines.config import BuildConfig
from kiln.stages.engines.stage import build_direct
from kiln.stages.export.torch_export import export_onnx

# model -> the data functions whose validation inputs fit it
MODELS = {
    "tests.user_models:two_in": ["tests.user_models:two_in_data"],
    "tests.user_models:ids_and_mask": ["tests.user_models:ids_and_mask_data"],
    "tests.user_models:three_in": ["tests.user_models:three_in_data"],
}


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ServedEngine]:
    """One ONNX Runtime CPU engine per multi-input model, exported from its own data's first rows."""
    out = {}
    for model, (data, *_) in MODELS.items():
        folder = tmp_path_factory.mktemp(model.rpartition(":")[2])
        example = take(load_dataset(data).val_x, slice(0, 2))
        export_onnx(build_model(model), example, folder / "m.onnx")
        build_direct(folder / "m.onnx", folder / "engine", "onnxruntime", "cpu", None, BuildConfig())
        out[model] = ServedEngine(model, folder / "engine", read_metadata(folder / "engine"))
    return out


def config(model: str, data: str, **params: object):
    return config_from_dict({"model": {"name": model}, "data": {"name": data, "params": params}})


@pytest.mark.parametrize("model", sorted(MODELS))
def test_every_engine_the_data_covers_gets_the_real_validation_data(
    engines: dict[str, ServedEngine], model: str
) -> None:
    data = MODELS[model][0]
    pool, source = request_pool(engines[model], config(model, data))
    assert source.startswith("real validation data") and "RANDOM" not in source
    names = [s.name for s in engines[model].meta.inputs]
    want = feed_for_graph(load_dataset(data).val_x, names)
    assert len(pool) == len(next(iter(want.values())))
    for i, feed in enumerate(pool):
        for s in engines[model].meta.inputs:
            assert feed[s.name].dtype == np.dtype(s.dtype)
            np.testing.assert_array_equal(feed[s.name][0], want[s.name][i].astype(s.dtype))


def test_data_as_a_tuple_in_the_forwards_order_is_taken_by_position(engines: dict[str, ServedEngine]) -> None:
    model = "tests.user_models:two_in"
    _, source = request_pool(engines[model], config(model, "tests.user_models:two_in_data", as_tuple=True))
    assert source.startswith("real validation data")


@pytest.mark.parametrize("model", sorted(MODELS))
def test_data_that_does_not_fit_an_engine_gives_random_inputs_said_as_such(
    engines: dict[str, ServedEngine], model: str, caplog: pytest.LogCaptureFixture
) -> None:
    other = next(d for m, ds in MODELS.items() if m != model for d in ds)  # another model's data
    pool, source = request_pool(engines[model], config(model, other))
    assert source.startswith("RANDOM") and len(pool) > 0
    assert any("RANDOM inputs" in r.getMessage() for r in caplog.records)
    assert all(pool[0][s.name].dtype == np.dtype(s.dtype) for s in engines[model].meta.inputs)


def test_random_inputs_take_the_largest_size_each_axis_was_validated_at(engines: dict[str, ServedEngine]) -> None:
    from kiln.core.records import TensorSpec

    engine = engines["tests.user_models:ids_and_mask"]
    specs = [
        TensorSpec(name="ids", shape=["batch", "src"], dtype="int64"),
        TensorSpec(name="dec", shape=["batch", "tgt"], dtype="int64"),
    ]
    meta = engine.meta.model_copy(update={"inputs": specs, "axis_ranges": {"src": [3, 9], "tgt": [2, 5]}})
    pool, source = request_pool(ServedEngine(engine.model_name, engine.engine_dir, meta), None)
    assert source.startswith("RANDOM") and pool[0]["ids"].shape == (1, 9) and pool[0]["dec"].shape == (1, 5)


def _workdir(tmp_path: Path, engines: dict[str, ServedEngine], names: list[str], chosen: str | None) -> Path:
    """A workdir as `kiln run` leaves it for the load test: packaged engines, validation's choice, and the config
    validation recorded (the three-input model's)."""
    import json
    import shutil

    wd = tmp_path / "wd"
    source = engines["tests.user_models:three_in"]
    for name in names:
        folder = wd / "package" / "engines" / name
        shutil.copytree(source.engine_dir, folder)
        sidecar = folder / "kiln-engine.json"
        sidecar.write_text(json.dumps({**json.loads(sidecar.read_text()), "name": name}))
    (wd / "validate").mkdir(parents=True)
    (wd / "validate" / "validation.json").write_text(json.dumps({"chosen": {"1": names[0], "32": chosen}}))
    recorded = {
        "seed": 0,
        "model": {"name": "tests.user_models:three_in"},
        "data": {"name": "tests.user_models:three_in_data"},
    }
    (wd / "validate" / "manifest.json").write_text(json.dumps({"key_parts": {"config": recorded}}))
    return wd


def test_the_model_defaults_to_the_only_engine_or_the_one_validation_chose(
    engines: dict[str, ServedEngine], tmp_path: Path
) -> None:
    from kiln.core.errors import ConfigError
    from kiln.serve.loadtest import default_model

    assert default_model(_workdir(tmp_path / "one", engines, ["onnxruntime-cpu-fp32"], None)) == "onnxruntime_cpu_fp32"
    two = ["onnxruntime-cpu-fp32", "onnxruntime-cpu-int8"]
    assert default_model(_workdir(tmp_path / "two", engines, two, "onnxruntime-cpu-int8")) == "onnxruntime_cpu_int8"
    with pytest.raises(ConfigError, match="serves 2 engines") as err:
        default_model(_workdir(tmp_path / "none", engines, two, "tensorrt-fp16"))  # chosen, but not served here
    assert "onnxruntime_cpu_fp32" in err.value.hint


def test_the_config_the_run_recorded_gives_its_validation_data(
    engines: dict[str, ServedEngine], tmp_path: Path
) -> None:
    from kiln.serve.loadtest import recorded_config

    wd = _workdir(tmp_path, engines, ["onnxruntime-cpu-fp32"], None)
    for path in (wd, wd / "package" / "engines" / "onnxruntime-cpu-fp32"):  # the workdir or an engine in it
        cfg = recorded_config(path)
        assert cfg is not None and cfg.data.name == "tests.user_models:three_in_data"
    _, source = request_pool(engines["tests.user_models:three_in"], recorded_config(wd))
    assert source.startswith("real validation data of dataset 'tests.user_models:three_in_data'"), source
    assert recorded_config(tmp_path / "elsewhere") is None


def test_a_load_test_of_a_workdir_sends_its_runs_data_not_random_requests(
    engines: dict[str, ServedEngine], tmp_path: Path
) -> None:
    """Without -c, `kiln loadtest -e WORKDIR` takes the data of the config the run recorded (the pool is made before
    the first request, so no server is needed to see it)."""
    import socket

    from click.testing import CliRunner

    from kiln.cli import main

    wd = _workdir(tmp_path, engines, ["onnxruntime-cpu-fp32"], None)
    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    out = CliRunner().invoke(main, ["loadtest", url, "-e", str(wd), "--duration", "1", "-o", str(tmp_path / "lt")])
    assert out.exit_code == 2 and "start the server first" in out.output, out.output
    assert "RANDOM" not in out.output and "no data given" not in out.output, out.output


@pytest.mark.parametrize(
    "spec,array,ok",
    [
        (("batch", 8), np.zeros((4, 8), np.float64), True),  # cast to the engine's float32
        (("batch", 6), np.zeros((4, 6), np.int32), True),  # int32 ids for an int64 input
        (("batch", 8), np.zeros((4, 9), np.float32), False),  # a fixed size differs
        (("batch", 8), np.zeros((4, 2, 8), np.float32), False),  # rank differs
        (("batch", "seq"), np.zeros((4, 5), np.float32), False),  # floats for integer ids
    ],
)
def test_fit_takes_arrays_the_engine_takes(spec: tuple, array: np.ndarray, ok: bool) -> None:
    from kiln.core.errors import ConfigError
    from kiln.core.records import TensorSpec
    from kiln.serve.loadtest import fit

    dtype = "int64" if array.dtype.kind == "i" or spec[1] == "seq" else "float32"
    tensor = TensorSpec(name="x", shape=list(spec), dtype=dtype)
    if ok:
        assert fit(tensor, array).dtype == np.dtype(dtype)
    else:
        with pytest.raises(ConfigError, match="the engine takes"):
            fit(tensor, array)


class _RefusingServer:
    """A client whose server takes ``accept`` shared-memory registrations, then refuses (as a server out of its
    limits would), and refuses the first ``busy`` unregistrations of each region (as Triton does while the requests
    that used it are being released); it records what is registered at any moment, and answers with it as
    ``tritonclient.http`` does."""

    def __init__(self, accept: int, busy: int = 0) -> None:
        self.accept, self.busy, self.registered, self.refusals = accept, busy, set(), {}

    def register_system_shared_memory(self, name: str, key: str, size: int) -> None:
        if len(self.registered) >= self.accept or name in self.registered:
            raise RuntimeError("refused" if name not in self.registered else f"region '{name}' already in manager")
        self.registered.add(name)

    def unregister_system_shared_memory(self, name: str) -> None:
        if self.refusals.setdefault(name, 0) < self.busy:
            self.refusals[name] += 1
            raise RuntimeError(f"Cannot unregister shared memory region '{name}', it is currently in use.")
        self.registered.discard(name)

    def get_system_shared_memory_status(self) -> list[dict]:
        return [{"name": name} for name in sorted(self.registered)]


def test_shared_memory_laid_out_halfway_leaves_no_region() -> None:
    pytest.importorskip("tritonclient.http", reason="needs the serving libraries (pip install 'kiln[serve]')")
    import tritonclient.http as module

    from kiln.serve.loadtest import SharedMemory

    pool = [{"x": np.full((1, 4), i, np.float32)} for i in range(3)]
    expected = [{"y": np.zeros((1, 2), np.float32)} for _ in pool]
    before = set(Path("/dev/shm").glob("kiln_*"))
    server = _RefusingServer(accept=2)  # the inputs and the first thread's answers, then no more
    with pytest.raises(RuntimeError, match="refused"):
        SharedMemory(module, server, pool, expected, threads=4)
    assert server.registered == set() and set(Path("/dev/shm").glob("kiln_*")) == before
    regions = SharedMemory(module, _RefusingServer(accept=10), pool, expected, threads=2)
    assert len(regions.handles) == 3  # one for the pool, one per thread
    regions.close()
    assert set(Path("/dev/shm").glob("kiln_*")) == before


def test_regions_the_server_still_holds_are_unregistered_and_a_new_set_takes_new_names() -> None:
    pytest.importorskip("tritonclient.http", reason="needs the serving libraries (pip install 'kiln[serve]')")
    import tritonclient.http as module

    from kiln.serve.loadtest import SharedMemory

    pool = [{"x": np.full((1, 4), i, np.float32)} for i in range(2)]
    expected = [{"y": np.zeros((1, 2), np.float32)} for _ in pool]
    before = set(Path("/dev/shm").glob("kiln_*"))
    server = _RefusingServer(accept=10, busy=3)  # each region refused three times, then let go
    first = SharedMemory(module, server, pool, expected, threads=1)
    names = set(first.handles)
    first.close()
    assert server.registered == set() and all(server.refusals[n] == 3 for n in names), server.refusals
    second = SharedMemory(module, server, pool, expected, threads=1)  # same process and thread, new names
    assert names.isdisjoint(second.handles)
    second.close()
    assert server.registered == set() and set(Path("/dev/shm").glob("kiln_*")) == before


def test_cpu_meter_counts_the_clients_work_and_their_finished_children() -> None:
    meter = CpuMeter()
    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.2: pass"
    exec(spin)  # 0.2 s of CPU in this process, then as much in a child process
    subprocess.run([sys.executable, "-c", spin], check=True)
    cpu = meter.read()
    assert cpu["clients"] * cpu["seconds"] >= 0.38, cpu  # CPU seconds, however long the machine's load made them
    assert cpu["busy"] * cpu["seconds"] >= 0.3 and cpu["busy"] <= cpu["cores"], cpu  # the machine saw it too


def test_client_processes_cpu_adds_their_own_work_and_averages_what_they_all_saw() -> None:
    parts = [
        {"cores": 16, "seconds": 5.0, "busy": 10.0, "server": 6.0, "clients": 0.5},
        {"cores": 16, "seconds": 5.2, "busy": 12.0, "server": 8.0, "clients": 0.7},
        None,  # a process that read nothing
    ]
    assert merged_cpu(parts) == {"cores": 16, "seconds": 5.2, "busy": 11.0, "server": 7.0, "clients": 1.2}
    assert merged_cpu([None]) is None


def test_the_clients_collections_are_counted_with_their_longest_pause() -> None:
    with Collections() as seen:
        gc.collect()  # a full one
        gc.collect(0)
    counted = seen.seen["collections"]  # another thread may collect meanwhile too
    assert counted >= 2 and seen.seen["full"] >= 1, seen.seen
    assert 0 < seen.seen["longest_ms"] <= seen.seen["total_ms"], seen.seen
    gc.collect()  # after the block: not counted
    assert seen.seen["collections"] == counted
    a = {"collections": 3, "full": 1, "total_ms": 2.0, "longest_ms": 1.5}
    b = {"collections": 1, "full": 0, "total_ms": 0.5, "longest_ms": 0.5}
    assert merged_collections(a, b) == {"collections": 4, "full": 1, "total_ms": 2.5, "longest_ms": 1.5}
    assert merged_collections(None, b) == b


def test_a_level_that_fails_leaves_the_collector_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    import kiln.serve.loadtest as loadtest

    def broken() -> None:
        raise RuntimeError("no meter")

    monkeypatch.setattr(loadtest, "CpuMeter", broken)
    with pytest.raises(RuntimeError, match="no meter"):
        loadtest.run_level("http", "127.0.0.1:1", "m", [{}], [{"y": np.zeros(1)}], (0.0, 0.0), 1, 0.1, 1)
    assert gc.get_freeze_count() == 0  # nothing left out of the collector's sight


def test_a_tail_spread_over_the_run_and_one_gathered_in_a_stall_are_told_apart() -> None:
    rng = np.random.default_rng(0)
    sent = list(np.linspace(0, 5_000_000_000, 50_000, endpoint=False).astype(int))  # ns: 50 windows of 0.1 s
    spread = list(rng.exponential(4.0, 50_000))
    spread_tail = tail_windows(sent, spread)
    assert spread_tail["windows"] == 50 and spread_tail["share_in_worst_10pct"] < 0.2, spread_tail
    stalled = [4.0] * 50_000
    for i in range(20_000, 20_400):  # every slow request inside one stretch of 0.04 s
        stalled[i] = 40.0
    stall_tail = tail_windows(sent, stalled)
    assert stall_tail["share_in_worst_10pct"] == 1.0 and stall_tail["windows_with_slow"] <= 2, stall_tail
    assert tail_windows(sent[:50], stalled[:50]) is None  # too few requests to say
    assert tail_windows(sent[:5000], stalled[:5000]) is None  # 0.5 s: too few windows to say


def test_a_tail_of_one_or_two_slow_requests_is_said_as_no_share_not_as_a_stall() -> None:
    from kiln.serve.loadtest import Level, _row

    level = Level(1, latencies_ms=[4.0] * 150, sent_ns=list(np.linspace(0, 3e9, 150, endpoint=False).astype(int)))
    level.latencies_ms[70], level.seconds = 40.0, 3.0  # the one request above p99
    summary = level.summary()
    assert summary["tail_windows"]["slow"] == 1 and summary["tail_windows"]["share_in_worst_10pct"] is None
    assert _row(summary).endswith("| - |"), _row(summary)


def test_kilns_client_sends_http_requests_whose_tensors_are_in_shared_memory_only() -> None:
    from kiln.core.errors import ConfigError
    from kiln.serve.loadtest import lean_client

    assert lean_client("auto", "http", True) and lean_client("kiln", "http", True)
    assert not lean_client("auto", "http", False) and not lean_client("auto", "grpc", True)
    assert not lean_client("tritonclient", "http", True)
    with pytest.raises(ConfigError, match="shared memory only"):
        lean_client("kiln", "grpc", True)
    with pytest.raises(ConfigError, match="not one of auto, kiln, tritonclient"):
        lean_client("curl", "http", True)


def test_the_hop_is_not_told_where_the_stub_phases_outlast_tritons_execution() -> None:
    """Triton's execution time less the stub's phases is the hop between them, over the same executions; phases
    that add up to more are another set of executions (a metric published late), shown as "-", never negative."""
    from kiln.serve import stub_times
    from kiln.serve.loadtest import stub_split

    def reads(engine_s: float) -> tuple[dict[str, float], dict[str, float]]:
        after = {p: 0.0 for p in stub_times.PHASES} | {"executions": 10.0, "requests": 10.0, "engine": engine_s}
        return {"executions": 0.0}, after

    triton = ({"execution_count": 0, "execution_ns": 0}, {"execution_count": 10, "execution_ns": 40_000_000})
    assert stub_split(*reads(0.03), *triton)["rest"] == pytest.approx(1.0)  # 4 ms an execution, 3 of them the engine's
    assert stub_split(*reads(0.05), *triton)["rest"] is None


def test_the_workdir_of_an_engine_folder(tmp_path: Path) -> None:
    """`kiln loadtest -e` takes a workdir or an engine folder in it; the run's modules resolve beside the workdir."""
    from kiln.serve.loadtest import run_workdir

    wd = tmp_path / "wd"
    assert run_workdir(wd) == wd
    assert run_workdir(wd / "build" / "onnxruntime-cpu-fp32") == wd
    assert run_workdir(wd / "package" / "engines" / "onnxruntime-cpu-fp32") == wd


def test_an_in_process_time_that_varies_is_called_noisy_beside_its_ratio(monkeypatch: pytest.MonkeyPatch) -> None:
    """A busy machine's in-process figure (calls of 1 and 8 ms in turn, on a clock the calls advance, so the
    machine's own load plays no part) is no reference for serving: the level's row says so beside the ratio, and
    the note under the table says why."""
    from kiln.serve import loadtest
    from kiln.serve.loadtest import inprocess_ms, render_markdown

    clock = [0.0]
    monkeypatch.setattr(loadtest, "time", SimpleNamespace(perf_counter=lambda: clock[0]))

    class Alternating:
        calls = 0

        def infer(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            self.calls += 1
            clock[0] += 0.001 if self.calls % 2 else 0.008
            return {"y": feed["x"]}

    own = inprocess_ms(Alternating(), [{"x": np.zeros((1, 2), np.float32)}], batch=2, budget_s=0.2)
    assert own["noisy"] and own["interval_ms"][1] - own["interval_ms"][0] > 3 and own["batch"] == 2
    latency = {"p50": 1.0, "p90": 1.0, "p99": 1.0}
    level = {"concurrency": 2, "requests": 9, "throughput_rps": 50.0, "latency_ms": latency, "mismatches": 0}
    level |= {"errors": 0, "inprocess": own, "served_vs_inprocess": 0.5}
    result = {"model": "m", "engine": "e", "precision": "fp32", "url": "u", "inputs": "real", "duration_s": 1}
    md = render_markdown(result | {"max_requests": 9, "levels": [level]})
    assert "50% (noisy)" in md and "Noisy: the in-process time" in md


class _Result:
    def __init__(self, outputs: dict[str, np.ndarray]) -> None:
        self.outputs = outputs

    def as_numpy(self, name: str) -> np.ndarray:
        return self.outputs[name]


class _Server:
    """A client that answers request ``k`` (its input ``k``) with ``answers[k]``, as tritonclient's does."""

    def __init__(self, answers: list[dict[str, np.ndarray]]) -> None:
        self.answers = answers

    def infer(self, model: str, inputs: dict[str, np.ndarray], **_: object) -> _Result:
        return _Result(self.answers[int(inputs["k"][0])])

    def close(self) -> None:
        pass


def _level(
    monkeypatch: pytest.MonkeyPatch,
    expected: list[dict],
    answers: list[dict],
    precision: str = "fp32",
    tolerance: tuple[float, float] | None = None,
):
    """One level of requests answered with ``answers``, held to ``tolerance`` (default: ``precision``'s base)."""
    import kiln.serve.loadtest as loadtest

    monkeypatch.setattr(loadtest, "_client_module", lambda protocol: SimpleNamespace())
    monkeypatch.setattr(loadtest, "_client", lambda module, protocol, address: (_Server(answers), {}))
    monkeypatch.setattr(loadtest, "_inputs", lambda module, feed, binary=True: feed)
    pool = [{"k": np.array([k])} for k in range(len(expected))]
    tolerance = tolerance or loadtest.TOLERANCE[precision]
    return loadtest.run_level("http", "127.0.0.1:1", "m", pool, expected, tolerance, 1, 30.0, len(expected))


def _policy_answers(fill: float) -> list[dict[str, np.ndarray]]:
    """80 answers of a policy's logits [1, 6], some actions filled with ``fill``, and a value [1, 1]."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(80):
        logits = rng.standard_normal((1, 6)).astype(np.float32)
        logits[0, rng.random(6) < 0.3] = fill
        out.append({"logits": logits, "value": rng.standard_normal((1, 1)).astype(np.float32)})
    return out


def test_answers_holding_the_same_infinity_as_the_engine_are_right(monkeypatch: pytest.MonkeyPatch) -> None:
    """A -inf mask: -inf - -inf was NaN, every answer with a masked action was counted wrong, and the level's
    max_abs_err stayed 0.0."""
    expected = _policy_answers(-np.inf)
    answers = [{k: v + np.float32(1e-7) * np.isfinite(v) for k, v in e.items()} for e in expected]
    level = _level(monkeypatch, expected, answers)
    assert (level.mismatches, len(level.latencies_ms)) == (0, 80)
    assert 0 < level.max_abs_err < 1e-6


def test_wrong_answers_beside_a_large_mask_fill_are_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    """A -1e9 mask made the tolerance 1e5 (1e8 for INT8): a server with halved logits passed."""
    expected = _policy_answers(-1e9)
    answers = [
        {"logits": np.where(e["logits"] > -1e8, e["logits"] / 2, e["logits"]), "value": e["value"]} for e in expected
    ]
    level = _level(monkeypatch, expected, answers, "int8")
    assert level.mismatches > 60 and 0.5 < level.max_abs_err < 3


def test_a_nan_answer_is_wrong_and_its_error_infinite(monkeypatch: pytest.MonkeyPatch) -> None:
    expected = _policy_answers(-np.inf)
    answers = [dict(e) for e in expected]
    answers[3] = {"logits": np.full((1, 6), np.nan, np.float32), "value": expected[3]["value"]}
    level = _level(monkeypatch, expected, answers)
    assert level.mismatches == 1 and level.max_abs_err == float("inf")


def _graph_engine(folder: Path, mates: bool) -> Path:
    """An ONNX Runtime CPU engine of ``y = x @ w`` ([batch, 4] -> [batch, 3]); ``mates``: plus 0.01 x the batch's
    largest value, an answer that depends on its batch mates as a dynamically quantized engine's does."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3), "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y" if not mates else "xw"])]
    if mates:
        k = numpy_helper.from_array(np.array(0.01, np.float32), "k")
        nodes += [
            helper.make_node("ReduceMax", ["xw"], ["top"], keepdims=0),  # over every axis: the batch's largest
            helper.make_node("Mul", ["top", "k"], ["shift"]),
            helper.make_node("Add", ["xw", "shift"], ["y"]),
        ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
        [w, *([k] if mates else [])],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), folder / "m.onnx")
    build_direct(folder / "m.onnx", folder / "engine", "onnxruntime", "cpu", None, BuildConfig())
    return folder / "engine"


def _band(engine_dir: Path) -> tuple[list[dict], dict, tuple[float, float], np.ndarray]:
    """For a pool of 32 requests: the engine's single-sample answers, the batch-mate deviation measured with a
    served batch limit of 16, the INT8 band it gives, and the engine's answers in two batches of 16."""
    from kiln.serve.loadtest import TOLERANCE, answer_band, batch_deviation, expected_outputs
    from kiln.stages.engines.registry import load_engine

    rng = np.random.default_rng(0)
    pool = [{"x": rng.standard_normal((1, 4)).astype(np.float32)} for _ in range(32)]
    with load_engine(engine_dir) as runner:
        expected = expected_outputs(runner, pool)
        deviation = batch_deviation(runner, pool, expected, 16, TOLERANCE["int8"])
        batched = np.concatenate(
            [runner.infer({"x": np.concatenate([p["x"] for p in pool[i : i + 16]])})["y"] for i in (0, 16)]
        )
    return expected, deviation, answer_band(TOLERANCE["int8"], deviation), batched


def test_a_static_engine_is_held_tightly_and_a_3_percent_wrong_answer_is_wrong(tmp_path: Path) -> None:
    """An engine whose answers do not depend on their batch mates (a static INT8 one's) measures about no
    deviation and keeps the tight base band: answers 3 % off are wrong (all those at the output's scale or above,
    whose 3 % is more than the base's 2 % of that scale), where a fixed INT8 band of 10 % let them pass."""
    from kiln.serve.loadtest import answer_error, answer_masks, answer_scales

    expected, deviation, band, _ = _band(_graph_engine(tmp_path, mates=False))
    masks = answer_masks(expected, ["y"])
    typical = answer_scales(expected, masks)["y"]
    right = [answer_error(e["y"], e["y"] * np.float32(0.97), band, masks["y"], typical)[0] for e in expected]
    loud = [np.abs(e["y"]).max() >= typical for e in expected]
    assert any(loud) and not any(r for r, at_scale in zip(right, loud) if at_scale)
    assert deviation["batches"] == [8, 16] and deviation["rtol"]["y"] < 1e-5 and band[1] <= 0.02, deviation


def test_an_engine_whose_answers_depend_on_their_batch_mates_gets_the_band_it_measures(tmp_path: Path) -> None:
    """The same graph shifted by the batch's largest value: its batched answers lie off its single ones by a few
    percent, which the band takes in (its own answers in batches of 16 are right), at four times what was measured,
    a tenth at most."""
    from kiln.serve.loadtest import BAND_CAP, BAND_SAFETY, TOLERANCE, answer_error, answer_masks, answer_scales

    expected, deviation, band, batched = _band(_graph_engine(tmp_path, mates=True))
    measured = deviation["rtol"]["y"]
    assert measured > TOLERANCE["int8"][1] / BAND_SAFETY
    assert band[1] == pytest.approx(min(BAND_SAFETY * measured, BAND_CAP))
    masks = answer_masks(expected, ["y"])
    held = (masks["y"], answer_scales(expected, masks)["y"])
    right = [answer_error(e["y"], batched[i : i + 1], band, *held)[0] for i, e in enumerate(expected)]
    base = [answer_error(e["y"], batched[i : i + 1], TOLERANCE["int8"], *held)[0] for i, e in enumerate(expected)]
    assert all(right) and not all(base)


def test_the_report_says_the_band_and_the_deviation_it_was_measured_from() -> None:
    from kiln.serve.loadtest import render_markdown

    latency = {"p50": 1.0, "p90": 1.0, "p99": 1.0}
    level = {"concurrency": 1, "requests": 9, "throughput_rps": 50.0, "latency_ms": latency, "mismatches": 2}
    level |= {"errors": 0, "max_abs_err": 2.31}
    deviation = {"batches": [8, 32], "rtol": {"bbox": 0.0, "cls": 0.03}, "atol": 0.0}
    tolerance = {"atol": 1e-3, "rtol": 0.12, "base": {"atol": 1e-3, "rtol": 0.02}, "batch_deviation": deviation}
    result = {"model": "m", "engine": "e", "precision": "int8", "url": "u", "inputs": "real", "duration_s": 1}
    md = render_markdown(result | {"max_requests": 9, "levels": [level], "tolerance": tolerance | {"safety": 4.0}})
    assert "0.001 + 0.12 x the answer's scale (its largest value, or its output's RMS" in md, md
    assert "int8's base 0.001 + 0.02" in md
    assert "batches of 8, 32" in md and "up to 0.03 x" in md and "Largest error seen under load: 2.31" in md


def test_the_band_widens_no_further_than_a_tenth_so_a_wrong_answer_stays_wrong() -> None:
    """An engine whose quiet samples move by most of their value beside loud batch mates: 4x that would take zeros or
    another request's answer for right."""
    from kiln.serve.loadtest import BAND_CAP, TOLERANCE, answer_band

    atol, rtol = answer_band(TOLERANCE["int8"], {"rtol": {"y": 0.77}, "atol": 0.0})
    assert rtol == BAND_CAP and atol == TOLERANCE["int8"][0]


def _tabular_engine(folder: Path, seed: int = 0) -> Path:
    """An ONNX Runtime CPU engine of a tabular model's two outputs, ``logit`` [batch, 1] (a binary classifier's)
    and ``aux`` [batch, 3], from ``x`` [batch, 4]; the logit is shifted by 0.001 x the batch's largest ``aux``
    value: a small absolute movement with the batch, as a dynamically quantized engine's."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    consts = [
        numpy_helper.from_array(rng.standard_normal((4, 1)).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "w2"),
        numpy_helper.from_array(np.array(0.001, np.float32), "k"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["xl"]),
        helper.make_node("MatMul", ["x", "w2"], ["aux"]),
        helper.make_node("ReduceMax", ["aux"], ["top"], keepdims=0),  # over every axis: the batch's largest
        helper.make_node("Mul", ["top", "k"], ["shift"]),
        helper.make_node("Add", ["xl", "shift"], ["logit"]),
    ]
    graph = helper.make_graph(
        nodes,
        "tabular",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [
            helper.make_tensor_value_info("logit", TensorProto.FLOAT, ["batch", 1]),
            helper.make_tensor_value_info("aux", TensorProto.FLOAT, ["batch", 3]),
        ],
        consts,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), folder / "m.onnx")
    build_direct(folder / "m.onnx", folder / "engine", "onnxruntime", "cpu", None, BuildConfig())
    return folder / "engine"


def _tabular_answers(engine_dir: Path) -> tuple[list[dict], list[dict], dict]:
    """For 32 requests, the first near 0 (a logit at the decision boundary): the engine's single-sample answers,
    its answers in two batches of 16 (what a correct server of it answers), and the batch-mate deviation measured."""
    from kiln.serve.loadtest import TOLERANCE, batch_deviation, expected_outputs
    from kiln.stages.engines.registry import load_engine

    rng = np.random.default_rng(1)
    pool = [{"x": rng.standard_normal((1, 4)).astype(np.float32)} for _ in range(32)]
    pool[0] = {"x": np.full((1, 4), 1e-4, np.float32)}
    with load_engine(engine_dir) as runner:
        expected = expected_outputs(runner, pool)
        deviation = batch_deviation(runner, pool, expected, 16, TOLERANCE["int8"])
        x = np.concatenate([p["x"] for p in pool])
        batched = [runner.infer({"x": x[i : i + 16]}) for i in (0, 16)]
    served = [{k: v[i : i + 1] for k, v in batched[j // 16].items() for i in [j % 16]} for j in range(32)]
    return expected, served, deviation


def test_a_one_value_output_near_zero_is_held_to_its_outputs_scale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A binary logit near 0 that batching moves by a few thousandths: relative to the answer's own value that is
    many times itself, which held every server of the engine to the capped band and counted its right answers
    wrong; against the output's scale it is the small deviation it is, and a correct server passes."""
    from kiln.serve.loadtest import BAND_CAP, BAND_SAFETY, TOLERANCE, answer_band

    expected, served, deviation = _tabular_answers(_tabular_engine(tmp_path))
    moved = abs(float(served[0]["logit"][0, 0] - expected[0]["logit"][0, 0]))
    assert abs(float(expected[0]["logit"][0, 0])) < moved / 10  # the premise: it moves by more than its value
    assert BAND_SAFETY * deviation["rtol"]["logit"] < BAND_CAP, deviation  # no warning: nothing capped
    band = answer_band(TOLERANCE["int8"], deviation)
    level = _level(monkeypatch, expected, served, tolerance=band)
    assert (level.mismatches, len(level.latencies_ms)) == (0, 32)


def test_a_server_of_wrong_answers_still_fails_against_the_outputs_scale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The band taken from the output's scale still tells wrong answers: another engine's (other weights), answers
    mixed up between requests, and the near-0 logit answered 0.1 off."""
    from kiln.serve.loadtest import TOLERANCE, answer_band

    for name in ("served", "other"):
        (tmp_path / name).mkdir()
    expected, served, deviation = _tabular_answers(_tabular_engine(tmp_path / "served"))
    band = answer_band(TOLERANCE["int8"], deviation)
    other = _tabular_answers(_tabular_engine(tmp_path / "other", seed=7))[1]
    assert _level(monkeypatch, expected, other, tolerance=band).mismatches >= 31
    mixed = served[1:] + served[:1]
    assert _level(monkeypatch, expected, mixed, tolerance=band).mismatches >= 31
    off = [dict(a) for a in served]
    off[0]["logit"] = off[0]["logit"] + np.float32(0.1)
    assert _level(monkeypatch, expected, off, tolerance=band).mismatches == 1


def test_a_pool_capped_below_the_split_says_how_much_of_it_it_holds(engines: dict[str, ServedEngine]) -> None:
    """The requests are the first ``size`` validation samples: a split larger than that is said as such, in the
    source line and in `kiln loadtest --help`, not as if the pool were the whole split."""
    from click.testing import CliRunner

    from kiln.cli import main
    from kiln.serve.loadtest import POOL

    model = "tests.user_models:two_in"
    pool, source = request_pool(engines[model], config(model, "tests.user_models:two_in_data"), size=3)
    assert len(pool) == 3 and source.endswith("(the first 3 of its 8 samples: the pool's cap)"), source
    _, whole = request_pool(engines[model], config(model, "tests.user_models:two_in_data"), size=POOL)
    assert whole.endswith("(8 samples)"), whole
    help_text = " ".join(CliRunner().invoke(main, ["loadtest", "--help"]).output.split())
    assert f"its first {POOL} validation samples" in help_text, help_text


def test_a_deviation_of_zero_is_said_as_none_not_as_a_limit_of_zero() -> None:
    from kiln.serve.loadtest import render_markdown

    latency = {"p50": 1.0, "p90": 1.0, "p99": 1.0}
    level = {"concurrency": 1, "requests": 9, "throughput_rps": 50.0, "latency_ms": latency, "mismatches": 0}
    level |= {"errors": 0, "max_abs_err": 0.0}
    deviation = {"batches": [8, 16], "rtol": {"embedding": 0.0}, "atol": 0.0}
    tolerance = {"atol": 1e-5, "rtol": 1e-4, "base": {"atol": 1e-5, "rtol": 1e-4}, "batch_deviation": deviation}
    result = {"model": "m", "engine": "e", "precision": "fp32", "url": "u", "inputs": "real", "duration_s": 1}
    md = render_markdown(result | {"max_requests": 9, "levels": [level], "tolerance": tolerance | {"safety": 4.0}})
    assert "single-sample ones, none (identical)." in md and "up to 0 x" not in md, md
