"""Which output is held to top-1 agreement: the class-logit output ``signature.logits_output`` names, whatever the
data declares; by default (null) only where the data declares classes, in a pipeline run and in the direct
commands (``kiln validate ENGINE --reference``, ``kiln precision FILE``), whose inputs carry no labels."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from kiln.core.data import DatasetSplits, as_feed
from kiln.core.records import EngineValidation
from kiln.core.signature import Signature
from kiln.models.config import ModelConfig
from kiln.stages.accuracy.check import accuracy_failures, compare_on, gates_for, held_out, summarize
from kiln.stages.accuracy.config import CheckConfig
from tests.pipeline.test_faults import invoke

W = np.random.default_rng(0).standard_normal((16, 64)).astype(np.float32)


def _unlabelled() -> DatasetSplits:
    """Inputs without labels or num_classes: data that declares no classes."""
    x = torch.randn(96, 16, generator=torch.Generator().manual_seed(1))
    return DatasetSplits(x[:32], None, x[32:], None)


def _run(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {"logits": feed["input"] @ W}


def _flipping(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """An engine whose argmax differs from the reference's on many rows (its two largest logits swapped)."""
    out = _run(feed)["logits"]
    order = np.argsort(out, axis=1)
    rows = np.arange(len(out))
    top, second = order[:, -1], order[:, -2]
    got = out.copy()
    got[rows, top], got[rows, second] = out[rows, second], out[rows, top]
    return {"logits": got}


def _ctx(setting: str | None) -> Any:
    """What the stages' reference functions read of their context: the signature, validation's check and the model."""
    sig = Signature(logits_output=setting, batch_sizes=[1, 8])
    return SimpleNamespace(config=SimpleNamespace(signature=sig, validate=CheckConfig(), model=ModelConfig()))


def _validate_reference(setting: str | None) -> Any:
    from kiln.stages.validate.stage import reference

    data = _unlabelled()
    feeds = held_out(data, lambda v: as_feed(v, ["input"]), {}, {}, None)
    return reference(_ctx(setting), data, CheckConfig(), _run, feeds, ["logits"], {})


@pytest.mark.parametrize("setting", ["logits", None])
def test_validation_holds_a_named_logits_output_to_top1_on_data_without_classes(setting: str | None) -> None:
    """``signature.logits_output: logits`` is the user's declaration: top-1 agreement is computed and gated on it,
    though the data has no labels and num_classes 0. Unset, the only output is compared by cosine and error."""
    ref = _validate_reference(setting)
    found = compare_on(ref, _flipping, [1, 8])
    entry = EngineValidation(name="e", backend="onnxruntime", precision="fp32", device="cpu", status="validated")
    summarize(entry, found.stats, ref.logits)
    failures = accuracy_failures(entry, gates_for(CheckConfig(), "fp32", ref.logits is None), ref.accuracy)
    if setting is None:
        assert ref.logits is None and entry.top1_agreement is None
        assert not any(f.startswith("top1_agreement") for f in failures)
    else:
        assert ref.logits == "logits" and entry.top1_agreement is not None and entry.top1_agreement < 0.5
        assert any(f.startswith("top1_agreement") for f in failures)


def test_a_named_output_of_float_targets_is_the_prediction_not_class_logits() -> None:
    """Float targets without classes are a regression's: ``signature.logits_output`` names the output the metric
    and the training loss read (a forecaster's mean beside its log-variance), whose argmax along its horizon is no
    class, so it is held to cosine, error and relative error, not to top-1 agreement."""
    from kiln.stages.validate.stage import reference

    x = torch.randn(96, 16, generator=torch.Generator().manual_seed(1))
    for y, classes in ((x[:, :4] * 2.0, False), (torch.softmax(x @ torch.from_numpy(W), 1), True)):
        # values to predict; or soft labels (a distillation's probabilities), whose argmax is a class
        data = DatasetSplits(x[:32], y[:32], x[32:], y[32:])
        feeds = held_out(data, lambda v: as_feed(v, ["input"]), {}, {}, None)
        ref = reference(_ctx("logits"), data, CheckConfig(), _run, feeds, ["logits"], {})
        found = compare_on(ref, _flipping, [1, 8])
        entry = EngineValidation(name="e", backend="onnxruntime", precision="fp32", device="cpu", status="validated")
        summarize(entry, found.stats, ref.logits)
        assert (ref.logits is not None, entry.top1_agreement is not None) == (classes, classes)


def _tiny_graph(path: Path) -> Path:
    """input [batch, 16] float -> MatMul -> logits [batch, 64]."""
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["input", "w"], ["logits"])],
        "tiny",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 64])],
        [numpy_helper.from_array(W, "w")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
    return path


@pytest.mark.parametrize("setting", ["logits", None])
def test_the_precision_stage_holds_a_named_logits_output_to_top1(tmp_path: Path, setting: str | None) -> None:
    """The precision stage accepts a variant by validation's check: the same rule, so a named output's top-1
    agreement is measured on each variant there too."""
    from kiln.core.onnx_io import io_specs
    from kiln.stages.precision.stage import held_out_check

    model = onnx.load(_tiny_graph(tmp_path / "m.onnx"))
    src = SimpleNamespace(model=model, logits=0)
    check = held_out_check(_ctx(setting), _unlabelled(), src, io_specs(model)[0])
    verdict = check(model, "fp32")
    assert (check.ref.logits, verdict.metrics["top1_agreement"] is not None) == (
        ("logits", True) if setting else (None, False)
    )


@pytest.fixture
def engine(tmp_path: Path) -> tuple[Path, Path, Path]:
    """An ONNX model of one float output, an engine built from it, and inputs of it (no labels)."""
    model, built, inputs = _tiny_graph(tmp_path / "m.onnx"), tmp_path / "e", tmp_path / "x.npz"
    assert invoke("build", model, "-o", built).exit_code == 0
    np.savez(inputs, input=_unlabelled().val_x.numpy())
    return model, built, inputs


def _answer(output: str) -> dict[str, Any]:
    return json.loads(output[output.index("{") :])


def test_direct_validate_holds_only_a_named_output_to_top1(engine: tuple[Path, Path, Path]) -> None:
    """``kiln validate ENGINE --reference``'s inputs carry no labels: the only output is held to its cosine, error
    and relative error, said in the log; ``--set signature.logits_output=logits`` holds it to top-1 agreement."""
    model, built, inputs = engine
    default = invoke("validate", built, "--reference", model, "--inputs", inputs)  # a warning: no -v needed
    assert default.exit_code == 0, default.output
    got = _answer(default.output)
    assert "top1_agreement" not in got and got["gates"]["max_rel_err"] is not None
    said = " ".join(default.output[: default.output.index("{")].split())  # the log, its lines as one
    assert "output 'logits' is not held to top-1 agreement" in said and "signature.logits_output=logits" in said
    named = invoke(
        "validate", built, "--reference", model, "--inputs", inputs, "--set", "signature.logits_output=logits"
    )
    assert named.exit_code == 0, named.output
    assert _answer(named.output)["top1_agreement"] == 1.0


@pytest.mark.parametrize("setting", ["logits", None])
def test_direct_precision_holds_only_a_named_output_to_top1(
    engine: tuple[Path, Path, Path], tmp_path: Path, setting: str | None
) -> None:
    """``kiln precision FILE --calibration``: the same rule for the variants it checks against the FP32 graph."""
    model, _, inputs = engine
    sets = ["--set", f"signature.logits_output={setting}"] if setting else []
    out = tmp_path / "v"
    result = invoke("precision", model, "-o", out, "--variants", "int8", "--calibration", inputs, *sets)
    assert result.exit_code == 0, result.output
    int8 = json.loads((out / "variants.json").read_text())["variants"]["int8"]
    assert (int8["vs_fp32"]["top1_agreement"] is not None) == bool(setting)


def test_the_hint_to_name_an_unheld_output_is_only_for_class_scores(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The direct commands warn of an output held to no top-1 agreement: naming it is offered only for class scores,
    since a super-resolution net's image ``[N, 3, H, W]`` named so would be held to an argmax over its RGB channels."""
    import logging

    from kiln.stages.accuracy.check import direct_top1

    monkeypatch.setattr(logging.getLogger("kiln"), "propagate", True)  # the CLI tests turn it off
    with caplog.at_level(logging.WARNING, logger="kiln"):
        assert direct_top1(["image"], None) is None
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "If it holds class scores, naming it (signature.logits_output=image)" in said, said
    assert "an image or other values need no name" in said


def test_a_one_channel_signal_is_not_warned_of_as_unnamed_class_logits(caplog: pytest.LogCaptureFixture) -> None:
    """A direct command on a vocoder: its waveform [N, 1, T] holds no class scores, so the note that it is not held
    to top-1 agreement is no warning the user cannot silence; a [N, C] output without labels still is one."""
    from kiln.stages.accuracy.check import top1_output

    with caplog.at_level("INFO", logger="kiln"):
        assert top1_output("waveform", None, output=np.zeros((2, 1, 64), np.float32)) is None
        assert top1_output("logits", None, output=np.zeros((2, 5), np.float32)) is None
    levels = {
        r.getMessage().split("'")[1]: r.levelname for r in caplog.records if "not held to top-1" in r.getMessage()
    }
    assert levels == {"waveform": "INFO", "logits": "WARNING"}, levels
