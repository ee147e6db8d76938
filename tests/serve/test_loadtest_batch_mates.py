"""`kiln loadtest` of a dynamically quantized INT8 engine (ONNX Runtime's quantize_dynamic: activation scales computed
per batch), whose answers move with their batch mates: the band its answers are held to, and the failure's cause."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import QuantType, quantize_dynamic

from kiln.core.data import DatasetSplits
from kiln.core.errors import GateFailure
from kiln.pipeline.config import config_from_dict
from kiln.serve.loadtest import (
    BAND_CAP,
    BAND_SAFETY,
    TOLERANCE,
    answer_band,
    answer_error,
    answer_masks,
    answer_scales,
    batch_deviation,
    batching_cause,
    batching_hint,
    expected_outputs,
    loadtest,
    relative_error,
)
from kiln.serve.server import ServedEngine, find_engines, free_ports, wait_ready
from kiln.stages.engines.backend import read_metadata
from kiln.stages.engines.config import BuildConfig
from kiln.stages.engines.registry import load_engine
from kiln.stages.engines.stage import build_direct

FEATURES, CLASSES, LOUD = 16, 64, 100.0
SERVED_BATCH = 16  # the largest batch the tests' server forms


def graph(path: Path, seed: int = 0) -> None:
    """``logits = input @ w + b``, [batch, 17] -> [batch, 64], at ``path``: the last feature is read by no weight, yet
    a loud value there sets a dynamically quantized engine's activation scale for the whole batch, so it coarsens
    its batch mates' answers."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((FEATURES + 1, CLASSES)).astype(np.float32) / 4
    w[FEATURES] = 0
    inits = [
        numpy_helper.from_array(w, "w"),
        numpy_helper.from_array(rng.standard_normal(CLASSES).astype(np.float32), "b"),
    ]
    nodes = [helper.make_node("MatMul", ["input", "w"], ["xw"]), helper.make_node("Add", ["xw", "b"], ["logits"])]
    g = helper.make_graph(
        nodes,
        "linear",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", FEATURES + 1])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", CLASSES])],
        inits,
    )
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)


def samples(twins: bool = False) -> np.ndarray:
    """32 requests, one in eight loud (in the feature no weight reads); ``twins``: every odd one a copy of the one
    before it, moved by 1e-3: answers that lie too close together for a band wider than the fixed cap."""
    x = np.random.default_rng(0).standard_normal((32, FEATURES + 1)).astype(np.float32)
    if twins:
        x[1::2] = x[::2] + np.float32(1e-3)
    x[:, FEATURES] = np.where(np.arange(32) % 8 == 0, LOUD, 0)
    return x


def engine(folder: Path, precision: str = "int8", seed: int = 0) -> Path:
    """The model's ONNX Runtime CPU engine in ``folder`` (named as kiln names it): FP32, or INT8 quantized
    dynamically as Kiln's ORT CPU graph of a Transformer is."""
    folder.mkdir(parents=True, exist_ok=True)
    src = folder / f"m-{seed}.onnx"
    graph(src, seed)
    if precision == "int8":
        quantize_dynamic(str(src), str(folder / f"q-{seed}.onnx"), weight_type=QuantType.QInt8)
        src = folder / f"q-{seed}.onnx"
    out = folder / f"onnxruntime-cpu-{precision}"
    build_direct(src, out, "onnxruntime", "cpu", None, BuildConfig())
    return out


def answers(engine_dir: Path, x: np.ndarray) -> tuple[list[dict], dict, tuple[float, float], list[dict]]:
    """The engine's single-sample answers to the rows of ``x``, the batch-mate deviation measured at the served
    batch, the INT8 band it gives, and the engine's answers in batches of 8 (what a correct server of it answers)."""
    pool = [{"input": x[k : k + 1]} for k in range(len(x))]
    with load_engine(engine_dir) as runner:
        expected = expected_outputs(runner, pool)
        deviation = batch_deviation(runner, pool, expected, SERVED_BATCH, TOLERANCE["int8"])
        batched = [runner.infer({"input": x[i : i + 8]}) for i in range(0, len(x), 8)]
    served = [{k: v[j % 8 : j % 8 + 1] for k, v in batched[j // 8].items()} for j in range(len(x))]
    return expected, deviation, answer_band(TOLERANCE["int8"], deviation), served


def judged(expected: list[dict], served: list[dict], band: tuple[float, float]) -> tuple[int, float]:
    """How many served answers the load test counts wrong under ``band``, and the largest error of those, of its
    scale (a level's ``worst_wrong``)."""
    masks = answer_masks(expected, ["logits"])
    held = (masks["logits"], answer_scales(expected, masks)["logits"])
    off = [relative_error(e["logits"], s["logits"], *held) for e, s in zip(expected, served)]
    right = [answer_error(e["logits"], s["logits"], band, *held)[0] for e, s in zip(expected, served)]
    return right.count(False), max((o for o, r in zip(off, right) if not r), default=0.0)


def wrong(expected: list[dict], served: list[dict], band: tuple[float, float]) -> int:
    return judged(expected, served, band)[0]


def test_a_correct_server_of_a_dynamic_int8_engine_passes_and_a_wrong_one_still_fails(tmp_path: Path) -> None:
    """Batched beside a loud mate, the engine's answers move by more than the fixed cap of a tenth, so its correct
    server was counted wrong; its requests' answers lie far further apart than that, and the band widens to the
    deviation it measured, under half that distance: the batched answers pass, while answers mixed up between
    requests and another build's answers (other weights) are still wrong."""
    expected, deviation, band, served = answers(engine(tmp_path / "a"), samples())
    measured = max(deviation["rtol"].values())
    assert measured > BAND_CAP, deviation  # the premise: a tenth cannot hold this engine's own batched answers
    assert deviation["separation"] > 2 * measured and band[1] > measured, (deviation, band)
    assert wrong(expected, served, band) == 0
    assert wrong(expected, served, (band[0], BAND_CAP)) > 0  # what the fixed cap counted
    assert wrong(expected, served[1:] + served[:1], band) == len(served)
    other = answers(engine(tmp_path / "b", seed=7), samples())[3]
    assert wrong(expected, other, band) == len(served)


def test_a_failure_beside_a_capped_band_names_the_engines_batch_mates_and_the_fix(tmp_path: Path) -> None:
    """Requests whose answers nearly match (twins) keep the band at the cap, under what batching moves this engine's
    answers by: a failure whose wrong answers lie within that says the engine answers differently in a batch than
    alone, by how much, and to load-test the FP32 engine served beside it, a static INT8 one or this one unbatched,
    then the server. Another build's answers, further off than batching moves the engine's, stay the server's."""
    pkg = tmp_path / "pkg"
    (pkg / "kiln-package.json").parent.mkdir()
    (pkg / "kiln-package.json").write_text("{}")
    int8 = engine(pkg / "engines")
    engine(pkg / "engines", "fp32")
    expected, deviation, band, served = answers(int8, samples(twins=True))
    assert band[1] == BAND_CAP < BAND_SAFETY * max(deviation["rtol"].values()), (deviation, band)
    count, worst = judged(expected, served, band)
    assert count > 0  # a correct server is counted wrong: the failure must say why
    cause = batching_cause(deviation, band, worst)
    moved = f"{max(deviation['rtol'].values()):.3g}"
    assert cause and "the engine answers differently in a batch than alone" in cause, cause
    assert f"in batches of 8, 16 its answers move by up to {moved} of their scale" in cause, cause
    assert "held to no more than 0.1" in cause and "activation scales per batch" in cause, cause
    assert f"the wrong ones were off by up to {worst:.3g}, within 4 x that" in cause, cause
    other = answers(engine(tmp_path / "other", seed=7), samples(twins=True))[3]
    assert batching_cause(deviation, band, judged(expected, other, band)[1]) is None
    served_int8 = ServedEngine("onnxruntime_cpu_int8", int8, read_metadata(int8))
    hint = batching_hint(pkg, served_int8, "http")
    assert [e.model_name for e in find_engines(pkg)] == ["onnxruntime_cpu_fp32", "onnxruntime_cpu_int8"]
    assert "--model onnxruntime_cpu_fp32" in hint and "calibration.ort_cpu_scheme: static" in hint, hint
    assert "kiln serve --max-batch 0" in hint and "check that the server serves the engine -e names" in hint, hint
    assert "--max-batch" not in batching_hint(pkg, served_int8, "ray")


def test_a_static_engines_failure_is_the_servers(tmp_path: Path) -> None:
    """The FP32 engine answers alike in any batch: a failure of its server says nothing of batch mates."""
    _, deviation, band, _ = answers(engine(tmp_path, "fp32"), samples())
    assert deviation["separation"] is None and batching_cause(deviation, band, 0.05) is None, deviation


def model() -> torch.nn.Module:
    """The factory -c names: the load test reads only its data."""
    return torch.nn.Linear(FEATURES + 1, CLASSES)


def _splits(x: np.ndarray) -> DatasetSplits:
    t, y = torch.from_numpy(x), torch.zeros(len(x), dtype=torch.long)
    return DatasetSplits({"input": t}, y, {"input": t}, y, num_classes=2)


def plain_data() -> DatasetSplits:
    return _splits(samples())


def twins_data() -> DatasetSplits:
    return _splits(samples(twins=True))


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A real `kiln serve` (Triton, dynamic batching) of a package of the INT8 engine and its FP32 one."""
    pkg = tmp_path_factory.mktemp("served") / "pkg"
    (pkg / "engines").mkdir(parents=True)
    (pkg / "kiln-package.json").write_text("{}")
    engine(pkg / "engines")
    engine(pkg / "engines", "fp32")
    ports = free_ports(3)
    flags = [f"--{k}-port={p}" for k, p in zip(("http", "grpc", "metrics"), ports)]
    cmd = [sys.executable, "-m", "kiln.cli", "serve", str(pkg), *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{ports[0]}"
        wait_ready(url, ["onnxruntime_cpu_int8"], 600, proc, tuple(ports[1:]))  # a hang guard, not a speed test
        yield url, pkg
    finally:
        proc.terminate()
        proc.wait(timeout=600)


def _loadtest(url: str, pkg: Path, data: str, out: Path) -> dict:
    """800 requests from 8 threads, the INT8 engine's answers checked (bounded by requests, not by time)."""
    name = "tests.serve.test_loadtest_batch_mates"
    config = config_from_dict({"model": {"name": f"{name}:model"}, "data": {"name": f"{name}:{data}"}})
    args = ("onnxruntime_cpu_int8", pkg, out, [8], 600.0, 800)
    return loadtest(url, *args, config=config, inprocess=False, metrics_port=None)


@pytest.mark.slow
def test_a_real_server_of_the_engine_passes_and_one_it_cannot_judge_fails_naming_its_batch_mates(
    served: tuple[str, Path], tmp_path: Path
) -> None:
    """Triton batching the requests moves the engine's answers by more than a tenth: with answers that lie apart,
    the load test passes its correct server; with twins it cannot hold them to more, and the failure names the
    engine's batch mates, not the server, as the cause."""
    url, pkg = served
    result = _loadtest(url, pkg, "plain_data", tmp_path / "plain")
    assert result["levels"][0]["mismatches"] == 0 and result["tolerance"]["rtol"] > BAND_CAP, result["tolerance"]
    with pytest.raises(GateFailure) as failed:
        _loadtest(url, pkg, "twins_data", tmp_path / "twins")
    assert "the engine answers differently in a batch than alone" in failed.value.message, failed.value.message
    assert "--model onnxruntime_cpu_fp32" in failed.value.hint, failed.value.hint
