"""Where the dynamo exporter fixed an axis signature.dynamic_axes makes dynamic and the TorchScript exporter's graph,
exported instead, cannot run in ONNX Runtime at any batch, the error says the graph is that fallback's, why (the axis,
at the line that fixed it), and that the fix is the axis, not an op; the dynamo exporter's warning names that line;
and the exported file carries none of the exporter's per-node stack traces."""

from __future__ import annotations

import re
from pathlib import Path

import onnx
import pytest
import torch
from click.testing import CliRunner
from torch import nn

from kiln.cli import main
from kiln.core.errors import ModelError
from kiln.stages.export.parity import batch_parity, exported_session
from kiln.stages.export.torch_export import export_onnx, export_with_fallback, fallback_failed
from tests.core.test_ownership import one_error

HERE = "tests.stages.export.test_fallback_graph_fails"


class SplitScan(nn.Module):
    """A scan over the length in a Python loop (the dynamo exporter fixes the length), after a tensor_split at a
    length computed from the shape, which the TorchScript exporter writes as a Tile ONNX Runtime refuses."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, T, C]
        n = x.shape[1]
        head, _ = torch.tensor_split(x, [n - min(0, n)], dim=1)
        h = torch.zeros_like(x[:, 0])
        outs = []
        for t in range(head.shape[1]):  # LOOP
            h = 0.5 * h + head[:, t]
            outs.append(h)
        return torch.stack(outs, 1)


def split_scan() -> nn.Module:
    return SplitScan()


LOOP_LINE = next(i for i, s in enumerate(Path(__file__).read_text().splitlines(), 1) if s.endswith("# LOOP"))
LOOP_AT = f"test_fallback_graph_fails.py:{LOOP_LINE}"


def test_a_fallback_graph_onnx_runtime_cannot_run_says_the_axis_dynamo_fixed_and_where(tmp_path: Path) -> None:
    """Before: 'ONNX Runtime cannot run the exported graph at batch 8' (it fails at the traced batch too) with a fix
    about ops. Now the error names the fallback, the axis and the loop's line, and the fix is the axis."""
    args = ["export", "--model", f"{HERE}:split_scan", "--input-shape", "8x6x3", "-o", str(tmp_path / "m.onnx")]
    result = CliRunner().invoke(main, [*args, "--set", "signature.dynamic_axes={input: {1: seq}}"])
    one_error(
        result,
        "not even at batch 2, the batch it was traced at",
        "this graph is the TorchScript exporter's, the fallback after the dynamo exporter failed (it fixed input "
        f"'input' axis 1 (seq), which signature.dynamic_axes makes dynamic, at {LOOP_AT})",
        f"fix: remove seq from signature.dynamic_axes, so the model is exported at one length (pad shorter inputs to "
        f"it), which the dynamo exporter exports; or write the code that fixed it at {LOOP_AT} with tensor ops",
    )
    assert "at batch 8" not in result.output and "runs differently" not in result.output, result.output
    said = re.search(
        rf"makes dynamic, at {re.escape(LOOP_AT)} \(\d+\.\d s\); trying the TorchScript exporter", result.output
    )
    assert said, result.output


def test_a_fallback_graph_onnx_runtime_cannot_load_is_said_as_the_fallbacks(tmp_path: Path) -> None:
    """A session that ONNX Runtime refuses on the TorchScript exporter's graph: the load error, then why the graph
    is the fallback's and the fix for that, not only 'try another opset'."""
    path = tmp_path / "bad.onnx"
    node = onnx.helper.make_node("NoSuchOp", ["x"], ["y"])
    vi = [onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, [1]) for n in ("x", "y")]
    onnx.save(onnx.helper.make_model(onnx.helper.make_graph([node], "g", vi[:1], vi[1:])), str(path))
    refused = "it fixed input 'ids' axis 1 (seq), which signature.dynamic_axes makes dynamic, at modeling_x.py:315"
    with pytest.raises(ModelError) as info:
        exported_session(path, refused)
    assert info.value.message.startswith("ONNX Runtime cannot load the model: ")
    assert info.value.message.endswith(f"the fallback after the dynamo exporter failed ({refused})")
    assert info.value.hint.startswith("remove seq from signature.dynamic_axes")
    assert "at modeling_x.py:315 with tensor ops" in info.value.hint


def test_a_fallback_after_another_dynamo_failure_points_at_the_code_it_failed_on() -> None:
    """Where the dynamo exporter failed on the user's code (not by fixing an axis), the fix names that code."""
    error = fallback_failed("ONNX Runtime cannot run it", "no decomposition for aten::foo (in forward() at m.py:9)")
    assert error.hint.startswith("change the code the dynamo exporter failed on in forward() at m.py:9")


def test_the_exported_file_carries_no_stack_traces_of_the_exporter(tmp_path: Path) -> None:
    """The dynamo exporter writes each node's Python stack and torch.fx node as metadata (most of a small model's
    file, which nothing reads); the export drops them and keeps the module scopes the precision and validate stages
    read."""
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    proto = export_onnx(model, torch.randn(2, 4), tmp_path / "m.onnx")
    saved = onnx.load(str(tmp_path / "m.onnx"))
    for graph in (proto.graph, saved.graph):
        keys = {p.key for n in graph.node for p in n.metadata_props}
        assert "pkg.torch.onnx.name_scopes" in keys, keys
        assert not keys & {"pkg.torch.onnx.stack_trace", "pkg.torch.onnx.fx_node"}, keys


class TinyMamba(nn.Module):
    """transformers' Mamba on its pure-torch path: the selective scan is a Python loop over the length."""

    def __init__(self) -> None:
        super().__init__()
        transformers = pytest.importorskip("transformers")
        config = transformers.MambaConfig(hidden_size=8, num_hidden_layers=1, state_size=4, vocab_size=20)
        self.model = transformers.MambaModel(config)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


@pytest.mark.slow
def test_a_mamba_whose_fallback_graph_fails_names_the_library_loop_and_the_axis(tmp_path: Path) -> None:
    """The user's case: the dynamo exporter fixes seq in modeling_mamba.py's scan loop, the TorchScript exporter's
    graph has a Tile ONNX Runtime refuses at every batch; the error names the loop's line and the axis to remove."""
    torch.manual_seed(0)
    model = TinyMamba().eval()
    x = {"input_ids": torch.randint(0, 20, (8, 16)), "attention_mask": torch.ones(8, 16, dtype=torch.long)}
    example, path = {k: v[:2] for k, v in x.items()}, tmp_path / "m.onnx"
    axes = {"input_ids": {1: "seq"}, "attention_mask": {1: "seq"}}
    _, refused = export_with_fallback(model, example, path, dynamic_axes=axes)
    assert re.search(r"makes dynamic, at modeling_mamba\.py:\d+", refused), refused
    with pytest.raises(ModelError) as info:
        batch_parity(model, path, example, x, 1e-4, exported_session(path, refused), 1e-4, refused)
    assert "not even at batch 2" in info.value.message and refused in info.value.message, info.value.message
    assert re.match(r"remove seq from signature\.dynamic_axes.*at modeling_mamba\.py:\d+", info.value.hint)


def test_a_batch_dynamo_fixed_is_no_signature_axis_to_remove() -> None:
    """The batch axis is export.dynamic_batch's, not signature.dynamic_axes': its fix is to take sizes from the
    batch with tensor ops, and where another axis was fixed too, that one's loop reads its own axis."""
    from kiln.stages.export.torch_export import fallback_failed

    batch = fallback_failed("x", "it fixed input 'x' axis 0 (batch), which signature.dynamic_axes makes dynamic")
    assert "signature.dynamic_axes" not in batch.hint and batch.hint.startswith("compute the sizes"), batch.hint
    both = fallback_failed("x", "it fixed input 'x' axis 0 (batch), input 'x' axis 2 (time), which ... at m.py:3")
    assert both.hint.startswith("remove time from signature.dynamic_axes") and "x.shape[2]" in both.hint, both.hint
