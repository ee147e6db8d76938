"""Checkpoints: resume mid-run equals an uninterrupted run; a persistent NaN aborts naming the last good one."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipeline.errors import InputFileError, TrainingError
from stages.train import checkpoint as ckpt
from stages.train.loop import train
from train_helpers import TinyNet, max_diff, nan_on_forward, tiny_data, tiny_net, train_cfg


class Crash(Exception):
    pass


def _crash_at(step: int):
    def hook(global_step: int) -> None:
        if global_step == step:
            raise Crash(f"simulated crash after step {step}")
    return hook


@pytest.mark.parametrize("precision, accum", [("fp32", 1), ("bf16", 2)])
def test_resume_mid_epoch_equals_uninterrupted_run(tmp_path: Path, precision: str, accum: int) -> None:
    data = tiny_data(200)  # 160 train samples, batch 32: 5 steps per epoch, 15 in all
    cfg = train_cfg(epochs=3, optimizer="adamw", lr=0.01, precision=precision, grad_accum_steps=accum,
                    warmup_steps=3, checkpoint={"every_steps": 3, "resume": "auto"})
    ref = tiny_net()
    want = train(ref, data, cfg, ckpt_dir=tmp_path / "ref", run_key="k")

    crashed = tiny_net()
    with pytest.raises(Crash):
        train(crashed, data, cfg, ckpt_dir=tmp_path / "run", run_key="k", on_step=_crash_at(8))  # mid epoch 2
    info = json.loads((tmp_path / "run" / ckpt.INFO).read_text())
    assert info == {"run_key": "k", "epoch": 1, "global_step": 6, "complete": False}

    resumed = tiny_net(seed=99)  # different init: everything must come from the checkpoint
    got = train(resumed, data, cfg, ckpt_dir=tmp_path / "run", run_key="k")
    assert got.resumed_from == str(tmp_path / "run" / ckpt.LAST)
    assert max_diff(ref, resumed) == 0.0
    assert [m.loss for m in got.history] == [m.loss for m in want.history]
    assert [m.val_accuracy for m in got.history] == [m.val_accuracy for m in want.history]
    assert got.global_step == want.global_step == 15


def test_finished_run_or_other_key_starts_fresh(tmp_path: Path) -> None:
    data, cfg = tiny_data(), train_cfg(epochs=1, checkpoint={"resume": "auto"})
    train(tiny_net(), data, cfg, ckpt_dir=tmp_path, run_key="a")
    assert json.loads((tmp_path / ckpt.INFO).read_text())["complete"] is True
    assert train(tiny_net(), data, cfg, ckpt_dir=tmp_path, run_key="a").resumed_from is None
    assert ckpt.find_resume("auto", tmp_path, "b") is None


def test_best_and_last_checkpoints_and_select_best(tmp_path: Path) -> None:
    data = tiny_data()
    model = tiny_net()
    r = train(model, data, train_cfg(epochs=3, checkpoint={"select": "best"}), ckpt_dir=tmp_path, run_key="k")
    from safetensors.torch import load_file

    best = load_file(str(tmp_path / ckpt.BEST))
    assert r.best_epoch is not None and r.best_val_accuracy == max(m.val_accuracy for m in r.history)
    assert all(torch.equal(best[k], v) for k, v in model.state_dict().items())  # select: best loaded it
    state = ckpt.load_state(tmp_path / ckpt.LAST)
    assert state["complete"] and state["global_step"] == r.global_step


def test_resume_from_a_wrong_file_is_a_user_error(tmp_path: Path) -> None:
    bad = tmp_path / "x.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(InputFileError, match="cannot read training checkpoint"):
        train(tiny_net(), tiny_data(), train_cfg(checkpoint={"resume": str(bad)}))
    with pytest.raises(InputFileError, match="not found"):
        train(tiny_net(), tiny_data(), train_cfg(checkpoint={"resume": str(tmp_path / "missing.pt")}))


def test_resume_from_another_models_or_optimizers_checkpoint_is_a_user_error(tmp_path: Path) -> None:
    train(tiny_net(), tiny_data(), train_cfg(epochs=1), ckpt_dir=tmp_path, run_key="a")
    resume = {"resume": str(tmp_path / ckpt.LAST)}
    torch.manual_seed(0)
    with pytest.raises(InputFileError, match="cannot resume from .*size mismatch"):
        train(TinyNet(hidden=8), tiny_data(), train_cfg(checkpoint=resume))
    with pytest.raises(InputFileError, match="cannot resume from"):
        train(tiny_net(), tiny_data(), train_cfg(optimizer="adamw", checkpoint=resume))


def test_persistent_nan_aborts_naming_step_and_last_good_checkpoint(tmp_path: Path) -> None:
    model = tiny_net()

    def poison(step: int) -> None:
        if step == 4:  # after the checkpoint of step 3, the weights turn NaN: every later loss is NaN
            with torch.no_grad():
                model.net[1].weight.fill_(float("nan"))

    cfg = train_cfg(epochs=3, checkpoint={"every_steps": 3}, amp={"nonfinite_patience": 2})
    with pytest.raises(TrainingError) as err:
        train(model, tiny_data(), cfg, ckpt_dir=tmp_path, run_key="k", on_step=poison)
    msg = str(err.value)
    assert "3 consecutive steps, at step 7" in msg
    assert f"{tmp_path / ckpt.LAST} (step 3)" in msg
    good = ckpt.load_state(tmp_path / ckpt.LAST)
    assert good["global_step"] == 3 and all(torch.isfinite(v).all() for v in good["model"].values())


def test_short_nan_burst_within_patience_is_skipped(tmp_path: Path) -> None:
    """One NaN batch: that step is skipped (weights untouched), training goes on and stays finite."""
    data, model = tiny_data(), tiny_net()
    nan_on_forward(model, 2)
    r = train(model, data, train_cfg(epochs=1, amp={"nonfinite_patience": 1}))
    assert r.history[0].nonfinite_steps == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())
