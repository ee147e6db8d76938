"""INT8 of recurrent models through ``kiln precision FILE`` and ``kiln build``: an LSTM classifier's variant is
made for ONNX Runtime CPU (dynamic quantization computes its LSTMs in int8, DynamicQuantizeLSTM), while a GRU's,
which no runtime computes in int8, is not made, is listed so in ``variants.json``, and its folder is refused by
``kiln build`` rather than built as an FP32 engine."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
from click.testing import CliRunner
from torch import nn

from kiln.cli import main
from kiln.pipeline.config import config_from_dict
from kiln.pipeline.runner import settings_for
from kiln.pipeline.stage_list import stage_named
from kiln.stages.engines.config import BuildConfig
from kiln.stages.engines.stage import build_direct
from kiln.stages.precision.direct import precision_direct
from tests.stages.precision.rnn_graphs import rnn_classifier, rnn_data


def test_an_lstm_int8_variant_is_made_for_onnxruntime_cpu_and_builds_as_int8(tmp_path: Path) -> None:
    model, feed = rnn_classifier(tmp_path / "lstm.onnx", nn.LSTM), rnn_data(tmp_path / "d.npz")
    settings = settings_for(stage_named("precision"), config_from_dict({}))
    summary = precision_direct(model, tmp_path / "v", ["int8"], feed, settings)
    int8 = summary["variants"]["int8"]
    assert summary["missing"] is None and int8["only"] == "onnxruntime-cpu" and int8["cosine"] > 0.999
    ops = [n.op_type for n in onnx.load(int8["path"]).graph.node]
    assert ops.count("DynamicQuantizeLSTM") == 2 and "LSTM" not in ops
    listed = json.loads((tmp_path / "v" / "variants.json").read_text())["variants"]["int8"]
    assert listed["report"]["ort_cpu"]["scheme"] == "dynamic" and listed["report"]["ort_cpu"]["integer_lstms"] == 2
    said = listed["unmade"]  # the Q/DQ graph's, for the other backends: an LSTM on dequantized values
    assert "ONNX Runtime CPU computes LSTM in int8 through dynamic quantization only" in said
    meta = build_direct(tmp_path / "v" / "int8", tmp_path / "engine", "onnxruntime", "cpu", None, BuildConfig())
    assert meta.precision == "int8" and meta.audit["share"] == {"int8": 1.0}


def _kiln(*args: object) -> object:
    return CliRunner().invoke(main, [str(a) for a in args])


def test_a_gru_int8_variant_not_made_is_listed_and_kiln_build_refuses_its_folder(tmp_path: Path) -> None:
    """`kiln build` of the folder the unmade variant keeps for inspection: refused as from a run's precision stage,
    where it built the Q/DQ graph (a GRU on dequantized values) as an FP32 engine."""
    model, feed = rnn_classifier(tmp_path / "gru.onnx", nn.GRU), rnn_data(tmp_path / "d.npz")
    made = _kiln("precision", model, "-o", tmp_path / "v", "--variants", "fp16,int8", "--calibration", feed)
    assert made.exit_code == 2 and (tmp_path / "v" / "int8" / "model.onnx").is_file(), made.output
    built = _kiln("build", tmp_path / "v" / "int8", "-o", tmp_path / "engine")
    assert built.exit_code == 2 and not (tmp_path / "engine").exists(), built.output
    refused = [line for line in built.output.splitlines() if line.startswith(("error:", "fix:"))]
    assert "kiln precision did not make the int8 variant" in refused[0] and refused[1].startswith("fix:")
    listed = json.loads((tmp_path / "v" / "variants.json").read_text())["variants"]
    assert set(listed) == {"fp32", "fp16", "int8"} and "no runtime computes GRU in int8" in listed["int8"]["unmade"]
