"""Export failures whose cause is a setting the user chose, said with that setting's fix rather than a generic one:
transformers' mixture-of-experts layers computed by an implementation no exporter exports (named at the line torch
says raised, not at shape reads), a size read from the inputs' values, QAT's fake-quantize modules fused or still
observing, and an op the TorchScript exporter lacks below opset 18, where the dynamo exporter does not run."""

from __future__ import annotations

import inspect
import linecache
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from kiln.core.errors import ModelError
from kiln.stages.export.torch_export import DATA_BRANCH_FIX, SIZE_FROM_VALUES_FIX, export_onnx

BATCHED_MM = 'experts_implementation="batched_mm"'


class Routed(nn.Module):
    """transformers' Mixtral mixture-of-experts block, tiny, its experts computed by ``impl``."""

    def __init__(self, impl: str) -> None:
        super().__init__()
        transformers = pytest.importorskip("transformers")
        config = transformers.MixtralConfig(
            hidden_size=8, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, experts_implementation=impl
        )
        if getattr(config, "_experts_implementation", None) != impl:
            pytest.skip(f"transformers {transformers.__version__} has no experts_implementation")
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        torch.manual_seed(0)
        self.moe = MixtralSparseMoeBlock(config)
        for p in self.moe.parameters():
            nn.init.normal_(p, std=0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(x)


SEQ = {"input": {1: "seq"}}


def _refused(model: nn.Module, example: torch.Tensor, path: Path, axes: dict | None = None) -> ModelError:
    """The error exporting ``model`` on ``example`` raises (``axes``: the dynamic axes besides the batch)."""
    with pytest.raises(ModelError) as caught:
        export_onnx(model.eval(), example, path, dynamic_axes=axes)
    return caught.value


def test_transformers_eager_experts_are_named_at_their_loop_with_batched_mm(tmp_path: Path) -> None:
    """The dynamo exporter stops at the experts' loop over the experts the tokens route to; the message names that
    line (torch's "The following call raised this error"), not the user's call or a shape read of the trace, and the
    fix is the experts implementation that exports."""
    model = Routed("eager")
    error = _refused(model, torch.randn(2, 5, 8), tmp_path / "m.onnx", SEQ)
    forward = type(model.moe.experts).forward.__wrapped__  # type: ignore[attr-defined]
    source, first = inspect.getsourcelines(forward)
    named = re.search(r"from its inputs' values at modeling_mixtral\.py:(\d+) \(", error.message)
    assert named is not None and first <= int(named.group(1)) < first + len(source), error.message
    assert linecache.getline(inspect.getfile(forward), int(named.group(1))).lstrip().startswith("for "), error.message
    assert "experts_implementation='eager'" in error.message
    assert BATCHED_MM in (error.hint or "") and "torch.where" not in (error.hint or "")


def test_transformers_grouped_mm_experts_get_batched_mm_not_an_op_onnx_cannot_express(tmp_path: Path) -> None:
    """Both exporters fail (the dynamo exporter on transformers' grouped_mm op, the TorchScript one on histc); the
    fix is the experts implementation, and that implementation does export."""
    error = _refused(Routed("grouped_mm"), torch.randn(2, 5, 8), tmp_path / "m.onnx", SEQ)
    assert "experts_implementation='grouped_mm'" in error.message
    assert BATCHED_MM in (error.hint or "") and "cannot express" not in (error.hint or "")
    export_onnx(Routed("batched_mm").eval(), torch.randn(2, 5, 8), tmp_path / "b.onnx", dynamic_axes=SEQ)


class LoopsOverHits(nn.Module):
    """Adds a step for each column the batch hits: a loop over a tensor of data-dependent length, with a branch
    inside that the trace warns of (the loop itself it does not)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hit = (x.sum(0) > 0).nonzero()
        for column in hit:  # LOOP
            if column == 3:
                continue
            x = x + 1
        return x


def test_a_branch_is_named_at_the_line_torch_says_raised_not_at_a_traced_value(tmp_path: Path) -> None:
    lines = Path(__file__).read_text().splitlines()
    loop = next(i for i, line in enumerate(lines, 1) if line.endswith("# LOOP"))
    with pytest.raises(ModelError) as caught:
        export_onnx(LoopsOverHits().eval(), torch.rand(3, 4), tmp_path / "m.onnx")
    assert f"from its inputs' values at {Path(__file__).name}:{loop} (" in caught.value.message
    assert caught.value.hint == DATA_BRANCH_FIX


class SplitByCounts(nn.Module):
    """DeepSeek-style dispatch: rows sorted by their expert and split by counts read with .tolist()."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(4, 2)
        self.experts = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pick = self.router(x).argmax(-1)
        order = pick.argsort()
        counts = torch.bincount(pick, minlength=2).tolist()  # COUNTS
        outs = [e(rows) for e, rows in zip(self.experts, x[order].split(counts))]
        return torch.zeros_like(x).index_copy(0, order, torch.cat(outs))


COUNTS_AT = f"{Path(__file__).name}:{SplitByCounts.forward.__code__.co_firstlineno + 3}"


def test_a_size_read_from_the_values_is_said_as_one_with_fixed_size_computation(tmp_path: Path) -> None:
    with pytest.raises(ModelError) as caught:
        export_onnx(SplitByCounts().eval(), torch.randn(6, 4), tmp_path / "m.onnx")
    assert f"reads a size from its inputs' values (.tolist(), .item() or int() of a tensor) at {COUNTS_AT} (" in (
        caught.value.message
    )
    assert caught.value.hint == SIZE_FROM_VALUES_FIX and DATA_BRANCH_FIX not in caught.value.hint


class QuantNet(nn.Module):
    """A network prepared for quantization-aware training (torch.ao.quantization's eager mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = torch.ao.quantization.QuantStub(), torch.ao.quantization.DeQuantStub()
        self.conv, self.fc = nn.Conv2d(1, 4, 3, padding=1), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv(self.quant(x)))
        return self.dequant(self.fc(x.mean((2, 3))))


def qat(version: int, observe: bool) -> nn.Module:
    """:class:`QuantNet` prepared with the x86 QAT qconfig of ``version`` (1: fused), its ranges observed on a
    batch, its observers left on where ``observe``."""
    model = QuantNet().train()
    model.qconfig = torch.ao.quantization.get_default_qat_qconfig("x86", version=version)
    torch.ao.quantization.prepare_qat(model, inplace=True)
    with torch.no_grad():
        model(torch.rand(8, 1, 6, 6))
    if not observe:
        model.apply(torch.ao.quantization.disable_observer)
    return model.eval()


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore:Please use quant_min")
def test_qat_fake_quantize_gets_the_qat_fix_and_that_fix_exports(tmp_path: Path) -> None:
    """The default (fused) fake-quantize module has no exporter; a non-fused one observing updates its range in
    place behind a branch the dynamo exporter stops at (in torch's code, not the user's line it names). Each gets
    the QAT fix, and the model it asks for (non-fused, observers off) exports."""
    fused = _refused(qat(1, observe=False), torch.rand(2, 1, 6, 6), tmp_path / "f.onnx")
    assert "FusedMovingAvgObsFakeQuantize (at 'quant.activation_post_process'" in fused.message
    assert 'get_default_qat_qconfig("x86", version=0)' in (fused.hint or "")
    assert "cannot express" not in (fused.hint or "")
    observing = _refused(qat(0, observe=True), torch.rand(2, 1, 6, 6), tmp_path / "o.onnx")
    assert "observers on (at 'quant.activation_post_process'" in observing.message
    assert (observing.hint or "").startswith("call model.apply(torch.ao.quantization.disable_observer)")
    assert "torch.where" not in (observing.hint or "")
    export_onnx(qat(0, observe=False), torch.rand(2, 1, 6, 6), tmp_path / "q.onnx")


class Spectrum(nn.Module):
    """A filter in the frequency domain: rfft, which the TorchScript exporter cannot write and the dynamo one can."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.fft.irfft(torch.fft.rfft(x) * 0.5, n=x.shape[-1])


def test_an_op_the_torchscript_exporter_lacks_below_opset_18_gets_opset_18(tmp_path: Path) -> None:
    """Below opset 18 only the TorchScript exporter runs: the fix is opset 18, not an op ONNX cannot express."""
    with pytest.raises(ModelError, match="aten::fft_rfft' to ONNX opset version 17") as caught:
        export_onnx(Spectrum().eval(), torch.rand(2, 8), tmp_path / "m.onnx", opset=17)
    assert "--set export.opset=18" in (caught.value.hint or "")
    assert "cannot express" not in (caught.value.hint or "")
