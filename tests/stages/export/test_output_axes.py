"""Output axes that follow a dynamic input axis are found by running the export, and declared dynamic in it."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from kiln.stages.export.output_axes import axis_expression, name_output_axes, resized
from kiln.stages.export.torch_export import export_onnx


class Steps(nn.Module):
    """A GRU tagger: per-step features (length follows ``seq``; torch.export fixes it), the steps twice over
    (follows ``seq`` by a rule of its own), and pooled logits (fixed)."""

    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(4, 6, batch_first=True)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        steps, _ = self.gru(x)
        return steps, torch.cat([steps, steps], dim=1), self.head(steps.mean(1))


def _exported_with_fixed_steps(path: Path, seq: int = 10) -> None:
    """The export, with the per-step output's length fixed as torch.export declares it (in some processes the
    exporter already names it: fixed here, the test does not depend on which)."""
    export_onnx(Steps().eval(), {"x": torch.randn(2, seq, 4)}, path, dynamic_axes={"x": {1: "seq"}})
    model = onnx.load(str(path))
    for out, size in (("output_0", seq), ("output_1", 2 * seq)):
        dim = next(o for o in model.graph.output if o.name == out).type.tensor_type.shape.dim[1]
        dim.Clear()
        dim.dim_value = size
    onnx.save(model, str(path))


@pytest.fixture(scope="module")
def fixed_steps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """:func:`_exported_with_fixed_steps` once for the module; each test takes a copy."""
    path = tmp_path_factory.mktemp("steps") / "model.onnx"
    _exported_with_fixed_steps(path)
    return path


def _dims(model: onnx.ModelProto) -> dict[str, list[int | str]]:
    return {o.name: [d.dim_param or d.dim_value for d in o.type.tensor_type.shape.dim] for o in model.graph.output}


def test_an_rnn_s_step_output_is_declared_dynamic_and_a_pooled_one_stays_fixed(
    fixed_steps: Path, tmp_path: Path
) -> None:
    path = Path(shutil.copy(fixed_steps, tmp_path / "model.onnx"))
    feed = {"x": np.random.default_rng(0).standard_normal((2, 10, 4), dtype=np.float32)}
    fixed = name_output_axes(path, feed, {"x": {0: "batch", 1: "seq"}})
    dims = _dims(onnx.load(str(path)))
    assert dims["output_0"][1] == "seq" and dims["output_2"] == ["batch", 3], dims
    assert dims["output_1"][1] not in (10, 20, "seq") and isinstance(dims["output_1"][1], str), dims
    assert fixed["output_0"] == {1: "seq"} and set(fixed) == {"output_0", "output_1"}
    assert name_output_axes(path, feed, {"x": {0: "batch", 1: "seq"}}) == {}  # declared now: nothing to fix


def test_resized_repeats_or_cuts_every_axis_of_that_name() -> None:
    feed = {"ids": np.arange(6).reshape(1, 6), "mask": np.ones((1, 6)), "other": np.zeros((1, 2))}
    axes = {"ids": {1: "seq"}, "mask": {1: "seq"}}
    small, big = resized(feed, axes, "seq", 3), resized(feed, axes, "seq", 8)
    assert small["ids"].tolist() == [[0, 1, 2]] and big["ids"].tolist() == [[0, 1, 2, 3, 4, 5, 0, 1]]
    assert small["mask"].shape == (1, 3) and small["other"].shape == (1, 2)


def test_a_model_onnx_start_gets_its_output_axes_declared_too(fixed_steps: Path, tmp_path: Path, monkeypatch) -> None:
    from functools import partial

    from kiln.pipeline.config import config_from_dict
    from kiln.pipeline.runner import load_dataset
    from kiln.stages.export.stage import run
    from tests.conftest import stage_context, tiny_config_dict

    (tmp_path / "probe_data.py").write_text(
        "import torch\nfrom kiln import DatasetSplits\n\n"
        "def data():\n"
        "    g = torch.Generator().manual_seed(0)\n"
        "    return DatasetSplits({'x': torch.randn(8, 10, 4, generator=g)}, None,"
        " {'x': torch.randn(4, 10, 4, generator=g)}, None)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    given = Path(shutil.copy(fixed_steps, tmp_path / "given.onnx"))
    cfg = config_from_dict(tiny_config_dict(**{"model.onnx": str(given), "data.name": "probe_data:data"}))
    ctx = stage_context("export", cfg, tmp_path, tmp_path / "export", {}, load_dataset=partial(load_dataset, cfg))
    ctx.out.mkdir()
    summary = run(ctx)
    assert summary.output_axes.get("output_0") == {1: "seq"}, summary.output_axes
    assert _dims(onnx.load(str(ctx.out / "model.onnx")))["output_0"][1] == "seq"


def test_every_export_keeps_the_dynamic_input_axes_asked_for(tmp_path: Path) -> None:
    """In one process, a second dynamo export of a GRU fixed its `seq` input axis without an error (torch 2.13):
    an export that drops an asked-for axis is not taken, the TorchScript exporter's is."""
    for i in range(2):
        path = tmp_path / f"m{i}.onnx"
        export_onnx(Steps().eval(), {"x": torch.randn(2, 10, 4)}, path, dynamic_axes={"x": {1: "seq"}})
        dims = [d.dim_param or d.dim_value for d in onnx.load(str(path)).graph.input[0].type.tensor_type.shape.dim]
        assert dims == ["batch", "seq", 4], (i, dims)


def _upsampler(path: Path, declared: dict[str, str]) -> None:
    """A graph of ``x [batch, 1, frames]`` to ``up`` (4 copies of x along frames), ``plus`` (x and its first frame)
    and ``guess`` (4 copies again), each output's last axis declared as ``declared`` says."""
    h = onnx.helper
    nodes = [
        h.make_node("Concat", ["x", "x", "x", "x"], ["up"], axis=2),
        h.make_node("Concat", ["x", "x", "x", "x"], ["guess"], axis=2),
        h.make_node("Slice", ["x", "zero", "one", "two"], ["first"]),
        h.make_node("Concat", ["x", "first"], ["plus"], axis=2),
    ]
    ints = [h.make_tensor(n, onnx.TensorProto.INT64, [1], [v]) for n, v in (("zero", 0), ("one", 1), ("two", 2))]
    outputs = [h.make_tensor_value_info(n, onnx.TensorProto.FLOAT, ["batch", 1, d]) for n, d in declared.items()]
    x = h.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", 1, "frames"])
    graph = h.make_graph(nodes, "upsampler", [x], outputs, initializer=ints)
    onnx.save(h.make_model(graph, opset_imports=[h.make_opsetid("", 17)]), str(path))


def test_an_exporter_s_expression_over_the_axis_names_is_kept_where_the_sizes_bear_it_out(tmp_path: Path) -> None:
    """torch.export declares an upsampler's output ``16*frames``: that says how it follows the input and stays; an
    exporter's own symbol (``4*s0``) and an expression the sizes refute (``3*frames``) are named anew."""
    path = tmp_path / "model.onnx"
    _upsampler(path, {"up": "4*frames", "plus": "frames + 1", "guess": "3*frames"})
    feed = {"x": np.random.default_rng(0).standard_normal((2, 1, 10), dtype=np.float32)}
    fixed = name_output_axes(path, feed, {"x": {0: "batch", 2: "frames"}})
    dims = _dims(onnx.load(str(path)))
    assert dims["up"] == ["batch", 1, "4*frames"] and dims["plus"] == ["batch", 1, "frames + 1"], dims
    assert dims["guess"] == ["batch", 1, "guess_2"] and fixed == {"guess": {2: "guess_2"}}, (dims, fixed)
    _upsampler(path, {"up": "4*s0", "plus": "(frames) + 1", "guess": "4*frames"})
    name_output_axes(path, feed, {"x": {0: "batch", 2: "frames"}})
    dims = {out: d[2] for out, d in _dims(onnx.load(str(path))).items()}
    assert dims == {"up": "up_2", "plus": "(frames) + 1", "guess": "4*frames"}, dims


def test_a_time_major_output_declared_batch_on_its_steps_gets_the_axes_it_follows(tmp_path: Path) -> None:
    """The TorchScript exporter declares ``batch`` on every output's first axis: a time-major ``[T, B, C]`` (a
    CRNN's log-probabilities) came out ``[batch, batch, C]``. The probe sees axis 0 stay when the batch moves and
    follow ``width``: it gets that name, and axis 1, which follows the batch, keeps ``batch``."""
    h = onnx.helper
    x = h.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", "width", 3])
    out = h.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, ["batch", "batch", 3])
    graph = h.make_graph([h.make_node("Transpose", ["x"], ["logits"], perm=[1, 0, 2])], "tm", [x], [out])
    path = tmp_path / "model.onnx"
    onnx.save(h.make_model(graph, opset_imports=[h.make_opsetid("", 17)]), str(path))
    feed = {"x": np.random.default_rng(0).standard_normal((4, 6, 3), dtype=np.float32)}
    fixed = name_output_axes(path, feed, {"x": {0: "batch", 1: "width"}})
    assert _dims(onnx.load(str(path)))["logits"] == ["width", "batch", 3] and fixed == {"logits": {0: "width"}}


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("16*frames", 512),
        ("frames + 1", 33),
        ("(((frames - 3)//2)) + 1", 15),
        ("2*frames - seq", 60),
        ("-frames + 40", 8),
        ("frames", 32),
        ("s0", None),
        ("frames**2", None),
        ("frames / 2", None),
        ("max(frames, 1)", None),
        ("__import__('os').getpid()", None),
        ("frames // 0", None),
        ("16*", None),
        ("", None),
    ],
)
def test_axis_expression_evaluates_sizes_and_nothing_else(text: str, value: int | None) -> None:
    assert axis_expression(text, {"frames": 32, "seq": 4}) == value
