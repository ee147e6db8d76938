"""train.update_graph: the update after the backward pass captured once as a CUDA graph and replayed.

On CPU (CI): when it applies and the error for ``on`` where it cannot. On the GPU: a graphed run equals the eager
update step for step (fp16 with its scaler, bf16, fp32; AdamW and SGD; accumulation; clipping), skips a NaN step
and puts BatchNorm's statistics back, resumes from a checkpoint, works under torch.compile and never synchronises
once captured.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from kiln.core.errors import TrainingError
from kiln.stages.train import checkpoint as ckpt
from kiln.stages.train import loop as loop_module
from kiln.stages.train import update_graph
from kiln.stages.train.config import TrainConfig
from kiln.stages.train.loop import train
from kiln.stages.train.update_graph import WARMUP_STEPS, wanted
from tests.stages.train.train_helpers import (
    Crash,
    bn_net,
    crash_at,
    max_diff,
    nan_inside,
    nan_on_forward,
    tiny_data,
    tiny_net,
    train_cfg,
)

CUDA = torch.device("cuda")


def with_graph(cfg: TrainConfig, setting: str) -> TrainConfig:
    return TrainConfig.model_validate({**cfg.model_dump(), "update_graph": setting})


def test_auto_captures_one_process_on_cuda_with_a_fused_optimizer_only() -> None:
    assert wanted("auto", CUDA, skips_on_device=True)
    assert not wanted("auto", CUDA, skips_on_device=True, processes=2)  # DDP: only when asked for (see the module)
    assert wanted("on", CUDA, skips_on_device=True, processes=2)
    assert not wanted("auto", CUDA, skips_on_device=False)
    assert not wanted("auto", torch.device("cpu"), skips_on_device=True)
    assert not wanted("off", CUDA, skips_on_device=True)


@pytest.mark.parametrize("device, fused, needs", [("cpu", True, "a CUDA device"), ("cuda", False, "a fused optimizer")])
def test_on_where_it_cannot_work_is_an_error_with_a_fix(device: str, fused: bool, needs: str) -> None:
    with pytest.raises(TrainingError, match=f"train.update_graph: on needs {needs}") as err:
        wanted("on", torch.device(device), skips_on_device=fused)
    assert "update_graph: auto" in err.value.hint


def test_on_cpu_auto_runs_the_eager_update_and_on_is_refused() -> None:
    r = train(tiny_net(), tiny_data(), train_cfg(epochs=1, optimizer="adamw", fused=True))
    assert r.update_graph is None and r.summary()["update_graph"] is None
    with pytest.raises(TrainingError, match="needs a CUDA device"):
        train(tiny_net(), tiny_data(), train_cfg(epochs=1, optimizer="adamw", update_graph="on"))


def test_update_graph_is_not_part_of_the_run_key() -> None:
    dump: dict[str, Any] = {"seed": 0, "model": {"name": "m"}, "data": {"name": "d"}, "train": train_cfg().model_dump()}
    other = {**dump, "train": {**dump["train"], "update_graph": "off"}}
    assert ckpt.run_key(dump) == ckpt.run_key(other)


# -- on the GPU --------------------------------------------------------------------------------------------------
def gpu_cfg(**kw: Any) -> TrainConfig:
    base: dict[str, Any] = {"device": "cuda", "optimizer": "adamw", "lr": 0.01, "epochs": 2, "warmup_steps": 3}
    return train_cfg(**{**base, **kw})


@pytest.mark.gpu
@pytest.mark.parametrize(
    "precision, optimizer, accum, clip",
    [("fp16", "adamw", 2, 1.0), ("bf16", "adamw", 1, None), ("fp32", "sgd", 1, 0.5), ("fp16", "sgd", 1, 1.0)],
)
def test_graphed_update_equals_the_eager_one(precision: str, optimizer: str, accum: int, clip: float | None) -> None:
    """Two epochs of 10 steps with a warm-up and a cosine schedule (the LR changes every step, so a learning rate
    baked into the graph would show), a NaN batch at step 6 (captured by then): same weights, losses, skips and
    loss scales as the eager update."""
    data = tiny_data(400)
    cfg = gpu_cfg(precision=precision, optimizer=optimizer, grad_accum_steps=accum, grad_clip=clip)
    runs = {}
    for setting in ("off", "on"):
        model = tiny_net()
        nan_on_forward(model, call=5 * accum + 1)  # the first forward of step 6
        runs[setting] = (model, train(model, data, with_graph(cfg, setting)))
    (eager, a), (graphed, b) = runs["off"], runs["on"]
    assert a.update_graph is None
    assert b.update_graph == {
        "captured": True,
        "from_step": WARMUP_STEPS + 1,
        "captures": 1,
        "eager_steps_after_capture": 0,
        "failure": None,
    }
    assert max_diff(eager, graphed) < 1e-5
    assert [m.nonfinite_steps for m in b.history] == [m.nonfinite_steps for m in a.history] == [1, 0]
    assert [m.loss_scale for m in b.history] == [m.loss_scale for m in a.history]
    assert [m.lr for m in b.history] == [m.lr for m in a.history]
    assert [m.loss for m in b.history] == pytest.approx([m.loss for m in a.history], rel=1e-5)


@pytest.mark.gpu
def test_graphed_skip_puts_batchnorm_statistics_back(tmp_path: Path) -> None:
    model = bn_net()
    nan_inside(model[1], {6})  # step 6's batch blows up before the BatchNorm (captured since step 4)
    states: dict[int, dict[str, torch.Tensor]] = {}

    def snapshot(step: int) -> None:
        if step in (5, 6):
            states[step] = {k: v.clone() for k, v in model.state_dict().items()}

    r = train(model, tiny_data(400), gpu_cfg(update_graph="on"), on_step=snapshot)
    assert r.update_graph is not None and r.update_graph["captured"]
    assert sum(m.nonfinite_steps for m in r.history) == 1
    assert all(torch.equal(states[5][k], states[6][k]) for k in states[5])
    assert all(torch.isfinite(v).all() for v in model.state_dict().values() if v.is_floating_point())


@pytest.mark.gpu
def test_graphed_run_resumes_and_matches_the_uninterrupted_run(tmp_path: Path) -> None:
    data = tiny_data(400)
    cfg = gpu_cfg(epochs=3, precision="fp16", checkpoint={"every_steps": 7, "resume": "auto"})
    ref = tiny_net()
    want = train(ref, data, cfg, ckpt_dir=tmp_path / "ref", run_key="k")
    with pytest.raises(Crash):
        train(tiny_net(), data, cfg, ckpt_dir=tmp_path / "run", run_key="k", on_step=crash_at(12))
    resumed = tiny_net(seed=99)
    got = train(resumed, data, cfg, ckpt_dir=tmp_path / "run", run_key="k")  # from step 10: eager 11-13, graph 14-
    assert got.resumed_from and got.update_graph is not None and got.update_graph["captured"]
    assert max_diff(ref, resumed) < 1e-5
    assert [m.loss_scale for m in got.history] == [m.loss_scale for m in want.history]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_graphed_update_under_torch_compile_equals_the_eager_update(mode: str) -> None:
    torch.compiler.reset()
    data = tiny_data(400)
    cfg = TrainConfig.model_validate(
        {**gpu_cfg(precision="fp16", grad_accum_steps=2).model_dump(), "compile": {"mode": mode}}
    )
    eager, graphed = tiny_net(), tiny_net()
    train(eager, data, with_graph(cfg, "off"))
    torch.compiler.reset()
    r = train(graphed, data, with_graph(cfg, "on"))
    assert r.compile is not None and r.compile["fallback"] is None, r.compile
    assert r.update_graph is not None and r.update_graph["captured"], r.update_graph
    assert max_diff(eager, graphed) < 1e-4


class Branchy(torch.nn.Module):
    """TinyNet's layers plus a head used only from the ``from_call``-th training forward on (never by default), and
    one never used: parameters without gradients, which the eager update leaves alone."""

    def __init__(self, from_call: int = 10**9) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.late, self.unused = tiny_net(), torch.nn.Linear(10, 10), torch.nn.Linear(10, 10)
        self.from_call, self.calls = from_call, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.body(x)
        if self.training:
            self.calls += 1
        return out + self.late(out) if self.calls >= self.from_call else out


@pytest.mark.gpu
@pytest.mark.parametrize("from_call, captures", [(10**9, 1), (8, 2)])
def test_parameters_without_gradients_are_left_alone_and_a_new_set_is_captured_again(
    from_call: int, captures: int
) -> None:
    """A never-used layer keeps its weights (and AdamW's weight decay does not touch it) as in the eager update; a
    layer that starts to get gradients at step 8 runs the update eagerly for two steps, then it is captured anew."""
    data = tiny_data(400)
    cfg = gpu_cfg(precision="bf16")
    eager, graphed = Branchy(from_call), Branchy(from_call)
    before = graphed.unused.weight.detach().clone()
    train(eager, data, with_graph(cfg, "off"))
    r = train(graphed, data, with_graph(cfg, "on"))
    assert r.update_graph is not None and r.update_graph["captures"] == captures, r.update_graph
    assert r.update_graph["eager_steps_after_capture"] == (0 if captures == 1 else 2)
    assert torch.equal(graphed.unused.weight.detach(), before)
    assert max_diff(eager, graphed) < 1e-5


@pytest.mark.gpu
def test_a_capture_that_fails_once_is_captured_a_few_steps_later(monkeypatch: pytest.MonkeyPatch) -> None:
    """A capture can fail for a passing reason (another process filling the GPU's memory); the next try succeeds."""
    real_capture, tries = update_graph.capture, []

    def once_failing(work: Any, device: torch.device, warmups: int = 1) -> Any:
        tries.append(1)
        if len(tries) == 1:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
        return real_capture(work, device, warmups)

    monkeypatch.setattr(update_graph, "capture", once_failing)
    data, cfg = tiny_data(400), gpu_cfg(precision="fp16")
    eager, graphed = tiny_net(), tiny_net()
    train(eager, data, with_graph(cfg, "off"))
    r = train(graphed, data, with_graph(cfg, "on"))
    assert r.update_graph == {
        "captured": True,
        "from_step": 2 * WARMUP_STEPS + 2,  # failed at step 4, eager through 7 (3 more), captured at 8
        "captures": 1,
        "eager_steps_after_capture": 0,
        "failure": None,
    }
    assert max_diff(eager, graphed) < 1e-5


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_failed_capture_leaves_the_update_eager_with_one_warning(
    precision: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Where capturing fails (e.g. an op that synchronises), the run goes on with the eager update and the same result.
    Simulated on CPU: the capture fails the way a real one does, having run the update's Python (GradScaler marks the
    optimizer unscaled) and no kernel; the step that tried it then runs eagerly from where it stood."""
    from torch.amp.grad_scaler import OptState

    def failing_capture(work: Any, device: torch.device, warmups: int = 1) -> Any:
        tries.append(1)
        if scalers[-1].is_enabled():  # fp16: what GradScaler.unscale_ records before any kernel
            scalers[-1]._per_optimizer_states[id(optimizers[-1])]["stage"] = OptState.UNSCALED
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    scalers: list[torch.amp.GradScaler] = []
    optimizers: list[torch.optim.Optimizer] = []
    tries: list[int] = []
    real_make_scaler, real_make_optimizer = loop_module.make_scaler, loop_module.make_optimizer
    monkeypatch.setattr(loop_module, "make_scaler", lambda *a: scalers.append(real_make_scaler(*a)) or scalers[-1])
    monkeypatch.setattr(
        loop_module, "make_optimizer", lambda *a: optimizers.append(real_make_optimizer(*a)) or optimizers[-1]
    )
    monkeypatch.setattr(update_graph, "capture", failing_capture)
    cfg = train_cfg(epochs=2, optimizer="adamw", fused=True, precision=precision)
    eager = tiny_net()
    train(eager, tiny_data(), with_graph(cfg, "off"))
    monkeypatch.setattr(update_graph, "wanted", lambda *args: True)  # as on a GPU
    graphed = tiny_net()
    with caplog.at_level(logging.INFO, logger="kiln.train"):
        r = train(graphed, tiny_data(), with_graph(cfg, "auto"))
    assert len(tries) == 2  # the first failure is tried again a few steps later
    assert r.update_graph == {
        "captured": False,
        "from_step": None,
        "captures": 0,
        "eager_steps_after_capture": 0,
        "failure": "CUDA error: operation not permitted when stream is capturing",
    }
    assert [m.message.split(" (")[0] for m in caplog.records if "capturing the update failed" in m.message] == [
        f"capturing the update failed at step {WARMUP_STEPS + 1}"
    ]
    assert [m.message.split(":")[0] for m in caplog.records if "CUDA graph" in m.message] == [
        "the update after the backward pass runs without a CUDA graph (slower on the host, same result)"
    ]
    assert max_diff(eager, graphed) == 0.0


def test_yaml_on_and_off_are_the_settings_not_booleans() -> None:
    """YAML reads a bare `on` / `off` as true / false; the setting takes them as the words."""
    import yaml

    for text, want in (("on", "on"), ("off", "off"), ("auto", "auto"), ("true", "on")):
        cfg = TrainConfig.model_validate(yaml.safe_load(f"update_graph: {text}"))
        assert cfg.update_graph == want
