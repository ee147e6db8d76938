"""The train stage in the pipeline: artifacts, JSON summary in the manifest, skip paths, plot and trace."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from kiln.models.model_io import load_trained
from kiln.pipeline.config import config_from_dict
from kiln.pipeline.runner import Runner
from kiln.pipeline.stage_list import STAGES
from tests.conftest import tiny_config_dict


def _run(tmp_path: Path, **overrides: object) -> tuple[dict, Path]:
    cfg = config_from_dict(tiny_config_dict(**overrides))
    result = Runner(cfg, tmp_path, STAGES).run(stop="train")
    assert result.ok, result.error
    return json.loads((tmp_path / "train" / "manifest.json").read_text()), tmp_path / "train"


def test_stage_writes_weights_plot_and_per_epoch_metrics(tmp_path: Path) -> None:
    manifest, out = _run(tmp_path, **{"train.precision": "bf16"})
    s = manifest["summary"]
    assert {"model.safetensors", "model.json", "loss.png"} <= set(manifest["outputs"])
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(s["epochs"]) == 2 and s["precision"] == "bf16" and s["world_size"] == 1
    for m in s["epochs"]:
        assert m["samples_per_s"] > 0 and m["peak_memory_mb"] > 0 and m["val_accuracy"] is not None
        assert m["loss_scale"] is None  # bf16 needs no scaler
    assert s["val_accuracy"] == s["epochs"][-1]["val_accuracy"]
    json.dumps(s)  # JSON-able (it also went through the manifest)
    model = load_trained(out, config_from_dict(tiny_config_dict()).model)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert Path(s["checkpoint_dir"], "last.pt").is_file()


def test_a_dynamic_axis_of_an_input_the_model_lacks_fails_before_training(tmp_path: Path, monkeypatch) -> None:
    """A typo in signature.dynamic_axes is found before any epoch, not by the export after training."""
    import kiln.stages.train.stage as train_stage

    monkeypatch.setattr(train_stage, "train", lambda *a, **k: pytest.fail("training started"))
    cfg = config_from_dict(tiny_config_dict(**{"signature.dynamic_axes": {"inpt": {2: "h"}}}))
    result = Runner(cfg, tmp_path, STAGES).run(stop="train")
    assert "signature.dynamic_axes names ['inpt'], which are not model inputs ['input']" in str(result.error)
    assert [r.status for r in result.records] == ["failed"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("setting", ["train.device", "train.update_graph"])
def test_a_setting_this_machine_cannot_honour_is_refused_before_the_data_load(
    tmp_path: Path, monkeypatch, setting: str
) -> None:
    from kiln.core.stage import StageContext

    monkeypatch.setattr(StageContext, "dataset", lambda self: pytest.fail("data loaded"))
    value = {"train.device": "cuda", "train.update_graph": "on"}[setting]
    cfg = config_from_dict(tiny_config_dict(**{setting: value}))
    result = Runner(cfg, tmp_path, STAGES).run(stop="train")
    assert setting in str(result.error) or "no CUDA GPU" in str(result.error)
    assert "set train." in result.error.hint


def test_same_seed_same_weights(tmp_path: Path) -> None:
    same = {"train.deterministic": True, "train.precision": "fp32", "train.epochs": 1}
    _, a = _run(tmp_path / "a", **same)
    _, b = _run(tmp_path / "b", **same)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert not torch.are_deterministic_algorithms_enabled()  # the global switch was restored


def test_profiler_trace_and_eval_every(tmp_path: Path) -> None:
    manifest, out = _run(tmp_path, **{"train.profile_steps": 2, "train.eval_every": 2, "train.plot": False})
    trace = json.loads((out / "trace.json").read_text())
    assert trace["traceEvents"] and "trace.json" in manifest["summary"]["files"]
    assert not (out / "loss.png").exists()
    assert [m["val_accuracy"] is not None for m in manifest["summary"]["epochs"]] == [False, True]


def test_the_profilers_own_start_and_stop_lines_are_not_on_stderr(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    """kineto prints them from C++ whatever the log level (`-q` too); other lines written there stay."""
    import os

    from kiln.stages.train.runtime import KINETO_NOISE, stderr_without

    _run(tmp_path, **{"train.profile_steps": 2, "train.epochs": 1, "train.plot": False})
    assert "SyncActivityProfilerHandler" not in capfd.readouterr().err
    with stderr_without(KINETO_NOISE):
        os.write(2, b"USDT:2026-12-05 18:24:41 1:1 SyncActivityProfilerHandler.cpp:52] profiler_start\nkept\n")
    assert capfd.readouterr().err == "kept\n"


def test_profile_longer_than_the_run_says_how_many_steps_it_traced(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kiln.stages.train.loop import train
    from tests.stages.train.train_helpers import tiny_data, tiny_net, train_cfg

    monkeypatch.setattr(logging.getLogger("kiln"), "propagate", True)  # the CLI tests turn it off
    caplog.set_level(logging.INFO, logger="kiln.train")
    r = train(tiny_net(), tiny_data(), train_cfg(epochs=1, profile_steps=50), out_dir=tmp_path)  # 5 steps
    assert "trace.json" in r.files
    assert "profiler trace of 3 steps, not 50: the run has only 5 steps" in caplog.text


@pytest.mark.parametrize("how", ["disabled", "checkpoint"])
def test_skipped_training(tmp_path: Path, how: str) -> None:
    over: dict[str, object] = {"train.enabled": False}
    if how == "checkpoint":
        from safetensors.torch import save_file

        from kiln.models.registry import build_model

        ck = tmp_path / "w.safetensors"
        save_file(build_model("cnn", {"width": 8, "depth": 2}).state_dict(), str(ck))
        over = {"model.checkpoint": str(ck)}
    cfg = config_from_dict(tiny_config_dict(**over))
    rec = Runner(cfg, tmp_path / "wd", STAGES).run(stop="train").records[0]
    assert rec.status == "skipped" and 0.0 <= rec.summary.val_accuracy <= 1.0


def loss_of_another_models_outputs(outputs: object, targets: torch.Tensor) -> torch.Tensor:
    """A loss written for outputs this model does not give (CenterNet's, keyed 'heatmap')."""
    raise KeyError("heatmap")


@pytest.mark.parametrize("how", ["disabled", "checkpoint"])
def test_skipped_training_calls_no_loss(
    tmp_path: Path, how: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With model.checkpoint given, train.loss was still tried on the outputs, and a loss that failed there
    stopped a run that trains nothing; the untrained val accuracy is read off the logits, which needs no loss."""
    from safetensors.torch import save_file

    from kiln.models.registry import build_model

    ck = tmp_path / "w.safetensors"
    save_file(build_model("cnn", {"width": 8, "depth": 2}).state_dict(), str(ck))
    over = {"train.enabled": False} if how == "disabled" else {"model.checkpoint": str(ck)}
    over["train.loss"] = f"{__name__}:loss_of_another_models_outputs"
    monkeypatch.setattr(logging.getLogger("kiln"), "propagate", True)  # the CLI tests turn it off
    caplog.set_level(logging.INFO, logger="kiln")
    result = Runner(config_from_dict(tiny_config_dict(**over)), tmp_path / "wd", STAGES).run(stop="train")
    assert result.ok, result.error
    rec = result.records[0]
    assert rec.status == "skipped" and 0.0 <= rec.summary.val_accuracy <= 1.0
    said = [r.getMessage() for r in caplog.records if "train.loss" in r.getMessage()]
    assert len(said) == 1 and "not called: training is skipped" in said[0], said


def test_rerun_after_a_crash_resumes_and_matches_an_uninterrupted_run(tmp_path: Path) -> None:
    from kiln.pipeline.runner import cache_key, load_dataset, settings_for
    from kiln.pipeline.stage_list import stage_named
    from kiln.stages.train.checkpoint import run_key
    from kiln.stages.train.loop import train
    from kiln.stages.train.stage import build_seeded, trained_from

    over = {
        "train.precision": "fp32",
        "train.deterministic": True,
        "train.checkpoint.every_steps": 2,
        "train.batch_size": 64,
    }
    cfg = config_from_dict(tiny_config_dict(**over))
    settings = settings_for(stage_named("train"), cfg)
    key = run_key(settings.dump())
    ck = tmp_path / "crashed" / "cache" / "train" / key

    def crash(step: int) -> None:
        if step == 5:
            raise KeyboardInterrupt  # what Ctrl-C mid-epoch looks like to the loop

    # the code and data it trains from, recorded as the stage records them (a checkpoint resumes only from the same)
    sources = trained_from(cache_key(stage_named("train"), cfg, tmp_path / "crashed")[1])
    with pytest.raises(KeyboardInterrupt):
        model, data = build_seeded(settings), load_dataset(cfg)
        train(model, data, cfg.train, seed=cfg.seed, ckpt_dir=ck, run_key=key, on_step=crash, sources=sources)
    resumed, out = _run(tmp_path / "crashed", **over)
    fresh, ref = _run(tmp_path / "fresh", **over)
    assert resumed["summary"]["resumed_from"] == str(ck / "last.pt")
    assert fresh["summary"]["resumed_from"] is None
    assert (out / "model.safetensors").read_bytes() == (ref / "model.safetensors").read_bytes()


def test_skipped_training_with_logits_that_do_not_fit_the_labels_is_the_training_error(tmp_path: Path) -> None:
    """With train.enabled false the untrained model's evaluation met the mismatch first: a torch traceback."""
    cfg = config_from_dict(tiny_config_dict(**{"train.enabled": False, "model.params.num_classes": 3}))
    result = Runner(cfg, tmp_path / "wd", STAGES).run(stop="train")
    assert "gives class logits of shape (2, 3) for a batch of 2, but the dataset has 10 classes" in str(result.error)
    assert [r.status for r in result.records] == ["failed"]
    assert "num_labels in a transformers config" in result.error.hint  # the name a transformers user knows


def test_a_model_in_bfloat16_is_refused_before_training() -> None:
    """Its weights trained in bf16 (no FP32 master weights) and the export then failed with a dtype traceback."""
    from kiln.core.errors import ModelError
    from kiln.stages.train.stage import check_fp32

    check_fp32(torch.nn.Linear(2, 2), "m:build")
    with pytest.raises(ModelError, match="model 'm:build' has bfloat16 weights") as err:
        check_fp32(torch.nn.Linear(2, 2).bfloat16(), "m:build")
    assert "return the model in float32" in err.value.hint


def test_labels_among_the_inputs_are_refused_before_training_not_after() -> None:
    """A Hugging Face-style model given its labels returns its loss: the export refused it, after training."""
    from kiln.core.data import DataContractError, DatasetSplits
    from kiln.stages.train.stage import check_model_fits_data

    class WithLoss(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 2)

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            logits = self.fc(x)
            return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}

    x = {"x": torch.randn(6, 4), "labels": torch.zeros(6, dtype=torch.long)}
    y = torch.zeros(6, dtype=torch.long)
    data = DatasetSplits({k: v[:4] for k, v in x.items()}, y[:4], {k: v[4:] for k, v in x.items()}, y[4:], 2)
    with pytest.raises(DataContractError, match="output 'loss' is a scalar with its input 'labels'"):
        check_model_fits_data(WithLoss(), data, "m:build")


def test_labels_given_by_position_are_named_by_forward_and_a_table_output_is_no_loss() -> None:
    """nanoGPT's forward(idx, targets) fed a tuple; a class-conditional model whose `prototypes` output has no batch
    axis is no loss (the export serves it unbatched)."""
    from kiln.core.data import DataContractError, DatasetSplits
    from kiln.stages.train.stage import check_model_fits_data

    class Gpt(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(5, 5)

        def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            logits = self.emb(idx)
            return logits, torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    class Conditional(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = torch.nn.Parameter(torch.randn(5, 8))

        def forward(self, x: torch.Tensor, class_labels: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"emb": x @ self.table[:4] + self.table[class_labels], "prototypes": self.table}

    ids = torch.randint(0, 5, (6, 3))
    y = torch.zeros(6, 3, dtype=torch.long)
    tokens = DatasetSplits((ids[:4], ids[:4]), y[:4], (ids[4:], ids[4:]), y[4:], 5)
    with pytest.raises(DataContractError, match="output 'output_1' is a scalar with its input 'targets'"):
        check_model_fits_data(Gpt(), tokens, "gpt:build")
    x = {"x": torch.randn(6, 4), "class_labels": torch.zeros(6, dtype=torch.long)}
    target = torch.randn(6, 8)
    cond = DatasetSplits({k: v[:4] for k, v in x.items()}, target[:4], {k: v[4:] for k, v in x.items()}, target[4:], 0)
    check_model_fits_data(Conditional(), cond, "cond:build")


class _Forecaster(torch.nn.Module):
    """Hugging Face's forecasters' shape: ``forward(past_values, **kwargs)``; given the future (keyword ``label``)
    it returns the scalar loss against it beside the forecast. ``always``: a scalar ``loss`` of its input alone,
    returned on every call (no input is labels)."""

    def __init__(self, label: str = "future_values", always: bool = False) -> None:
        super().__init__()
        self.fc, self.label, self.always = torch.nn.Linear(4, 2), label, always

    def forward(self, past_values: torch.Tensor, **kwargs: torch.Tensor) -> dict[str, torch.Tensor]:
        prediction = self.fc(past_values)
        future = kwargs.get(self.label)
        if self.always:
            return {"prediction": prediction, "loss": past_values.pow(2).mean()}
        if future is None:
            return {"prediction": prediction}
        return {"loss": torch.nn.functional.mse_loss(prediction, future), "prediction": prediction}


def _series(*keys: str):
    from kiln.core.data import DatasetSplits

    x = {"past_values": torch.randn(6, 4), **{k: torch.randn(6, 2) for k in keys}}
    y = torch.randn(6, 2)
    return DatasetSplits({k: v[:4] for k, v in x.items()}, y[:4], {k: v[4:] for k, v in x.items()}, y[4:], 0)


@pytest.mark.parametrize("label", ["future_values", "horizon"])
def test_an_input_that_makes_the_model_return_its_loss_is_refused_before_training(label: str) -> None:
    """``future_values`` (Hugging Face's forecasters' labels) by its name; an input of another name by the model
    returning no ``loss`` without it. Before: both trained, and the export passed with a scalar output."""
    from kiln.core.data import DataContractError
    from kiln.stages.train.stage import check_model_fits_data

    model = _Forecaster(label)
    kept = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(DataContractError, match=f"output 'loss' is a scalar with its input '{label}'") as err:
        check_model_fits_data(model, _series(label), "fc:build")
    assert f"keep '{label}' out of the data's inputs (x)" in err.value.hint
    assert model.training and all(torch.equal(v, kept[k]) for k, v in model.state_dict().items())


def test_a_loss_returned_without_any_optional_input_names_no_input() -> None:
    """A scalar ``loss`` the model returns whatever it is given is no sign that an input is labels."""
    from kiln.stages.train.stage import check_model_fits_data

    check_model_fits_data(_Forecaster("horizon", always=True), _series("horizon"), "fc:build")


def user_cross_entropy(outputs: object, targets: torch.Tensor) -> torch.Tensor:
    """A loss of the user's: it reads the logits itself, never signature.logits_output."""
    return torch.nn.functional.cross_entropy(outputs, targets)


def test_a_misspelt_logits_output_fails_before_training(tmp_path: Path, monkeypatch) -> None:
    """With a loss of the user's nothing in training reads signature.logits_output: a typo was said only at the
    precision stage, after the training it would have wasted."""
    import kiln.stages.train.stage as train_stage

    monkeypatch.setattr(train_stage, "train", lambda *a, **k: pytest.fail("training started"))
    over = {"signature.logits_output": "cls", "train.loss": f"{__name__}:user_cross_entropy"}
    result = Runner(config_from_dict(tiny_config_dict(**over)), tmp_path, STAGES).run(stop="train")
    assert "signature.logits_output 'cls' is not an output of the model" in str(result.error), result.error
    assert [r.status for r in result.records] == ["failed"]


class BoxHead(torch.nn.Module):
    """A detector's head: 10 queries of 5 classes + no-object and their boxes, a dict of two outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(12, 10 * 10)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        z = self.proj(x.flatten(1)).view(-1, 10, 10)
        return {"logits": z[..., :6], "pred_boxes": z[..., 6:].sigmoid()}


def box_data() -> object:
    """Images [N, 3, 2, 2] with one box label each, (class, x1, y1, x2, y2): what detection_recall reads."""
    from kiln.core.data import DatasetSplits

    g = torch.Generator().manual_seed(0)
    x, boxes = torch.randn(16, 3, 2, 2, generator=g), torch.rand(16, 1, 5, generator=g)
    return DatasetSplits(x[:8], boxes[:8], x[8:], boxes[8:], 5)


def test_skipped_training_leaves_labels_no_loss_reads_unscored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pretrained detector with box labels (for validate.metric) and training off: the labels fit no default
    loss, which no one calls; the untrained val accuracy is left out (said as information), not the run failed."""
    over = {"train.enabled": False, "model.name": f"{__name__}:BoxHead", "model.params": {}}
    over["data.name"] = f"{__name__}:box_data"
    monkeypatch.setattr(logging.getLogger("kiln"), "propagate", True)  # the CLI tests turn it off
    caplog.set_level(logging.INFO, logger="kiln")
    result = Runner(config_from_dict(tiny_config_dict(**over)), tmp_path / "wd", STAGES).run(stop="train")
    assert result.ok, result.error
    assert result.records[0].status == "skipped" and result.records[0].summary.val_accuracy is None
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert any("measures no val accuracy of the untrained model" in m for m in said), said


class OneSampleACall(torch.nn.Module):
    """A model of one sample a call (a graph as a batch of one: byom.md): it reads row 0 and answers one row."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x[0]).unsqueeze(0)


def one_sample_data() -> object:
    from kiln.core.data import DatasetSplits

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(12, 4, generator=g), torch.randn(12, 3, generator=g)
    return DatasetSplits(x[:8], y[:8], x[8:], y[8:], 0)


def test_a_model_of_one_sample_a_call_trains_at_batch_size_1(tmp_path: Path) -> None:
    """The check before training ran it on two samples, which such a model answers with one row: an error, though
    training at train.batch_size 1 feeds it one sample a step."""
    over = {"model.name": f"{__name__}:OneSampleACall", "model.params": {}, "data.name": f"{__name__}:one_sample_data"}
    over |= {"train.batch_size": 1, "train.epochs": 1, "signature.batch_sizes": [1]}
    result = Runner(config_from_dict(tiny_config_dict(**over)), tmp_path / "wd", STAGES).run(stop="train")
    assert result.ok, result.error
    assert result.records[0].status == "ran"


def test_every_input_named_like_labels_is_named_in_the_refusal() -> None:
    """A question-answering head given both ``start_positions`` and ``end_positions`` in x: the fix named the first
    only, and a user who followed it met the error again for the second."""
    from kiln.core.data import DataContractError, DatasetSplits
    from kiln.stages.train.stage import check_model_fits_data

    class Qa(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 2)

        def forward(self, x: torch.Tensor, start_positions: torch.Tensor, end_positions: torch.Tensor) -> dict:
            logits = self.fc(x)
            loss = logits[:, 0].sub(start_positions).pow(2).mean() + logits[:, 1].sub(end_positions).pow(2).mean()
            return {"loss": loss, "start_logits": logits[:, :1], "end_logits": logits[:, 1:]}

    x = {"x": torch.randn(6, 4), "start_positions": torch.zeros(6), "end_positions": torch.ones(6)}
    y = torch.randn(6, 2)
    data = DatasetSplits({k: v[:4] for k, v in x.items()}, y[:4], {k: v[4:] for k, v in x.items()}, y[4:], 0)
    with pytest.raises(DataContractError, match="its inputs 'start_positions' and 'end_positions' among") as err:
        check_model_fits_data(Qa(), data, "qa:build")
    assert "keep 'start_positions' and 'end_positions' out of the data's inputs" in err.value.hint


def test_a_required_argument_only_the_loss_reads_is_refused_before_training() -> None:
    """``forward(past, future)`` returning the forecast and its loss against ``future``: without ``future`` the
    model raises, which said nothing, and the export refused it only after training."""
    from kiln.core.data import DataContractError, DatasetSplits
    from kiln.stages.train.stage import check_model_fits_data

    class Forecast(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 2)

        def forward(self, past: torch.Tensor, future: torch.Tensor) -> dict[str, torch.Tensor]:
            prediction = self.fc(past)
            return {"prediction": prediction, "loss": torch.nn.functional.mse_loss(prediction, future)}

    class Conditioned(Forecast):  # a required input the prediction reads too: no label
        def forward(self, past: torch.Tensor, future: torch.Tensor) -> dict[str, torch.Tensor]:
            prediction = self.fc(past) + future
            return {"prediction": prediction, "loss": prediction.pow(2).mean()}

    x = {"past": torch.randn(6, 4), "future": torch.randn(6, 2)}
    y = torch.randn(6, 2)
    data = DatasetSplits({k: v[:4] for k, v in x.items()}, y[:4], {k: v[4:] for k, v in x.items()}, y[4:], 0)
    with pytest.raises(DataContractError, match="its input 'future' among"):
        check_model_fits_data(Forecast(), data, "fc:build")
    check_model_fits_data(Conditioned(), data, "fc:build")


def test_labels_among_the_inputs_of_data_without_y_are_named_before_the_missing_labels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Data that put its labels among the inputs and returned no y: the missing y's fix (train.enabled: false)
    led to the export's refusal of the loss output; the labels among the inputs are the cause, said first."""
    (tmp_path / "loss_in_x.py").write_text(
        "import torch\n"
        "from kiln import DatasetSplits\n\n\n"
        "class WithLoss(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.fc = torch.nn.Linear(4, 2)\n\n"
        "    def forward(self, x, labels):\n"
        "        logits = self.fc(x)\n"
        "        return {'loss': torch.nn.functional.cross_entropy(logits, labels), 'logits': logits}\n\n\n"
        "def build():\n"
        "    return WithLoss()\n\n\n"
        "def load():\n"
        "    x = {'x': torch.randn(8, 4), 'labels': torch.zeros(8, dtype=torch.long)}\n"
        "    return DatasetSplits({k: v[:6] for k, v in x.items()}, None, {k: v[6:] for k, v in x.items()}, None)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = config_from_dict(tiny_config_dict(**{"model": {"name": "loss_in_x:build"}, "data.name": "loss_in_x:load"}))
    result = Runner(cfg, tmp_path / "wd", STAGES).run(stop="train")
    assert "output 'loss' is a scalar with its input 'labels'" in str(result.error), result.error
