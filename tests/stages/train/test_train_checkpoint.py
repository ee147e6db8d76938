"""Checkpoints: resume mid-run equals an uninterrupted run; a persistent NaN aborts naming the last good one."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from kiln.core.errors import InputFileError, TrainingError
from kiln.stages.train import checkpoint as ckpt
from kiln.stages.train.declaration import TrainSummary
from kiln.stages.train.loop import evaluate, train
from tests.stages.train.train_helpers import (
    Crash,
    TinyNet,
    bn_net,
    crash_at,
    max_diff,
    nan_inside,
    nan_on_forward,
    tiny_data,
    tiny_net,
    train_cfg,
)


@pytest.mark.parametrize("precision, accum", [("fp32", 1), ("bf16", 2)])
def test_resume_mid_epoch_equals_uninterrupted_run(tmp_path: Path, precision: str, accum: int) -> None:
    data = tiny_data(200)  # 160 train samples, batch 32: 5 steps per epoch, 15 in all
    cfg = train_cfg(
        epochs=3,
        optimizer="adamw",
        lr=0.01,
        precision=precision,
        grad_accum_steps=accum,
        warmup_steps=3,
        checkpoint={"every_steps": 3, "resume": "auto"},
    )
    ref = tiny_net()
    want = train(ref, data, cfg, ckpt_dir=tmp_path / "ref", run_key="k")

    crashed = tiny_net()
    with pytest.raises(Crash):
        train(crashed, data, cfg, ckpt_dir=tmp_path / "run", run_key="k", on_step=crash_at(8))  # mid epoch 2
    info = json.loads((tmp_path / "run" / ckpt.INFO).read_text())
    assert {k: info[k] for k in ("run_key", "epoch", "global_step", "complete")} == {
        "run_key": "k",
        "epoch": 1,
        "global_step": 6,
        "complete": False,
    }
    assert info["settings"] == ckpt.settings_digest(cfg.model_dump(mode="json"))

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


def test_finished_run_differing_in_plot_alone_is_taken_not_trained_again(tmp_path: Path) -> None:
    """Toggling train.plot asks for loss.png, not new weights: the finished run is taken whole (its weights and
    history), last.json then stands for the new setting, and a run asked for again with equal settings trains."""
    data = tiny_data()
    for out in "abcd":
        (tmp_path / out).mkdir()
    plotted = train_cfg(epochs=2, plot=True, checkpoint={"resume": "auto"})
    first = tiny_net()
    want = train(first, data, plotted, ckpt_dir=tmp_path / "ck", run_key="k", out_dir=tmp_path / "a")
    assert (tmp_path / "a" / "loss.png").is_file()

    def trained_steps(cfg: object, out: str, seed: int) -> tuple[object, list[int]]:
        steps: list[int] = []
        model = tiny_net(seed=seed)
        got = train(
            model,
            data,
            cfg,
            ckpt_dir=tmp_path / "ck",
            run_key="k",
            out_dir=tmp_path / out,
            on_step=lambda *a: steps.append(1),
        )
        assert max_diff(first, model) == 0.0  # the same weights either way (taken, or trained alike)
        return got, steps

    unplotted = plotted.model_copy(update={"plot": False})
    got, steps = trained_steps(unplotted, "b", seed=7)
    assert steps == [] and got.resumed_from == str(tmp_path / "ck" / ckpt.LAST)
    assert [m.loss for m in got.history] == [m.loss for m in want.history]
    assert not (tmp_path / "b" / "loss.png").exists()
    got, steps = trained_steps(plotted, "c", seed=8)  # and back: last.json recorded plot: false
    assert steps == [] and (tmp_path / "c" / "loss.png").is_file()
    got, steps = trained_steps(plotted, "d", seed=0)  # the same settings again (a forced rerun): trained
    assert len(steps) == want.global_step and got.resumed_from is None


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


@pytest.mark.parametrize(
    "optimizer, fused, precision", [("sgd", False, "fp32"), ("adamw", True, "fp32"), ("sgd", False, "fp16")]
)
def test_skipped_step_leaves_batchnorm_statistics_as_they_were(
    tmp_path: Path, optimizer: str, fused: bool, precision: str
) -> None:
    """A NaN inside the network reaches BatchNorm's running statistics in the forward pass. The skipped step
    (host-decided, on the device for fused optimizers, by the GradScaler for fp16) must put them back."""
    model = bn_net()
    nan_inside(model[1], {3})  # step 3's batch blows up before the BatchNorm
    states: dict[int, dict[str, torch.Tensor]] = {}

    def snapshot(step: int) -> None:
        if step in (2, 3):
            states[step] = {k: v.clone() for k, v in model.state_dict().items()}

    cfg = train_cfg(
        epochs=2, optimizer=optimizer, fused=fused, precision=precision, checkpoint={"every_steps": 3, "resume": "auto"}
    )
    r = train(model, tiny_data(), cfg, ckpt_dir=tmp_path, run_key="k", on_step=snapshot)
    assert sum(m.nonfinite_steps for m in r.history) == 1
    assert all(torch.equal(states[2][k], states[3][k]) for k in states[2])  # step 3 changed nothing
    assert all(torch.isfinite(v).all() for v in model.state_dict().values() if v.is_floating_point())
    last = ckpt.load_state(tmp_path / ckpt.LAST)
    assert last["complete"] and all(torch.isfinite(v).all() for v in last["model"].values() if v.is_floating_point())


def test_resume_follows_the_configured_lr_and_schedule_length(tmp_path: Path) -> None:
    """The abort's advice (lower train.lr, resume from last.pt) must take effect, and resuming with more
    epochs must continue the longer run's cosine, not the old one's."""
    data = tiny_data(200)  # 5 steps per epoch
    train(tiny_net(), data, train_cfg(epochs=1, lr=0.05, schedule="constant"), ckpt_dir=tmp_path / "a", run_key="a")
    lowered = train(
        tiny_net(),
        data,
        train_cfg(epochs=3, lr=0.0005, schedule="constant", checkpoint={"resume": str(tmp_path / "a" / ckpt.LAST)}),
    )
    assert [m.lr for m in lowered.history] == [0.05, 0.0005, 0.0005]

    train(tiny_net(), data, train_cfg(epochs=2, lr=0.05), ckpt_dir=tmp_path / "b", run_key="b")
    longer = train(
        tiny_net(), data, train_cfg(epochs=4, lr=0.05, checkpoint={"resume": str(tmp_path / "b" / ckpt.LAST)})
    )
    fresh = train(tiny_net(), data, train_cfg(epochs=4, lr=0.05))
    assert [m.lr for m in longer.history[2:]] == [m.lr for m in fresh.history[2:]]  # bit-identical: replayed


def _best_run(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    train(
        tiny_net(),
        tiny_data(),
        train_cfg(epochs=2, checkpoint={"select": "best"}),
        ckpt_dir=tmp_path / "a",
        run_key="a",
    )
    return tmp_path / "a" / ckpt.LAST, load_file(str(tmp_path / "a" / ckpt.BEST))


def test_select_best_after_resuming_another_runs_checkpoint(tmp_path: Path) -> None:
    """best.safetensors lies beside the resumed last.pt, not in the new run's folder; a stale best of some
    other run in the new folder must not be taken for it."""
    from safetensors.torch import load_file, save_file

    last, best = _best_run(tmp_path)
    (tmp_path / "b").mkdir()
    save_file(tiny_net(seed=7).state_dict(), str(tmp_path / "b" / ckpt.BEST))  # an unrelated run's
    for folder in ("b", "c"):  # stale best there / nothing there
        model = tiny_net(seed=99)
        cfg = train_cfg(epochs=2, checkpoint={"select": "best", "resume": str(last)})  # finished: no new epoch
        r = train(model, tiny_data(), cfg, ckpt_dir=tmp_path / folder, run_key="new")
        assert all(torch.equal(best[k], v) for k, v in model.state_dict().items())
        assert load_file(str(tmp_path / folder / ckpt.BEST)).keys() == best.keys()
        assert r.selected_epoch == r.best_epoch


def test_missing_best_of_the_resumed_run_is_not_replaced_by_a_stale_one(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    last, _ = _best_run(tmp_path)
    (tmp_path / "a" / ckpt.BEST).unlink()
    (tmp_path / "b").mkdir()
    stale = tiny_net(seed=7)
    save_file(stale.state_dict(), str(tmp_path / "b" / ckpt.BEST))
    model = tiny_net(seed=99)
    r = train(
        model,
        tiny_data(),
        train_cfg(epochs=2, checkpoint={"select": "best", "resume": str(last)}),
        ckpt_dir=tmp_path / "b",
        run_key="new",
    )
    assert max_diff(model, stale) > 0 and r.best_epoch is None and r.selected_epoch == 2  # the last weights


def test_select_best_reports_the_selected_epochs_metrics(tmp_path: Path) -> None:
    data, model = tiny_data(), tiny_net()

    def spoil(step: int) -> None:
        if step > 5:  # after epoch 1: the classifier outputs constants, so later epochs are worse
            with torch.no_grad():
                model.net[4].weight.zero_()
                model.net[4].bias.zero_()

    r = train(
        model, data, train_cfg(epochs=3, checkpoint={"select": "best"}), ckpt_dir=tmp_path, run_key="k", on_step=spoil
    )
    assert r.best_epoch == 1 and r.history[-1].val_accuracy < r.history[0].val_accuracy
    s = r.summary()
    assert s["selected_epoch"] == 1 and len(s["epochs"]) == 3  # the history stays complete
    assert s["val_accuracy"] == r.best_val_accuracy == evaluate(model, data.val_x, data.val_y, torch.device("cpu"))


def test_epoch_without_a_finite_step_reports_nan_loss() -> None:
    model = tiny_net()
    nan_inside(model.net[1], set(range(1, 6)))  # every step of epoch 1 (5 steps)
    r = train(model, tiny_data(), train_cfg(epochs=2, amp={"nonfinite_patience": 10}))
    assert math.isnan(r.history[0].loss) and r.history[0].nonfinite_steps == 5
    assert math.isfinite(r.history[1].loss)


def test_a_model_with_an_inf_buffer_still_checkpoints(tmp_path: Path) -> None:
    """A -inf mask buffer is legitimate: only weights and optimizer state are checked for NaN/Inf before a save
    (all state once was, and such a model never got a last.pt)."""
    model = tiny_net()
    model.register_buffer("mask", torch.tensor([0.0, float("-inf")]))
    train(model, tiny_data(), train_cfg(epochs=1, checkpoint={"every_steps": 2}), ckpt_dir=tmp_path, run_key="k")
    state = ckpt.load_state(tmp_path / ckpt.LAST)
    assert state["complete"] and torch.isinf(state["model"]["mask"]).any()


def _interrupted_then_rerun(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed_after: int) -> TrainSummary:
    """The train stage in the pipeline on a user data function (seed 0), interrupted mid-run; then the data
    function's seed set to ``seed_after`` (0: unchanged) and the stage run again: its summary."""
    import kiln.stages.train.stage as train_stage
    from kiln.pipeline.config import config_from_dict
    from kiln.pipeline.runner import Runner
    from kiln.pipeline.stage_list import STAGES
    from tests.conftest import tiny_config_dict

    module = tmp_path / "user_data_resume.py"
    source = "from kiln.models.datasets import synthetic\n\ndef load():\n    return synthetic(size=256, seed={})\n"
    module.write_text(source.format(0))
    monkeypatch.syspath_prepend(str(tmp_path))
    config = config_from_dict(
        tiny_config_dict(**{"data.name": "user_data_resume:load", "train.epochs": 3, "train.checkpoint.every_steps": 1})
    )
    real_train = train_stage.train
    monkeypatch.setattr(train_stage, "train", lambda *a, **k: real_train(*a, **k, on_step=crash_at(3)))
    with pytest.raises(Crash):
        Runner(config, tmp_path / "w", STAGES).run(stop="train")
    monkeypatch.setattr(train_stage, "train", real_train)
    module.write_text(source.format(seed_after))
    monkeypatch.delitem(sys.modules, "user_data_resume", raising=False)
    result = Runner(config, tmp_path / "w", STAGES).run(stop="train")
    assert result.ok, result.error
    return result.records[-1].summary


def test_an_interrupted_run_resumes_when_code_and_data_are_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    summary = _interrupted_then_rerun(tmp_path, monkeypatch, seed_after=0)
    assert summary.resumed_from is not None and summary.resumed_from.endswith(ckpt.LAST)


def test_an_interrupted_run_of_other_data_is_not_resumed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Its last.pt was trained on what the data function returned before it was edited: training starts afresh,
    and says why."""
    with caplog.at_level("WARNING", logger="kiln.train"):
        summary = _interrupted_then_rerun(tmp_path, monkeypatch, seed_after=1)
    assert summary.resumed_from is None
    said = [r.getMessage() for r in caplog.records if "not resuming" in r.getMessage()]
    assert len(said) == 1, said
    assert "the user's code (user_data_resume:load) and the data (dataset) changed" in said[0]


def test_changed_sources_names_what_changed() -> None:
    old = {"code": "a", "user_code": {"m:f": "1"}, "user_data": {"dataset": "d1"}}
    assert ckpt.changed_sources(old, old) == ""
    assert ckpt.changed_sources(old, None) == ""  # nothing to compare with: as before
    assert ckpt.changed_sources(old, {**old, "user_data": {"dataset": "d2"}}) == (
        "the data (dataset) changed since it was written"
    )
    assert ckpt.changed_sources(old, {**old, "code": "b"}) == "Kiln's training code changed since it was written"
    assert "does not record" in ckpt.changed_sources(None, old)


def test_find_resume_skips_a_checkpoint_of_other_sources(tmp_path: Path) -> None:
    data, cfg = tiny_data(), train_cfg(epochs=2, checkpoint={"every_steps": 1, "resume": "auto"})
    with pytest.raises(Crash):
        train(tiny_net(), data, cfg, ckpt_dir=tmp_path, run_key="k", on_step=crash_at(3), sources={"code": "a"})
    assert json.loads((tmp_path / ckpt.INFO).read_text())["sources"] == {"code": "a"}
    assert ckpt.find_resume("auto", tmp_path, "k", {"code": "a"}) == tmp_path / ckpt.LAST
    assert ckpt.find_resume("auto", tmp_path, "k", {"code": "b"}) is None
    assert train(tiny_net(), data, cfg, ckpt_dir=tmp_path, run_key="k", sources={"code": "b"}).resumed_from is None


def test_select_best_of_a_regression_picks_the_lowest_validation_loss(tmp_path: Path) -> None:
    """Float targets have no accuracy: the epochs are ranked by validation loss, and the summary says so."""
    from kiln.models.datasets import synthetic_regression
    from kiln.stages.train.loop import evaluate_loss_acc
    from kiln.stages.train.task import Task

    data, task = synthetic_regression(size=160), Task("regression")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))

    def spoil(step: int) -> None:
        if step > 4:  # after epoch 1 (4 steps): a constant answer far off the targets, so later epochs are worse
            with torch.no_grad():
                model[2].weight.zero_()
                model[2].bias.fill_(5.0)

    cfg = train_cfg(epochs=3, checkpoint={"select": "best"})
    r = train(model, data, cfg, ckpt_dir=tmp_path, run_key="k", on_step=spoil, task=task)
    losses = [m.val_loss for m in r.history]
    assert losses[0] < min(losses[1:]) and all(m.val_accuracy is None for m in r.history)
    assert r.best_epoch == r.selected_epoch == 1 and r.best_by == "val_loss" and r.best_val_loss == losses[0]
    s = r.summary()
    assert s["selected_epoch"] == 1 and s["best_by"] == "val_loss" and s["val_loss"] == losses[0]
    got = evaluate_loss_acc(model, data.val_x, data.val_y, torch.device("cpu"), task=task)[0]
    assert got == pytest.approx(losses[0])  # the returned weights are epoch 1's


def test_an_explicit_resume_of_a_finished_run_is_a_resume_saved_here(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Only auto's own finished run is taken as it is; a path given to resume from is resumed like any other, so
    this run's folder gets its last.pt, and nothing says that only train.plot differed."""
    data = tiny_data()
    train(tiny_net(), data, train_cfg(epochs=2), ckpt_dir=tmp_path / "done", run_key="k")
    cfg = train_cfg(epochs=2, lr=0.5, checkpoint={"resume": str(tmp_path / "done" / ckpt.LAST)})
    with caplog.at_level("INFO", logger="kiln.train"):
        got = train(tiny_net(), data, cfg, ckpt_dir=tmp_path / "here", run_key="other")
    assert got.resumed_from == str(tmp_path / "done" / ckpt.LAST)
    assert not any("took the finished run" in r.getMessage() for r in caplog.records)
    assert (tmp_path / "here" / ckpt.LAST).is_file()


def test_select_best_breaks_a_validation_accuracy_tie_by_the_lower_validation_loss(tmp_path: Path) -> None:
    """12 held-out samples: epochs 5 and 6 both reach accuracy 1.0; the later one's lower loss makes it the best."""
    cfg = train_cfg(epochs=6, lr=0.1, checkpoint={"select": "best"})
    r = train(tiny_net(), tiny_data(60), cfg, ckpt_dir=tmp_path, run_key="k")
    top = max(m.val_accuracy for m in r.history)
    tied = [m for m in r.history if m.val_accuracy == top]
    assert len(tied) > 1, [(m.epoch, m.val_accuracy) for m in r.history]  # the case this test is about
    assert r.best_epoch == min(tied, key=lambda m: m.val_loss).epoch != tied[0].epoch


def test_new_settings_after_an_interruption_train_afresh_naming_the_interrupted_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`auto` resumes a run of the same settings only; a changed lr trains afresh in its own folder, and the log
    names the interrupted run's last.pt and the --set that continues it with the new settings."""
    data, cfg = tiny_data(), train_cfg(epochs=2, checkpoint={"every_steps": 1, "resume": "auto"})
    old, new = tmp_path / "train" / "old", tmp_path / "train" / "new"
    with pytest.raises(Crash):
        train(tiny_net(), data, cfg, ckpt_dir=old, run_key="old", on_step=crash_at(3))
    with caplog.at_level("WARNING", logger="kiln.train"):
        assert ckpt.find_resume("auto", new, "new") is None
    assert f"--set train.checkpoint.resume={old / ckpt.LAST}" in caplog.text
    caplog.clear()
    train(tiny_net(), data, train_cfg(epochs=1, checkpoint={"resume": "auto"}), ckpt_dir=old, run_key="old2")
    with caplog.at_level("WARNING", logger="kiln.train"):  # finished now: nothing to continue
        assert ckpt.find_resume("auto", new, "new") is None
    assert "interrupted run" not in caplog.text


def test_a_nan_streak_says_a_few_steps_and_a_fix_other_than_the_precision_in_use(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """26 warning lines drowned the error, and its fix offered the precision the run already had."""
    model = tiny_net()

    def poison(step: int) -> None:
        with torch.no_grad():
            model.net[1].weight.fill_(float("nan"))

    cfg = train_cfg(epochs=3, amp={"nonfinite_patience": 8})
    with caplog.at_level("WARNING", logger="kiln.train"), pytest.raises(TrainingError) as err:
        train(model, tiny_data(), cfg, ckpt_dir=tmp_path, run_key="k", on_step=poison)
    skipped = [r for r in caplog.records if "skipped: loss" in r.getMessage()]
    assert len(skipped) == 3 and "further skipped steps of this streak at -v" in skipped[-1].getMessage()
    assert "9 consecutive steps" in str(err.value) and " in fp32;" in str(err.value)
    assert err.value.hint.startswith("lower train.lr, or raise train.amp.nonfinite_patience;")
