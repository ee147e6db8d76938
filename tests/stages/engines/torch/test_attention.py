"""build.torch.fused_attention: FP16/BF16 attention calls of the compiled flavour's program as ``kiln::attention``,
which PyTorch dispatches to its fused kernels at run time. The speed is the GPU's (benchmarks/engine_bench.py,
``hf_vit``); here: the rewrite takes the attention calls it should, computes the same function, lays its output out
as it declares, and a GPU engine built with it agrees with the model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from kiln.stages.engines.config import BuildConfig
from kiln.stages.engines.registry import load_engine
from kiln.stages.engines.stage import build_engine
from kiln.stages.engines.torch.attention import fuse_attention, register_op
from kiln.stages.engines.torch.build import _settings
from kiln.stages.engines.torch.config import TorchConfig
from tests.stages.engines.build_graphs import assert_runner_agrees


class Attention(nn.Module):
    """Unmasked self-attention over 13 tokens (a ViT's form), and a masked one after it (BERT's)."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.qkv, self.heads = nn.Linear(dim, 3 * dim), heads

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = nn.functional.scaled_dot_product_attention(q, k, v, scale=0.5)
        y = nn.functional.scaled_dot_product_attention(y, k, v, attn_mask=mask[:, None, None, :])
        return y.transpose(1, 2).reshape(b, t, d)


def _program(dtype: torch.dtype) -> tuple[torch.fx.GraphModule, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = Attention().to(dtype).eval()
    args = (torch.randn(2, 13, 32, dtype=dtype), torch.rand(2, 13) > 0.2)
    with torch.inference_mode():
        return torch.export.export(model, args).module(), args


def test_low_precision_attention_becomes_the_op_and_computes_the_same() -> None:
    gm, args = _program(torch.bfloat16)
    with torch.inference_mode():
        want = gm(*args)
        assert fuse_attention(gm, devices=("cpu",)) == 2  # the unmasked call and the masked one, scale kept
        got = gm(*args)
    assert [str(n.target) for n in gm.graph.nodes if "attention" in str(n.target)] == ["kiln.attention.default"] * 2
    torch.testing.assert_close(got, want)
    with torch.inference_mode():  # Inductor compiles around the op and reads its output in the layout declared
        compiled = torch.compile(gm, dynamic=False)(*args)
    torch.testing.assert_close(compiled, want, atol=2e-2, rtol=2e-2)


def test_auto_takes_the_unmasked_call_only() -> None:
    """A masked call (BERT's) keeps Inductor's fused kernel under auto; the unmasked one (a ViT's) is rewritten."""
    gm, _ = _program(torch.bfloat16)
    assert fuse_attention(gm, devices=("cpu",), masked=False) == 1
    assert [n.target for n in gm.graph.nodes if "attention" in str(n.target)][
        1
    ] == torch.ops.aten.scaled_dot_product_attention.default


def test_the_all_true_mask_transformers_traces_for_a_vit_counts_as_no_mask() -> None:
    """torch.export traces a ``transformers`` ViT's attention with the mask ``arange(n) >= 0`` broadcast: it masks
    nothing, so auto (unmasked calls only) takes it, and the engine computes as PyTorch does."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.ViTConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=16, patch_size=8
    )
    torch.manual_seed(0)
    model = transformers.ViTForImageClassification(cfg).eval().to(torch.bfloat16)
    x = torch.randn(2, 3, 16, 16, dtype=torch.bfloat16)
    with torch.inference_mode():
        gm = torch.export.export(model, (x,), dynamic_shapes=({0: torch.export.Dim("batch", max=8)},)).module()
        assert fuse_attention(gm, devices=("cpu",), masked=False) == 2
        got, want = gm(x), model(pixel_values=x)
    torch.testing.assert_close(got.logits if hasattr(got, "logits") else got[0], want.logits)


def test_a_mask_that_counts_down_below_zero_is_a_mask() -> None:
    """``arange(n) - 3 >= 0`` (``add`` with ``alpha=-1``) masks the first three keys."""

    class Shifted(nn.Module):
        def forward(self, q: torch.Tensor) -> torch.Tensor:
            mask = torch.add(torch.arange(q.shape[2]), 3, alpha=-1) >= 0
            return nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask.expand(q.shape[0], 1, 1, -1))

    q = torch.randn(2, 4, 6, 8, dtype=torch.bfloat16)
    with torch.inference_mode():
        gm = torch.export.export(Shifted(), (q,)).module()
    assert fuse_attention(gm, devices=("cpu",), masked=False) == 0


def test_a_mask_that_reads_the_inputs_is_a_mask() -> None:
    gm, _ = _program(torch.bfloat16)
    assert fuse_attention(gm, devices=("cpu",), masked=False) == 1  # the unmasked call only: the other's is the data's


def test_fp32_and_other_devices_keep_inductor_s_attention() -> None:
    gm, _ = _program(torch.float32)
    assert fuse_attention(gm, devices=("cpu",)) == 0  # FP32: the fused GPU kernels do not take it
    gm, _ = _program(torch.bfloat16)
    assert fuse_attention(gm) == 0  # CPU tensors, GPU-only by default


class Pooling(nn.Module):
    """Learned queries [1, H, Q, D] over a batch of keys, the batch broadcast by the call (Perceiver's latents)."""

    def __init__(self) -> None:
        super().__init__()
        self.latents = nn.Parameter(torch.randn(1, 2, 3, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kv = x.view(x.shape[0], x.shape[1], 2, 8).transpose(1, 2)
        return nn.functional.scaled_dot_product_attention(self.latents, kv, kv)


def test_a_batch_the_call_broadcasts_is_left_to_inductor() -> None:
    model = Pooling().to(torch.bfloat16).eval()
    with torch.inference_mode():
        gm = torch.export.export(model, (torch.randn(3, 5, 16, dtype=torch.bfloat16),)).module()
    assert fuse_attention(gm, devices=("cpu",)) == 0


def test_the_op_writes_the_layout_its_fake_declares() -> None:
    register_op()
    q = torch.randn(2, 4, 13, 8, dtype=torch.bfloat16)
    real = torch.ops.kiln.attention(q, q, q)
    with torch._subclasses.FakeTensorMode() as mode:
        fake = torch.ops.kiln.attention(*(mode.from_tensor(q) for _ in range(3)))
    assert real.shape == fake.shape and real.stride() == fake.stride()


@pytest.mark.parametrize(
    ("device", "precision", "setting", "scope"),
    [
        ("cuda", "fp16", "auto", "unmasked"),
        ("cuda", "fp8", "auto", "unmasked"),
        ("cuda", "fp16", "on", "all"),
        ("cuda", "fp32", "auto", False),
        ("cpu", "fp32", "auto", False),
        ("cuda", "fp16", "off", False),
    ],
)
def test_auto_means_unmasked_calls_of_low_precision_gpu_engines(
    device: str, precision: str, setting: str, scope: str | bool
) -> None:
    assert _settings(TorchConfig(fused_attention=setting), device, precision, False)["fused_attention"] == scope


@pytest.mark.gpu
@pytest.mark.timeout(900)
def test_cuda_fp16_transformer_engine_runs_the_op_and_agrees(zoo, tmp_path: Path) -> None:
    from tests.stages.engines.torch.test_gemm_epilogues import _transformer as model

    cfg = BuildConfig(backends=["torch"], torch=TorchConfig(devices=["cuda"], fused_attention="on"))
    meta = build_engine(
        zoo("transformer"),
        tmp_path / "e",
        "torch",
        "cuda",
        "fp16",
        cfg,
        tmp_path / "c",
        max_batch=32,
        torch_model=model,
    )
    assert meta.builder_settings["fused_attention_layers"]["attention"] >= 1, meta.builder_settings
    with load_engine(tmp_path / "e") as runner:
        assert_runner_agrees(runner, model(), "transformer", (1, 32))
