"""Weights as the train stage writes and reads them: tied tensors (a language model's head is its embedding)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load, save
from torch import nn

from kiln.core.data import DatasetSplits
from kiln.core.errors import ConfigError, InputFileError
from kiln.models.model_io import ModelShapeError, load_weights, read_state_dict, tied_names, weights_bytes


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight  # tied, as GPT-2's lm_head and wte

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids)).mean(1)


def test_tied_weights_are_written_once_and_tied_again() -> None:
    """Before: safetensors refused the state dict ("Some tensors share memory"), a traceback out of `kiln run`."""
    torch.manual_seed(0)
    model = TiedLM()
    assert tied_names(model) == {"head.weight": "emb.weight"}
    state = load(weights_bytes(model))
    assert set(state) == {"emb.weight"}
    fresh = load_weights(TiedLM(), state, "w.safetensors")
    assert fresh.head.weight is fresh.emb.weight and torch.equal(fresh.emb.weight, model.emb.weight)


def test_a_file_holding_only_the_alias_loads() -> None:
    """A checkpoint that kept the other name of the pair (each library picks its own) fills the first."""
    model = TiedLM()
    fresh = load_weights(TiedLM(), {"head.weight": model.emb.weight.detach().clone()}, "hf.safetensors")
    assert torch.equal(fresh.emb.weight, model.emb.weight) and fresh.head.weight is fresh.emb.weight


def test_a_missing_weight_that_is_not_tied_is_still_an_error() -> None:
    with pytest.raises(ModelShapeError, match="1 of the model's 2 keys missing \\(bias\\)"):
        load_weights(nn.Linear(2, 2), {"weight": torch.zeros(2, 2)}, "w.safetensors")


@pytest.mark.parametrize("prefix", ["module.", "agent.policy."])
def test_a_checkpoint_saved_from_a_wrapper_loads_without_its_prefix(prefix: str) -> None:
    """DDP's ``module.`` and a training wrapper's attribute path on every key: the model's own weights."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
    state = {prefix + k: v.clone() for k, v in model.state_dict().items()}
    fresh = load_weights(nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1)), state, "w.pt")
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))


def test_a_prefix_that_does_not_make_the_models_keys_is_still_an_error() -> None:
    state = {"agent.weight": torch.zeros(2, 2), "agent.other": torch.zeros(2)}
    with pytest.raises(ModelShapeError, match="agent.weight"):
        load_weights(nn.Linear(2, 2), state, "w.pt")


def net() -> nn.Module:
    """A small model with a buffer: Conv + BatchNorm + Linear."""
    return nn.Sequential(nn.Conv1d(1, 4, 3), nn.BatchNorm1d(4), nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(4, 3))


def same_weights(a: nn.Module, b: nn.Module) -> bool:
    return a.state_dict().keys() == b.state_dict().keys() and all(
        torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values())
    )


def training_checkpoint(key: str, weights: dict[str, torch.Tensor]) -> dict[str, object]:
    """What a training script saves: the weights under ``key`` beside the epoch, optimizer state, config and a
    scalar tensor (PyTorch's ImageNet example saves ``best_acc1`` as one)."""
    opt = torch.optim.SGD(net().parameters(), lr=0.1, momentum=0.9)
    return {
        key: weights,
        "epoch": 3,
        "optimizer": opt.state_dict(),
        "config": {"width": 4, "lr": 0.1},
        "best_acc1": torch.tensor(71.5),
    }


@pytest.mark.parametrize("key", ["state_dict", "model_state_dict", "model", "module", "net"])
def test_a_training_checkpoints_weights_load_from_the_key_that_holds_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, key: str
) -> None:
    """Before: only 'model' was looked in; {'state_dict': ...} (plain scripts, Lightning) did not fit the model."""
    torch.manual_seed(0)
    model = net()
    torch.save(training_checkpoint(key, model.state_dict()), tmp_path / "ckpt.pt")
    with caplog.at_level("INFO", logger="kiln"):
        fresh = load_weights(net(), read_state_dict(tmp_path / "ckpt.pt"), "ckpt.pt")
    assert same_weights(fresh, model)
    assert f"the weights under '{key}'" in caplog.text


def test_weights_under_another_key_beside_those_loaded_are_warned_of(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A diffusion checkpoint {'model': ..., 'ema': ...}: 'model' loads, and the warning names 'ema' and how to load
    it instead (the EMA weights are what such a model deploys); the optimizer's state holds no weights."""
    torch.manual_seed(0)
    model, ema = net(), net()
    ckpt = {**training_checkpoint("model", model.state_dict()), "ema": ema.state_dict()}
    torch.save(ckpt, tmp_path / "ckpt.pt")
    with caplog.at_level("WARNING", logger="kiln"):
        fresh = load_weights(net(), read_state_dict(tmp_path / "ckpt.pt"), "ckpt.pt")
    assert same_weights(fresh, model)
    assert "loading the weights under 'model'; 'ema' holds weights too" in caplog.text
    assert "torch.save(ckpt['ema'], path)" in caplog.text and "optimizer" not in caplog.text


def test_a_lightning_checkpoint_loads_the_models_keys_under_its_prefix(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A LightningModule's state dict: the network's keys under its attribute's name, beside a loss's buffer."""
    torch.manual_seed(0)
    model = net()
    weights = {f"model.{k}": v for k, v in model.state_dict().items()} | {"criterion.weight": torch.ones(3)}
    torch.save(training_checkpoint("state_dict", weights), tmp_path / "ckpt.pt")
    with caplog.at_level("INFO", logger="kiln"):
        fresh = load_weights(net(), read_state_dict(tmp_path / "ckpt.pt"), "ckpt.pt")
    assert same_weights(fresh, model)
    assert "prefix 'model.'" in caplog.text and "criterion.weight" in caplog.text


@pytest.mark.parametrize(
    ("saved", "said", "fix"),
    [
        (
            {"generator": "weights", "epoch": 3},
            "holds a dict with keys ['generator', 'epoch'], not a state dict: 'generator' holds tensors",
            "torch.save(ckpt['generator'], path)",
        ),
        (
            {"model": "weights", "state_dict": "weights", "epoch": 3},
            "'model' and 'state_dict' hold tensors",
            "torch.save(ckpt['model'], path)",
        ),
        (
            {"epoch": 3, "config": {"lr": 0.1}},
            "and none of them holds a dict of tensors",
            "torch.save(model.state_dict()",
        ),
    ],
)
def test_a_dict_that_is_not_a_state_dict_is_named_by_its_keys(tmp_path: Path, saved: dict, said: str, fix: str) -> None:
    """Before: it went to the model as a state dict and the error listed the model's keys as missing, cut off."""
    weights = net().state_dict()
    torch.save({k: weights if v == "weights" else v for k, v in saved.items()}, tmp_path / "ckpt.pt")
    with pytest.raises(InputFileError) as err:
        read_state_dict(tmp_path / "ckpt.pt")
    assert said in err.value.message and fix in err.value.hint, (err.value.message, err.value.hint)


def test_a_checkpoint_that_does_not_fit_is_summed_up_not_cut_off() -> None:
    """Before: torch's message cut at 400 characters, which dropped the unexpected keys after the missing ones."""
    shallower = nn.Sequential(*[nn.Linear(4, 4) for _ in range(29)])  # the model under 'layers.', one layer short
    state = {f"layers.{k}": v for k, v in shallower.state_dict().items()} | {"extra.weight": torch.zeros(1)}
    with pytest.raises(ModelShapeError) as err:
        load_weights(nn.Sequential(*[nn.Linear(4, 4) for _ in range(30)]), state, "w.pt")
    message = err.value.message
    assert "60 of the model's 60 keys missing (0.weight, 0.bias, 1.weight, ... 57 more)" in message, message
    assert "59 unexpected keys (layers.0.weight, layers.0.bias, layers.1.weight, ... 56 more)" in message, message
    assert (
        "the checkpoint has 58 of the missing keys under the prefix 'layers.' (layers.0.weight for 0.weight)" in message
    )
    assert not message.endswith("...")


def test_a_checkpoint_holding_the_model_under_two_prefixes_names_both() -> None:
    """A distillation checkpoint (student and teacher of one architecture): which one is not Kiln's to guess."""
    model = net()
    state = {f"{p}{k}": v for p in ("student.", "teacher.") for k, v in model.state_dict().items()}
    with pytest.raises(ModelShapeError) as err:
        load_weights(net(), state, "w.pt")
    assert "under each of the prefixes 'student.', 'teacher.'" in err.value.message, err.value.message
    assert "k.removeprefix('student.')" in err.value.hint, err.value.hint


def test_a_size_mismatch_names_both_shapes() -> None:
    with pytest.raises(ModelShapeError) as err:
        load_weights(nn.Linear(4, 3), nn.Linear(5, 3).state_dict(), "w.pt")
    assert "size mismatch for 1 key (weight: [3, 5] in the checkpoint, [3, 4] in the model)" in err.value.message
    assert "architecture" in err.value.hint


class Views(nn.Module):
    """Two buffers that are overlapping views of one storage: not aliases, but safetensors refuses them too."""

    def __init__(self) -> None:
        super().__init__()
        base = torch.arange(8.0)
        self.register_buffer("low", base[:6])
        self.register_buffer("high", base[2:])


def test_views_of_one_storage_are_written_apart() -> None:
    with pytest.raises(RuntimeError, match="share memory"):  # what a plain save does with them
        save(Views().state_dict())
    state = load(weights_bytes(Views()))
    assert state["low"].tolist() == [0, 1, 2, 3, 4, 5] and state["high"].tolist() == [2, 3, 4, 5, 6, 7]


BUILT: list[int] = []


def counted_linear(width: int = 4) -> nn.Module:
    """A model factory that counts its calls."""
    BUILT.append(width)
    return nn.Linear(width, 2)


def test_load_trained_builds_a_model_once_and_hands_out_copies(tmp_path) -> None:
    """The export, build and validate stages of a run each load the trained model: it is built once."""
    from kiln.models.config import ModelConfig
    from kiln.models.model_io import load_trained, save_trained

    config = ModelConfig(name="tests.models.test_model_io:counted_linear", params={"width": 4})
    torch.manual_seed(0)
    save_trained(tmp_path, nn.Linear(4, 2), config)
    BUILT.clear()
    first = load_trained(tmp_path, config)
    first.weight.data.zero_()  # a stage changing its model does not change the next stage's
    second = load_trained(tmp_path, config)
    assert BUILT == [4] and second is not first and second.weight.abs().sum() > 0 and not second.training
    save_trained(tmp_path, nn.Linear(4, 2).requires_grad_(False).apply(lambda m: m.weight.fill_(1.0)), config)
    third = load_trained(tmp_path, config)  # new weights in the file: built again, with them
    assert BUILT == [4, 4] and torch.equal(third.weight, torch.ones(2, 4))


def test_a_model_kept_by_the_train_stage_is_copied_after_its_folder_is_renamed(tmp_path) -> None:
    """The train stage writes into a staging folder that becomes train/ once it is done."""
    from kiln.models.config import ModelConfig
    from kiln.models.model_io import keep_trained, load_trained, save_trained

    config = ModelConfig(name="tests.models.test_model_io:counted_linear", params={"width": 4})
    model = nn.Linear(4, 2).half()
    staging, final = tmp_path / "train.staging", tmp_path / "train"
    staging.mkdir()
    save_trained(staging, model, config)
    keep_trained(staging, config, model)
    staging.rename(final)
    BUILT.clear()
    loaded = load_trained(final, config)
    assert BUILT == [] and loaded.weight.dtype == torch.float32 and not loaded.training
    assert torch.equal(loaded.weight, model.weight.float()) and model.weight.dtype == torch.float16


def _token_graph(path: Path, seq: str | int = "seq") -> Path:
    """ids [batch, seq] -> an embedding of 40 rows -> y: an ONNX file from elsewhere."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    table = numpy_helper.from_array(np.random.default_rng(0).standard_normal((40, 4)).astype(np.float32), "table")
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["y"])],
        "g",
        [helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, ["batch", seq])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
        [table],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_random_inputs_of_an_onnx_file_draw_token_ids_over_the_embedding(tmp_path: Path) -> None:
    from kiln.core.signature import Signature
    from kiln.models.model_io import random_splits

    ids = random_splits(_token_graph(tmp_path / "m.onnx", 6), Signature(), seed=0).train_x["ids"]
    assert ids.min() >= 0 and ids.max() <= 39 and ids.max() > 1  # the table's rows, not 0 and 1 alone


def test_an_onnx_start_without_data_or_sizes_for_its_axes_stops_at_export(tmp_path: Path) -> None:
    from kiln.pipeline.api import run_pipeline
    from kiln.pipeline.config import config_from_dict

    cfg = config_from_dict({"model": {"onnx": str(_token_graph(tmp_path / "m.onnx"))}})
    result, _ = run_pipeline(cfg, tmp_path / "w")
    assert isinstance(result.error, ConfigError), result.error
    assert "dynamic axes ['seq'] besides batch, and no data to size them" in result.error.message
    assert [r.name for r in result.records if r.status == "failed"] == ["export"]


def _four_class_onnx(path: Path) -> Path:
    """digits-shaped input [batch, 1, 8, 8] -> 4 class logits, the input's H and W fixed."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.zeros((64, 4), np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Flatten", ["input"], ["f"]), helper.make_node("MatMul", ["f", "w"], ["logits"])],
        "g",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 1, 8, 8])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 4])],
        [w],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
    return path


@pytest.mark.parametrize(
    ("axes", "message"),
    [
        ({"input": {7: "b"}}, "gives input 'input' axis 7 \\(b\\), and it has 4 axes"),
        ({"input": {2: "h"}}, "fixes input 'input' axis 2 at 8: it cannot vary"),
        ({"nosuch": {1: "s"}}, "names input 'nosuch', which model.onnx m.onnx does not have"),
    ],
)
def test_an_onnx_starts_dynamic_axes_are_checked_against_the_file(tmp_path: Path, axes, message) -> None:
    """They once ended in an IndexError, an ONNX Runtime traceback, or min() of nothing, stages later."""
    from kiln.core.signature import Signature
    from kiln.models.config import DataConfig, ModelConfig
    from kiln.models.model_io import dataset_for, random_splits

    path = _four_class_onnx(tmp_path / "m.onnx")
    with pytest.raises(ConfigError, match=message):
        random_splits(path, Signature(dynamic_axes=axes), 0)
    with pytest.raises(ConfigError, match=list(axes)[0]):  # with data, the data's own check may say it first
        dataset_for(ModelConfig(onnx=str(path)), DataConfig(name="digits"), Signature(dynamic_axes=axes), 0)


def test_an_onnx_start_with_fewer_logits_than_the_datas_classes_stops(tmp_path: Path) -> None:
    from kiln.core.signature import Signature
    from kiln.models.config import DataConfig, ModelConfig
    from kiln.models.model_io import dataset_for

    path = _four_class_onnx(tmp_path / "m.onnx")
    with pytest.raises(ConfigError, match="class logits of shape \\['batch', 4\\] .* but dataset 'digits' has 10"):
        dataset_for(ModelConfig(onnx=str(path)), DataConfig(name="digits"), Signature(), 0)


def test_an_onnx_start_whose_output_is_not_a_tensor_stops_where_the_data_meets_it(tmp_path: Path) -> None:
    """Random inputs of the file, or a dataset checked against it: a ZipMap output is named there, not found by the
    accuracy check as a list that has no shape."""
    from kiln.core.errors import ModelError
    from kiln.core.signature import Signature
    from kiln.models.config import DataConfig, ModelConfig
    from kiln.models.model_io import dataset_for, random_splits
    from tests.core.test_onnx_io import ZIPMAP_SAID, zipmap_classifier

    path = zipmap_classifier(tmp_path / "clf.onnx")
    said = re.escape(f"model.onnx clf.onnx: {ZIPMAP_SAID}")
    with pytest.raises(ModelError, match=said):
        random_splits(path, Signature(), 0)
    with pytest.raises(ModelError, match=said):
        dataset_for(ModelConfig(onnx=str(path)), DataConfig(name="digits"), Signature(), 0)


class TwoTower(nn.Module):
    """A CLIP's layout: a text tower, an image tower and a logit scale beside them."""

    def __init__(self) -> None:
        super().__init__()
        self.text_model, self.vision_model = nn.Linear(6, 4), nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
        self.logit_scale = nn.Parameter(torch.ones(()))


class TextTower(nn.Module):
    """The text tower alone, under the same name as in :class:`TwoTower`."""

    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.text_model = nn.Linear(width, 4)


def test_one_tower_loads_from_the_whole_models_checkpoint_naming_the_keys_left_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every key of the text tower is in the two-tower checkpoint, of its shape. Before: refused for '5 unexpected
    keys', though every weight the tower needs was there."""
    torch.manual_seed(0)
    whole = TwoTower()
    with caplog.at_level("WARNING", logger="kiln"):
        tower = load_weights(TextTower(), whole.state_dict(), "clip.safetensors")
    assert torch.equal(tower.text_model.weight, whole.text_model.weight)
    said = "checkpoint clip.safetensors: 5 keys not used by model TextTower (logit_scale, vision_model.* (4 keys))"
    assert said in caplog.text, caplog.text


def test_keys_left_over_beside_a_missing_or_misshaped_one_stay_an_error() -> None:
    state = TwoTower().state_dict()
    with pytest.raises(ModelShapeError, match="5 unexpected keys .*; size mismatch for 1 key \\(text_model.weight"):
        load_weights(TextTower(width=7), state, "clip.safetensors")
    del state["text_model.bias"]
    with pytest.raises(ModelShapeError, match="1 of the model's 2 keys missing \\(text_model.bias\\)"):
        load_weights(TextTower(), state, "clip.safetensors")


def test_a_deeper_models_checkpoint_is_still_refused() -> None:
    """Layers 2 and 3 of a four-layer model beside the two a two-layer model has: every key of the smaller model is
    there, but the extra ones extend a module it has (another architecture), not a tower it leaves out."""
    deep, shallow = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)]), nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with pytest.raises(ModelShapeError, match="4 unexpected keys"):
        load_weights(shallow, deep.state_dict(), "deep.safetensors")
    layered = nn.Module()
    layered.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])
    deeper = nn.Module()
    deeper.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
    with pytest.raises(ModelShapeError, match="2 unexpected keys"):
        load_weights(layered, deeper.state_dict(), "deeper.safetensors")


def _two_tower_onnx(path: Path) -> Path:
    """texts [texts, 4] and images [images, 4] -> logits_per_image [images, texts] and class_logits [images, 4]: a
    file exported with a name per first axis, as docs/serving.md has a two-tower model exported."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.eye(4, dtype=np.float32), "w")
    graph = helper.make_graph(
        [
            helper.make_node("Transpose", ["texts"], ["t"], perm=[1, 0]),
            helper.make_node("MatMul", ["images", "t"], ["logits_per_image"]),
            helper.make_node("MatMul", ["images", "w"], ["class_logits"]),
        ],
        "g",
        [
            helper.make_tensor_value_info("texts", TensorProto.FLOAT, ["texts", 4]),
            helper.make_tensor_value_info("images", TensorProto.FLOAT, ["images", 4]),
        ],
        [
            helper.make_tensor_value_info("logits_per_image", TensorProto.FLOAT, ["images", "texts"]),
            helper.make_tensor_value_info("class_logits", TensorProto.FLOAT, ["images", 4]),
        ],
        [w],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
    return path


def _pairs() -> DatasetSplits:
    g = torch.Generator().manual_seed(0)
    x = {"texts": torch.randn(24, 4, generator=g), "images": torch.randn(24, 4, generator=g)}
    y = torch.randint(0, 4, (24,), generator=g)
    return DatasetSplits({k: v[:16] for k, v in x.items()}, y[:16], {k: v[16:] for k, v in x.items()}, y[16:], 4)


def test_an_onnx_start_naming_a_class_axis_that_is_an_inputs_first_axis_stops(tmp_path: Path) -> None:
    """logits_per_image's last axis is the batch's texts, not the data's 4 classes. Before: the run measured an
    accuracy of the argmax over each batch's texts against the labels, and passed."""
    from kiln.core.signature import Signature
    from kiln.models.model_io import check_onnx_takes

    path = _two_tower_onnx(tmp_path / "clip.onnx")
    with pytest.raises(ConfigError) as err:
        check_onnx_takes(path, _pairs(), "pairs", Signature(logits_output="logits_per_image"))
    said = "output 'logits_per_image' of model.onnx clip.onnx, which signature.logits_output names, is ['images', "
    assert said + "'texts']: its class axis 'texts' is axis 0 of input 'texts'" in err.value.message
    assert "validate.metric" in err.value.hint
    check_onnx_takes(path, _pairs(), "pairs", Signature(logits_output="class_logits"))  # a class axis of 4
    check_onnx_takes(path, _pairs(), "pairs", Signature())  # none named: validation decides what it scores


def test_an_onnx_start_naming_logits_over_a_dynamic_axis_besides_the_batch_goes_on(tmp_path: Path) -> None:
    """A question-answering head's start_logits [batch, seq]: its argmax is a position, which labels may name."""
    import onnx
    from onnx import TensorProto, helper

    from kiln.core.signature import Signature
    from kiln.models.model_io import check_onnx_takes

    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["start_logits"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq"])],
        [helper.make_tensor_value_info("start_logits", TensorProto.FLOAT, ["batch", "seq"])],
    )
    path = tmp_path / "qa.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
    x, y = torch.randn(8, 6), torch.randint(0, 6, (8,))
    check_onnx_takes(path, DatasetSplits(x, y, x, y, 6), "qa", Signature(logits_output="start_logits"))


def _loop_like(path: Path, mask_axis: str | int = "seq_len") -> Path:
    """``ids [batch, seq_len]`` and ``mask [batch, <mask_axis>]`` -> ``y = ids * mask`` (one size: a broadcast
    error otherwise); ``0``: the mask's axis left unnamed."""
    import onnx
    from onnx import TensorProto, helper

    mask = helper.make_tensor_value_info("mask", TensorProto.FLOAT, ["batch", mask_axis or None])
    graph = helper.make_graph(
        [helper.make_node("Mul", ["ids", "mask"], ["y"])],
        "g",
        [helper.make_tensor_value_info("ids", TensorProto.FLOAT, ["batch", "seq_len"]), mask],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq_len"])],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


@pytest.mark.parametrize(
    ("axes", "said"),
    [
        (  # Before: validation fed ids at 3 beside mask at 12, and blamed a position table
            {"ids": {1: "seq_len"}},
            "signature.dynamic_axes names input 'ids' axis 1 ('seq_len') and leaves out input 'mask' axis 1, which "
            "model.onnx m.onnx names 'seq_len' too: the file declares them one size, and Kiln varies only the axes "
            "signature.dynamic_axes names",
        ),
        (  # Before: the same, and a fix naming them alike under a new name, which the TensorRT build then refused
            {"ids": {1: "s1"}, "mask": {1: "s2"}},
            "signature.dynamic_axes names input 'ids' axis 1 ('s1') and input 'mask' axis 1 ('s2') apart, which "
            "model.onnx m.onnx names alike ('seq_len'): the file declares them one size, and Kiln varies each name of "
            "signature.dynamic_axes apart",
        ),
    ],
)
def test_axes_the_file_names_alike_are_named_alike_in_dynamic_axes(tmp_path: Path, axes: dict, said: str) -> None:
    from kiln.core.signature import Signature
    from kiln.models.model_io import random_splits

    path = _loop_like(tmp_path / "m.onnx")
    signature = Signature(dynamic_axes=axes, shapes={"seq_len": [3, 12]})
    with pytest.raises(ConfigError) as err:
        random_splits(path, signature, 0)
    assert err.value.message == said
    assert err.value.hint == (
        "name them alike, as the file does: --set 'signature.dynamic_axes={ids: {1: seq_len}, mask: {1: seq_len}}' "
        "(or the same under signature: in the run's config)"
    )
    fixed = Signature(dynamic_axes={"ids": {1: "seq_len"}, "mask": {1: "seq_len"}}, shapes={"seq_len": [3, 12]})
    assert random_splits(path, fixed, 0).val_x["mask"].shape == (64, 12)


def test_an_axis_the_file_leaves_unnamed_takes_a_name_in_dynamic_axes(tmp_path: Path) -> None:
    """Before: the unnamed axis (0 in the file's shape) was said to be fixed at 0, so no setting could name it."""
    from kiln.core.signature import Signature
    from kiln.models.model_io import random_splits

    path = _loop_like(tmp_path / "m.onnx", mask_axis=0)
    axes = {"ids": {1: "seq_len"}, "mask": {1: "seq_len"}}
    assert random_splits(path, Signature(dynamic_axes=axes, shapes={"seq_len": [5]}), 0).val_x["mask"].shape[1] == 5


def test_an_onnx_start_with_an_input_without_axes_is_one_error(tmp_path: Path) -> None:
    """Before: random inputs of a bool flag of shape [] ended in `TypeError: expected np.ndarray (got numpy.bool_)`."""
    import onnx
    from onnx import TensorProto, helper

    from kiln.core.errors import ModelError
    from kiln.core.signature import Signature
    from kiln.models.model_io import random_splits

    graph = helper.make_graph(
        [helper.make_node("Where", ["flag", "x", "x2"], ["y"]), helper.make_node("Neg", ["x"], ["x2"])],
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4]),
            helper.make_tensor_value_info("flag", TensorProto.BOOL, []),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
    )
    path = tmp_path / "flag.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    with pytest.raises(ModelError, match=r"model.onnx flag.onnx: input 'flag' has no axes \(shape \[\]\)"):
        random_splits(path, Signature(), 0)
