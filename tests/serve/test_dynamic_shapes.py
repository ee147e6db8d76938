"""`kiln serve` at every size an engine was validated for: a GRU tagger whose per-step output follows a dynamic
sequence axis (the export fixed its length; Kiln declares it), served at two lengths, and a per-pixel model with a
dynamic height and width served at two sizes; a size outside the validated range is answered with an error that
names the axis and the range."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import yaml
from click.testing import CliRunner

from kiln.cli import main
from kiln.serve.server import free_ports
from kiln.stages.engines.registry import load_engine
from tests.conftest import tiny_config_dict
from tests.serve.test_server import _abort, _ready, _start_serve

pytestmark = pytest.mark.slow  # a pipeline run and a Triton server per model

MODELS = """
import torch
from torch import nn

from kiln import DatasetSplits


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(4, 8, batch_first=True, bidirectional=True)
        self.head = nn.Linear(16, 3)

    def forward(self, x, mask):
        steps, _ = self.gru(x)
        steps = steps * mask.unsqueeze(-1)
        return steps, self.head(steps.sum(1) / mask.sum(1, keepdim=True).clamp(min=1))


class PerPixel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 1))

    def forward(self, x):
        return self.body(x)


class Tokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(100, 8), nn.Linear(8, 3)

    def forward(self, input_ids):
        return self.head(self.embed(input_ids).mean(1))


def tagger():
    return Tagger()


def tokens():
    return Tokens()


def token_ids():
    g = torch.Generator().manual_seed(0)
    tx, vx = torch.randint(0, 100, (32, 16), generator=g), torch.randint(0, 100, (16, 16), generator=g)
    return DatasetSplits(tx, torch.randint(0, 3, (32,), generator=g), vx, torch.randint(0, 3, (16,), generator=g), 3)


def per_pixel():
    return PerPixel()


def sequences():
    g = torch.Generator().manual_seed(0)
    def part(n, seq):
        x = {"x": torch.randn(n, seq, 4, generator=g), "mask": torch.ones(n, seq)}
        return x, torch.randint(0, 3, (n,), generator=g)
    (tx, ty), (vx, vy) = part(32, 12), part(16, 6)
    return DatasetSplits(tx, ty, vx, vy, num_classes=3)


def images():
    g = torch.Generator().manual_seed(0)
    tx, vx = torch.randn(16, 3, 16, 16, generator=g), torch.randn(8, 3, 8, 8, generator=g)
    return DatasetSplits(tx, None, vx, None)
"""


def _run(tmp_path: Path, model: str, data: str, axes: dict, **extra: object) -> Path:
    (tmp_path / "shape_models.py").write_text(textwrap.dedent(MODELS))
    sys.path.insert(0, str(tmp_path))
    cfg = tiny_config_dict(
        **{
            "model.name": f"shape_models:{model}",
            "model.params": {},
            "data.name": f"shape_models:{data}",
            "data.params": {},
            "precision.variants": ["fp32"],
            "build.backends": ["onnxruntime"],
            "signature.dynamic_axes": axes,
            "signature.batch_sizes": [1, 4],
            **extra,
        }
    )
    (tmp_path / "kiln.yaml").write_text(yaml.safe_dump(cfg))
    result = CliRunner().invoke(main, ["run", str(tmp_path / "kiln.yaml"), "-w", str(tmp_path / "wd"), "--quiet"])
    assert result.exit_code == 0, result.output
    return tmp_path / "wd"


def _serve_and_ask(
    workdir: Path, feeds: list[dict[str, np.ndarray]], outside: dict[str, np.ndarray], *serve_args: str
) -> str:
    """Each feed's answers from the server (`kiln serve` with ``serve_args``) equal the engine's own; ``outside``'s
    error is returned, with its HTTP status."""
    from tritonclient.http import InferenceServerClient, InferInput
    from tritonclient.utils import InferenceServerException

    ports = free_ports(3)
    proc = _start_serve(workdir, ports, *serve_args)
    try:
        _ready(proc, ports, ["onnxruntime_cpu_fp32"])
        client = InferenceServerClient(f"127.0.0.1:{ports[0]}")

        def ask(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            inputs = []
            for name, value in feed.items():
                inp = InferInput(name, list(value.shape), "FP32")
                inp.set_data_from_numpy(value)
                inputs.append(inp)
            result = client.infer("onnxruntime_cpu_fp32", inputs)
            return {o["name"]: result.as_numpy(o["name"]) for o in result.get_response()["outputs"]}

        with load_engine(workdir / "build" / "onnxruntime-cpu-fp32") as runner:
            for feed in feeds:
                want, got = runner.infer(feed), ask(feed)
                for name, value in want.items():
                    np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-5)
        with pytest.raises(InferenceServerException) as refused:
            ask(outside)
    finally:
        _abort(proc)
    return f"HTTP {refused.value.status()}: {refused.value}"


@pytest.mark.long
def test_a_sequence_model_is_served_at_both_validated_lengths(tmp_path: Path) -> None:
    axes = {"x": {1: "seq"}, "mask": {1: "seq"}}
    wd = _run(tmp_path, "tagger", "sequences", axes, **{"train.epochs": 1, "signature.logits_output": "output_1"})
    rng = np.random.default_rng(0)

    def feed(seq: int) -> dict[str, np.ndarray]:
        return {"x": rng.standard_normal((2, seq, 4), dtype=np.float32), "mask": np.ones((2, seq), np.float32)}

    message = _serve_and_ask(wd, [feed(6), feed(12), feed(9)], feed(40))
    assert "seq" in message and "6 to 12" in message and "40" in message, message
    assert message.startswith("HTTP 400"), message  # the request's fault, not the server's


@pytest.mark.parametrize("serve_args", [(), ("--pytriton",)], ids=["stubs", "pytriton"])
def test_a_per_pixel_model_is_served_at_two_image_sizes(tmp_path: Path, serve_args: tuple[str, ...]) -> None:
    """Both servers answer a size outside the validated range alike: HTTP 400 and one line naming the input, the
    axis and the range (PyTriton's proxy would answer 500 with two tracebacks)."""
    axes = {"input": {2: "height", 3: "width"}}
    wd = _run(tmp_path, "per_pixel", "images", axes, **{"train.enabled": False})
    rng = np.random.default_rng(0)

    def feed(size: int) -> dict[str, np.ndarray]:
        return {"input": rng.standard_normal((1, 3, size, size), dtype=np.float32)}

    message = _serve_and_ask(wd, [feed(8), feed(16)], feed(64), *serve_args)
    assert message == (
        "HTTP 400: [400] input 'input' axis 2 (height) is 64: engine onnxruntime-cpu-fp32 was validated for height "
        "from 8 to 16; input 'input' axis 3 (width) is 64: engine onnxruntime-cpu-fp32 was validated for width from 8 "
        "to 16"  # every axis outside its range, so that one refusal says all the sizes to change
    ), message


@pytest.mark.parametrize("serve_args", [(), ("--pytriton",)], ids=["stubs", "pytriton"])
def test_a_request_refused_in_a_batch_fails_alone(tmp_path: Path, serve_args: tuple[str, ...]) -> None:
    """Four requests in one batch (a 1 s batching window), one holding a token id past the vocabulary: it gets the
    400, the other three their answers (PyTriton's proxy answered every request of the batch with its error)."""
    import threading

    from tritonclient.http import InferenceServerClient, InferInput
    from tritonclient.utils import InferenceServerException

    wd = _run(tmp_path, "tokens", "token_ids", {}, **{"train.epochs": 1})
    ids = np.random.default_rng(0).integers(0, 100, (4, 1, 16))
    ids[3, 0, 0] = 150
    answers: dict[int, object] = {}
    ports = free_ports(3)
    proc = _start_serve(wd, ports, "--max-queue-delay-us", "1000000", *serve_args)

    def ask(i: int) -> None:
        tensor = InferInput("input", [1, 16], "INT64")
        tensor.set_data_from_numpy(ids[i])
        client = InferenceServerClient(f"127.0.0.1:{ports[0]}", network_timeout=60)
        try:
            answers[i] = client.infer("onnxruntime_cpu_fp32", [tensor]).as_numpy("logits")
        except InferenceServerException as exc:
            answers[i] = exc

    try:
        _ready(proc, ports, ["onnxruntime_cpu_fp32"])
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    finally:
        _abort(proc)
    refused = answers[3]
    assert isinstance(refused, InferenceServerException) and refused.status() == "400", refused
    assert "input 'input' holds 150" in str(refused), refused
    with load_engine(wd / "build" / "onnxruntime-cpu-fp32") as runner:
        for i in range(3):
            assert not isinstance(answers[i], Exception), f"request {i} of the batch failed: {answers[i]}"
            want = runner.infer({"input": ids[i]})["logits"]
            np.testing.assert_allclose(answers[i], want, rtol=1e-5, atol=1e-6)
