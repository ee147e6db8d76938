"""FP8 engines: a layer's GELU and the next layer's input cast as one cuBLASLt call (kiln.stages.engines.torch.
fp8_epilogues). The speed is the GPU's (benchmarks/cublaslt_fp8_probe.py); here: the rewrite finds the FFN's
pattern in an exported FP8 program and leaves the rest, the program computes what the op's reference computes (on
the CPU, where _scaled_mm runs too), and on a GPU with FP8 the cuBLASLt call agrees with that reference."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from torch import nn

from kiln.stages.engines.torch.fp8_epilogues import (
    accuracy_hint,
    fuse_fp8_gelu,
    measure_fp8_gemms,
    reference,
    register_op,
)
from kiln.stages.engines.torch.lowbit import LowbitLinear

DT = torch.float16


class Ffn(nn.Module):
    """Up, GELU, down (the pattern), then a head whose input is not a GELU's."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down, self.head = nn.Linear(16, 64), nn.Linear(64, 16), nn.Linear(16, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.down(nn.functional.gelu(self.up(x)))
        return self.head(h + x)


def _fp8(model: nn.Module, amax: float = 4.0) -> nn.Module:
    torch.manual_seed(0)
    model = model.to(DT)
    for name, layer in list(model.named_children()):
        if isinstance(layer, nn.Linear):
            setattr(model, name, LowbitLinear(layer, "fp8", DT, scaling="static", input_amax=amax))
    return model.eval()


def _exported(model: nn.Module, x: torch.Tensor) -> torch.fx.GraphModule:
    with torch.inference_mode():
        return torch.export.export(model, (x,)).module()


def _ops(gm: torch.fx.GraphModule) -> Counter:
    return Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


def test_the_ffns_gelu_and_next_cast_become_one_op_and_compute_its_reference(tmp_path: Path) -> None:
    model = _fp8(Ffn())
    x = torch.randn(2, 8, 16, dtype=DT)
    with torch.inference_mode():  # saved and loaded, as the engine's program is
        torch.export.save(torch.export.export(model, (x,)), tmp_path / "program.pt2")
    gm = torch.export.load(tmp_path / "program.pt2").module()
    before = _ops(gm)
    assert before["aten._scaled_mm.default"] == 3 and before["aten.gelu.default"] == 1
    assert fuse_fp8_gelu(gm) == 1
    after = _ops(gm)
    assert after["kiln.fp8_linear_bias_gelu.default"] == 1
    assert after["aten._scaled_mm.default"] == 2 and after["aten.gelu.default"] == 0  # down and head stay
    with torch.inference_mode():
        got = gm(x)
        # the same model with the FFN's middle computed as the op's reference (tanh GELU) by hand
        up, down = model.up, model.down
        rows = x.reshape(-1, 16)
        xq = (rows.float() * up.input_inv_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        q = reference(xq, up.weight, up.input_scale, up.weight_scale, up.bias, down.input_inv_scale)
        h = torch._scaled_mm(
            q,
            down.weight.t(),
            scale_a=down.input_scale,
            scale_b=down.weight_scale,
            bias=down.bias,
            out_dtype=DT,
            use_fast_accum=True,
        ).reshape(2, 8, 16)
        want = model.head(h + x)
        exact = model(x)
    assert torch.equal(got, want)
    cos = nn.functional.cosine_similarity(got.float().flatten(), exact.float().flatten(), 0)
    assert cos > 0.999, cos  # the tanh GELU against the model's exact one: within FP8's steps


def test_a_gelu_with_another_reader_or_a_dynamic_layer_is_left_alone() -> None:
    class Shared(Ffn):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            g = nn.functional.gelu(self.up(x))
            return self.head(self.down(g) + g[..., :16])  # the GELU's output read twice

    x = torch.randn(2, 8, 16, dtype=DT)
    assert fuse_fp8_gelu(_exported(_fp8(Shared()), x)) == 0
    dynamic = Ffn().to(DT)  # per-row scales found at each call: no static cast to fold
    dynamic.up = LowbitLinear(dynamic.up, "fp8", DT, scaling="rowwise")
    dynamic.down = LowbitLinear(dynamic.down, "fp8", DT, scaling="rowwise")
    assert fuse_fp8_gelu(_exported(dynamic.eval(), x)) == 0
    per_channel = _fp8(Ffn())  # a scale per channel: cuBLASLt's D scale is one value
    per_channel.down.input_inv_scale = per_channel.down.input_inv_scale.expand(64).clone()
    assert fuse_fp8_gelu(_exported(per_channel, x)) == 0


def test_a_failing_fp8_engine_names_its_fused_gelus_as_what_to_try() -> None:
    hint = accuracy_hint({"fp8_epilogue_layers": {"linear_bias_gelu_fp8": 12}})
    assert hint and hint.startswith("12 FP8 layer(s)") and "gemm_epilogues: off" in hint
    assert accuracy_hint({"fp8_epilogue_layers": {"linear_bias_gelu_fp8": 0}}) is None and accuracy_hint({}) is None


@pytest.mark.gpu
def test_cublaslt_call_agrees_with_its_reference_on_an_fp8_gpu() -> None:
    from kiln.stages.engines.torch import cublaslt
    from kiln.stages.engines.torch.lowbit import supported

    if not torch.cuda.is_available() or supported("fp8"):
        pytest.skip(supported("fp8") or "needs a CUDA GPU")
    register_op()
    torch.manual_seed(0)
    m, k, n = 256, 768, 3072
    x = (torch.randn(m, k, device="cuda") * 8).to(torch.float8_e4m3fn)
    w = (torch.randn(n, k, device="cuda") * 8).to(torch.float8_e4m3fn)
    sx, sw = torch.tensor(0.05, device="cuda"), torch.tensor(0.004, device="cuda")
    bias = (torch.randn(n, device="cuda") * 0.1).half()
    inv = torch.tensor(60.0, device="cuda")
    got = cublaslt.linear_bias_gelu_fp8(x, w, sx, sw, bias, inv).float()
    want = reference(x, w, sx, sw, bias, inv).float()
    assert nn.functional.cosine_similarity(got.flatten(), want.flatten(), 0) > 0.999
    assert (got - want).abs().max() <= 0.125 * want.abs().max()  # an E4M3 step or so, never a wrong layout


@pytest.mark.parametrize("gelu", [True, False])
def test_a_layer_cublaslt_cannot_take_on_its_gpu_is_left_as_it_was(monkeypatch: pytest.MonkeyPatch, gelu: bool) -> None:
    """On a GPU whose cuBLASLt has no such call the op would run its slower reference: the rewrite skips it (the
    GELU's epilogue, and the bias alone for ``gemm_algorithms: measured``)."""
    from types import SimpleNamespace

    from kiln.stages.engines.torch import cublaslt, fp8_epilogues

    def node(shape: tuple[int, ...], dtype: torch.dtype) -> SimpleNamespace:
        return SimpleNamespace(meta={"val": SimpleNamespace(device=torch.device("cuda"), shape=shape, dtype=dtype)})

    asked = []

    def refuse(*args: object, **kwargs: object) -> None:
        asked.append(args[:3])
        raise cublaslt.Unavailable("no FP8 algorithm here")

    monkeypatch.setattr(cublaslt, "gemm", refuse)
    weight, bias = node((64, 16), torch.float8_e4m3fn), node((64,), DT)
    assert not fp8_epilogues._cublaslt_takes(weight, bias, gelu) and asked == [(128, 64, 16)]
    monkeypatch.setattr(cublaslt, "gemm", lambda *args, **kwargs: None)
    assert fp8_epilogues._cublaslt_takes(weight, bias, gelu)
    assert not fp8_epilogues._cublaslt_takes(weight, node((64,), torch.float32), gelu)  # cuBLASLt's bias: 16-bit


def test_measured_algorithms_take_the_other_static_fp8_layers_and_keep_the_answers() -> None:
    """``gemm_algorithms: measured``: after the FFN's fusion the remaining static FP8 layers (down, head) become
    ``kiln::fp8_linear_bias``, whose CPU path is the engine's own ``_scaled_mm``: the program's answers do not
    change, and no transposed weight is left behind."""
    model = _fp8(Ffn())
    x = torch.randn(2, 8, 16, dtype=DT)
    fused, measured = _exported(model, x), _exported(model, x)
    assert fuse_fp8_gelu(fused) == 1
    assert fuse_fp8_gelu(measured, measure=True) == 1 and measure_fp8_gemms(measured) == 2
    ops = _ops(measured)
    assert ops["kiln.fp8_linear_bias.default"] == 2 and ops["aten._scaled_mm.default"] == 0
    assert ops["aten.t.default"] == 0
    gelu = next(n for n in measured.graph.nodes if str(n.target) == "kiln.fp8_linear_bias_gelu.default")
    assert gelu.args[-1] is True
    with torch.inference_mode():
        assert torch.equal(measured(x), fused(x))
    dynamic = Ffn().to(DT)  # per-row scales: not one value per tensor, left to _scaled_mm
    dynamic.up = LowbitLinear(dynamic.up, "fp8", DT, scaling="rowwise")
    assert measure_fp8_gemms(_exported(dynamic.eval(), x)) == 0
