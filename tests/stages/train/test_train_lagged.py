"""The sync-free step: non-finite steps skipped on the device (fused optimizers), loss/norm read one step
late, checkpoints only after every earlier step is known good, and device-resident batches in sampler order.

Fused AdamW/SGD run on CPU too, so these exercise on CPU the same code path CUDA takes by default."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from kiln.core.errors import TrainingError
from kiln.stages.train import checkpoint as ckpt
from kiln.stages.train.data import DeviceBatches, make_loader
from kiln.stages.train.dist import DistEnv
from kiln.stages.train.health import (
    BufferGuard,
    LaggedStats,
    StepCheck,
    skip_if_nonfinite,
    skips_on_device,
)
from kiln.stages.train.loop import train
from kiln.stages.train.update_graph import WARMUP_STEPS
from tests.stages.train.train_helpers import max_diff, nan_on_forward, tiny_data, tiny_net, train_cfg

CPU = torch.device("cpu")


def no_buffers() -> BufferGuard:
    return BufferGuard(torch.nn.Linear(2, 2))


def step_values(loss: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
    """A step's [loss, norm] as StepCheck hands them to LaggedStats (its own tensor, rewritten every step)."""
    return StepCheck(CPU, no_buffers())(loss, norm)[0]


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_fused_step_is_skipped_on_device_when_not_finite(optimizer: str) -> None:
    p = torch.nn.Parameter(torch.ones(3))
    cls = torch.optim.AdamW if optimizer == "adamw" else torch.optim.SGD
    opt = cls([p], lr=0.1, fused=True)
    assert skips_on_device(opt) and not skips_on_device(cls([p], lr=0.1))
    for loss, norm, moves in ((float("nan"), 1.0, False), (1.0, float("inf"), False), (1.0, 1.0, True)):
        before = p.detach().clone()
        p.grad = torch.ones(3)
        with skip_if_nonfinite(opt, StepCheck(CPU, no_buffers())(torch.tensor(loss), torch.tensor(norm))[1]):
            opt.step()
        assert (not torch.equal(p.detach(), before)) == moves
        assert not hasattr(opt, "found_inf")  # the attributes GradScaler also uses are removed again
    if optimizer == "adamw":
        assert opt.state[p]["step"].item() == 1.0  # skipped steps do not advance Adam's step count


def test_lagged_stats_release_a_step_only_after_the_next_one() -> None:
    stats = LaggedStats(CPU, lag=1)
    stats.push(1, 0, 8, step_values(torch.tensor(0.5), torch.tensor(2.0)))
    assert list(stats.ready()) == []
    stats.push(2, 0, 8, step_values(torch.tensor(float("nan")), torch.tensor(3.0)))
    ((s, loss, norm),) = stats.ready()
    assert (s.step, loss, norm) == (1, 0.5, 2.0)
    ((s, loss, _),) = stats.drain()
    assert s.step == 2 and loss != loss  # NaN


@pytest.mark.parametrize(
    "loss, norm, skip",
    [
        (0.5, 2.0, 0.0),
        (float("nan"), 2.0, 1.0),
        (0.5, float("inf"), 1.0),
        (float("-inf"), float("inf"), 1.0),
        (3e38, 3e38, 0.0),
    ],
)
def test_the_non_finite_check_flags_nan_or_inf_and_leaves_the_values(loss: float, norm: float, skip: float) -> None:
    check = StepCheck(CPU, no_buffers())
    values, found = check(torch.tensor(loss), torch.tensor(norm))
    assert found.item() == skip
    assert torch.equal(values.nan_to_num(), torch.tensor([loss, norm]).nan_to_num())  # checked with scale 1
    assert check(torch.tensor(0.5), torch.tensor(1.0))[1].item() == 0.0  # the flag is reset every step


def test_lagged_stats_wait_only_when_the_host_is_max_lag_steps_ahead() -> None:
    """Values that have not arrived are not waited for until ``max_lag`` steps are queued; then the oldest is."""

    class Pending:
        done = False

        def query(self) -> bool:
            return self.done

        def synchronize(self) -> None:
            self.done = True

    stats = LaggedStats(CPU, lag=1, max_lag=3)
    events = []
    for step in range(1, 5):
        stats.push(step, 0, 8, step_values(torch.tensor(float(step)), torch.tensor(1.0)))
        events.append(Pending())
        stats.queue[-1].event = events[-1]  # as if on a GPU: the values arrive when the event completes
        released = [s.step for s, _, _ in stats.ready()]
        assert released == ([] if step < 4 else [1])  # step 4: four queued, more than max_lag
    assert events[0].done and not events[1].done
    events[1].done = True  # step 2's values arrived: released without waiting, step 3's not
    assert [s.step for s, _, _ in stats.ready()] == [2]
    assert [s.step for s, _, _ in stats.drain()] == [3, 4]
    assert LaggedStats(CPU, lag=0).max_lag == 0  # the host decides at once: nothing may wait in the queue


def test_buffer_guard_puts_every_buffer_back_only_when_the_step_is_skipped() -> None:
    model = torch.nn.Sequential(torch.nn.BatchNorm1d(4), torch.nn.BatchNorm1d(4))
    model.register_buffer("mask", torch.tensor([0.0, float("-inf")]))
    guard = BufferGuard(model)  # keeps the buffers as they are now
    assert [len(g) for g in guard.groups] == [5, 2]  # float buffers (mean, var x2, mask) and the two counters
    state = lambda: {k: v.clone() for k, v in model.state_dict().items()}  # noqa: E731
    same = lambda a, b: all(torch.equal(v, b[k]) for k, v in a.items())  # noqa: E731
    before = state()
    model(torch.randn(8, 4))  # a step's forward: updates running statistics and num_batches_tracked in place
    guard.settle(torch.tensor(1.0))  # skipped: everything back
    assert same(state(), before)
    model(torch.randn(8, 4))
    guard.settle(torch.tensor(0.0))  # kept: the new values stay, and become what a later skip goes back to
    good = state()
    assert not same(good, before)
    model(torch.randn(8, 4))
    guard.settle(torch.tensor(1.0))
    assert same(state(), good)
    model(torch.randn(8, 4))
    guard.restore()  # decided by the host (a step redone after a compile failure)
    assert same(state(), good)


def test_the_step_check_settles_the_guard_on_its_own_flag() -> None:
    model = torch.nn.BatchNorm1d(4)
    check = StepCheck(CPU, BufferGuard(model))
    before = model.running_mean.clone()
    model(torch.randn(8, 4) * float("nan"))  # a NaN batch writes NaN into the running statistics
    values, found = check(torch.tensor(float("nan")), torch.tensor(1.0))
    assert found.item() == 1.0 and torch.equal(model.running_mean, before)
    model(torch.randn(8, 4))
    check(torch.tensor(0.5), torch.tensor(1.0))
    assert not torch.equal(model.running_mean, before)


def test_fused_training_equals_unfused_training() -> None:
    """Same updates whether the step is decided on the host (lag 0) or on the device (lag 1)."""
    data = tiny_data()
    a, b = tiny_net(), tiny_net()
    ra = train(a, data, train_cfg(optimizer="adamw", lr=0.01, fused=False))
    rb = train(b, data, train_cfg(optimizer="adamw", lr=0.01, fused=True))
    assert max_diff(a, b) < 1e-6
    assert [round(m.loss, 5) for m in ra.history] == [round(m.loss, 5) for m in rb.history]


@pytest.mark.parametrize("precision, amp", [("fp32", {}), ("fp16", {"init_scale": 2.0**24})])
def test_fused_sgd_survives_a_skipped_first_step(precision: str, amp: dict) -> None:
    """torch's fused SGD creates its momentum buffers with empty_like on the first step and fills them in
    the kernel, which a found_inf skip (NaN step, fp16 overflow) bypasses: the next step read garbage."""
    data = tiny_data()
    models = []
    for fused in (False, True):
        m = tiny_net()
        if precision == "fp32":
            nan_on_forward(m, 1)
        r = train(m, data, train_cfg(epochs=2, optimizer="sgd", fused=fused, precision=precision, amp=amp))
        assert sum(h.nonfinite_steps + h.skipped_steps for h in r.history) >= 1  # the first step was skipped
        assert all(torch.isfinite(p).all() for p in m.parameters())
        models.append(m)
    assert max_diff(*models) < 1e-6


@pytest.mark.parametrize("every, poison_at", [(3, 4), (2, 3)])
def test_lagged_nan_abort_names_the_step_and_keeps_the_good_checkpoint(
    tmp_path: Path, every: int, poison_at: int
) -> None:
    """The first NaN step is itself a checkpoint step (5: end of epoch 1; 4: every 2 steps), whose values
    the lag has not read yet when the checkpoint is due: the checkpoint must wait for them, then be refused."""
    model = tiny_net()

    def poison(step: int) -> None:
        if step == poison_at:  # right after a good checkpoint the weights turn NaN: every later loss is NaN
            with torch.no_grad():
                model.net[1].weight.fill_(float("nan"))

    cfg = train_cfg(
        epochs=3, optimizer="adamw", fused=True, checkpoint={"every_steps": every}, amp={"nonfinite_patience": 2}
    )
    with pytest.raises(TrainingError) as err:
        train(model, tiny_data(), cfg, ckpt_dir=tmp_path, run_key="k", on_step=poison)
    msg = str(err.value)
    assert f"3 consecutive steps, at step {poison_at + 3} (epoch 2)" in msg
    assert f"{tmp_path / ckpt.LAST} (step {every})" in msg
    good = ckpt.load_state(tmp_path / ckpt.LAST)
    assert good["global_step"] == every and all(torch.isfinite(v).all() for v in good["model"].values())


def test_lagged_nan_burst_is_skipped_and_counted() -> None:
    data, model = tiny_data(), tiny_net()
    nan_on_forward(model, 5)  # the last step of epoch 1
    r = train(model, data, train_cfg(epochs=2, optimizer="adamw", fused=True, amp={"nonfinite_patience": 1}))
    assert [m.nonfinite_steps for m in r.history] == [1, 0]  # drained into the epoch it belongs to
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_lagged_resume_mid_epoch_is_bit_exact(tmp_path: Path) -> None:
    data = tiny_data(200)
    cfg = train_cfg(
        epochs=3,
        optimizer="adamw",
        lr=0.01,
        fused=True,
        warmup_steps=3,
        checkpoint={"every_steps": 3, "resume": "auto"},
    )
    ref = tiny_net()
    want = train(ref, data, cfg, ckpt_dir=tmp_path / "ref", run_key="k")

    class Crash(Exception):
        pass

    def crash(step: int) -> None:
        if step == 8:
            raise Crash

    with pytest.raises(Crash):
        train(tiny_net(), data, cfg, ckpt_dir=tmp_path / "run", run_key="k", on_step=crash)
    assert json.loads((tmp_path / "run" / ckpt.INFO).read_text())["global_step"] == 6
    resumed = tiny_net(seed=99)
    got = train(resumed, data, cfg, ckpt_dir=tmp_path / "run", run_key="k")
    assert max_diff(ref, resumed) == 0.0
    assert [m.loss for m in got.history] == [m.loss for m in want.history]


def test_device_batches_follow_the_sampler_order() -> None:
    data = tiny_data()
    cfg, on_dev = train_cfg(batch_size=32), train_cfg(batch_size=32, loader={"on_device": True})
    for env in (DistEnv(), DistEnv(1, 2, 1)):
        loader, s1 = make_loader(data.train_x, data.train_y, cfg, env, seed=0, device=CPU)
        batches, s2 = make_loader(data.train_x, data.train_y, on_dev, env, seed=0, device=CPU)
        assert isinstance(batches, DeviceBatches)
        for epoch, start in ((0, 0), (1, 0), (1, 32)):
            s1.set_position(epoch, start)
            s2.set_position(epoch, start)
            got, want = list(batches), list(loader)
            assert len(got) == len(want) == len(batches)
            assert all(torch.equal(g[0], w[0]) and torch.equal(g[1], w[1]) for g, w in zip(got, want))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "precision, on_device, update_graph",
    [
        ("fp32", True, "off"),
        ("fp16", True, "off"),
        ("bf16", True, "off"),
        ("fp16", False, "off"),
        ("fp16", True, "on"),
        ("bf16", False, "on"),
    ],
)
def test_cuda_steps_never_sync(precision: str, on_device: bool, update_graph: str) -> None:
    """Between step 2 (with the update's CUDA graph: after the step that captures it, which synchronises once) and
    the last step of the epoch, any synchronising CUDA call (.item(), a list index copied from pageable memory, ...)
    raises under torch's sync debug mode."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU; none is visible")
    data = tiny_data(400)  # 320 train samples, batch 32: 10 steps in the epoch
    first = 2 if update_graph == "off" else WARMUP_STEPS + 1

    def hook(step: int) -> None:
        torch.cuda.set_sync_debug_mode("error" if first <= step < 10 else "default")

    try:
        r = train(
            tiny_net(),
            data,
            train_cfg(
                epochs=1,
                optimizer="adamw",
                lr=0.01,
                precision=precision,
                device="cuda",
                loader={"on_device": on_device},
                update_graph=update_graph,
            ),
            on_step=hook,
        )
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert r.global_step == 10 and r.history[0].nonfinite_steps == 0
    assert (r.update_graph is not None) == (update_graph == "on")


@pytest.mark.gpu
def test_cuda_lagged_nan_abort(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU; none is visible")
    model = tiny_net()

    def poison(step: int) -> None:
        if step == 4:
            with torch.no_grad():
                model.net[1].weight.fill_(float("nan"))

    cfg = train_cfg(
        epochs=3, optimizer="adamw", device="cuda", checkpoint={"every_steps": 3}, amp={"nonfinite_patience": 2}
    )
    with pytest.raises(TrainingError, match=r"3 consecutive steps, at step 7 \(epoch 2\)"):
        train(model, tiny_data(), cfg, ckpt_dir=tmp_path, run_key="k", on_step=poison)
    assert ckpt.load_state(tmp_path / ckpt.LAST)["global_step"] == 3


@pytest.mark.gpu
def test_cuda_step_check_replays_one_graph_that_flags_and_restores() -> None:
    """On the GPU the flag and the buffer guard are a captured CUDA graph; every replay must see that step's loss
    and norm (written into the same tensor) and the buffers as the forward pass left them."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU; none is visible")
    dev = torch.device("cuda")
    model = torch.nn.Sequential(torch.nn.BatchNorm1d(4), torch.nn.BatchNorm1d(4)).to(dev)
    check = StepCheck(dev, BufferGuard(model))
    assert check.graph is not None
    stats = LaggedStats(dev, lag=1, max_lag=2)
    kept = {k: v.clone() for k, v in model.state_dict().items()}
    seen = []
    for step, (loss, nan_batch) in enumerate(
        [(0.5, False), (float("nan"), True), (0.7, False), (0.9, False), (float("inf"), False), (0.3, False)], start=1
    ):
        x = torch.randn(8, 4, device=dev) * (float("nan") if nan_batch else 1.0)
        model(x)
        values, found = check(torch.tensor(loss, device=dev), torch.tensor(float(step), device=dev))
        stats.push(step, 0, 8, values)
        skipped = not math.isfinite(loss)
        assert found.item() == float(skipped)
        now = {k: v.clone() for k, v in model.state_dict().items()}
        assert all(torch.equal(v, kept[k]) for k, v in now.items()) == skipped
        assert all(torch.isfinite(v).all() for v in now.values())
        kept = now
        seen += [(s.step, norm) for s, _, norm in stats.ready()]
    seen += [(s.step, norm) for s, _, norm in stats.drain()]
    assert seen == [(step, float(step)) for step in range(1, 7)]  # the pinned ring's rows: each step's own values
