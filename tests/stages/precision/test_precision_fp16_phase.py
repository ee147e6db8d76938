"""FP16 conversion keeps periodic ops (Sin/Cos) and the small chain computing their phase in FP32: a sinusoidal
timestep embedding at t=999 computed in FP16 is off by ~0.14, since FP16's spacing is 0.5 between 512 and 1024."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper
from torch import nn

from kiln.core.onnx_io import check_onnx, infer_shapes, load_onnx
from kiln.stages.export.torch_export import export_onnx
from kiln.stages.precision.compare import run_batched
from kiln.stages.precision.config import FP16Config
from kiln.stages.precision.fp16 import convert_fp16, name_nodes
from kiln.stages.precision.fp16_select import select_fp32_nodes
from tests.stages.precision.precision_graphs import make_model, node_input_types, rng_weights

F32, F16 = TensorProto.FLOAT, TensorProto.FLOAT16


def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """The DDPM/ADM sinusoidal embedding: cos and sin of ``t * freqs``, freqs from 1 down to 1/max_period."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32) / half)
    args = t.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class TimestepNet(nn.Module):
    """A denoiser's skeleton: a big activation ``x`` projected in the trunk, shifted by the embedded timestep.
    Returns the embedding too, so a test can read it from the converted graph."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 32)
        self.t_mlp = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        emb = timestep_embedding(t, 32)
        return self.proj(x) + self.t_mlp(emb)[:, None, :], emb


def _exported(tmp_path: Path, t_dtype: torch.dtype) -> onnx.ModelProto:
    torch.manual_seed(0)
    path = tmp_path / "model.onnx"
    export_onnx(TimestepNet(), {"x": torch.randn(2, 16, 32), "t": torch.tensor([3, 999]).to(t_dtype)}, path)
    return name_nodes(infer_shapes(load_onnx(path)))


def _feed(t: int, t_dtype: np.dtype) -> dict[str, np.ndarray]:
    x = np.random.default_rng(0).standard_normal((4, 16, 32)).astype(np.float32)
    return {"x": x, "t": np.full(4, t, t_dtype)}


@pytest.mark.parametrize("t_dtype", [torch.int64, torch.float32])
def test_timestep_embedding_at_t999_matches_fp32(tmp_path: Path, t_dtype: torch.dtype) -> None:
    model = _exported(tmp_path, t_dtype)
    keep = select_fp32_nodes(model, FP16Config())
    converted, _ = convert_fp16(model, set(keep), FP16Config())
    check_onnx(converted)
    np_dtype = np.int64 if t_dtype == torch.int64 else np.float32
    for t in (999, 500, 10):
        want = run_batched(model, _feed(t, np_dtype))
        got = run_batched(converted, _feed(t, np_dtype))
        assert np.abs(got[1] - want[1]).max() < 1e-3, f"embedding at t={t}"  # FP16 rounding of [-1, 1] only
    ops = {n.name: n.op_type for n in model.graph.node}
    types = node_input_types(converted)
    periodic = [name for name, op in ops.items() if op in ("Sin", "Cos")]
    assert periodic and all(types[name] == F32 for name in periodic)
    producers = {o: n for n in model.graph.node for o in n.output}
    feeding = producers[next(n for n in model.graph.node if n.op_type == "Sin").input[0]]  # t * freqs
    assert types[feeding.name] == F32 and "phase" in keep[feeding.name]
    gemms = [name for name, op in ops.items() if op in ("MatMul", "Gemm")]
    assert gemms and all(types[name] == F16 for name in gemms)  # the trunk and the MLP still run in FP16


def test_phase_chain_can_be_left_to_fp16(tmp_path: Path) -> None:
    model = _exported(tmp_path, torch.int64)
    cfg = FP16Config(phase_fp32=False)
    keep = select_fp32_nodes(model, cfg)
    assert not any("phase" in why for why in keep.values())


def siren_graph() -> onnx.ModelProto:
    """input [batch, 256] -> MatMul -> Sin -> MatMul: a periodic activation of a big (data-dependent) tensor."""
    nodes = [
        helper.make_node("MatMul", ["input", "w1"], ["h"], name="mm1"),
        helper.make_node("Mul", ["h", "w0"], ["scaled"], name="omega"),
        helper.make_node("Sin", ["scaled"], ["s"], name="sin"),
        helper.make_node("MatMul", ["s", "w2"], ["logits"], name="mm2"),
    ]
    inits = {"w1": rng_weights(256, 16), "w0": np.array(30.0, np.float32), "w2": rng_weights(16, 10, seed=1)}
    return make_model(nodes, inits, features=256)


def test_sin_of_an_activation_stays_fp32_but_its_producers_do_not() -> None:
    model = name_nodes(infer_shapes(siren_graph()))
    keep = select_fp32_nodes(model, FP16Config())
    assert set(keep) == {"sin"}
    converted, _ = convert_fp16(model, set(keep), FP16Config())
    types = node_input_types(converted)
    assert types["sin"] == F32 and types["mm1"] == types["omega"] == types["mm2"] == F16


def test_small_float_input_and_constants_feeding_sin_stay_fp32() -> None:
    """A position input [batch, 1] scaled by constants (NeRF-style encoding) is a phase; the head is not."""
    nodes = [
        helper.make_node("Constant", [], ["k"], value=helper.make_tensor("k", F32, [], [1000.0]), name="const"),
        helper.make_node("Mul", ["input", "k"], ["p"], name="scale"),
        helper.make_node("Mul", ["p", "freqs"], ["phase"], name="freq"),
        helper.make_node("Cos", ["phase"], ["c"], name="cos"),
        helper.make_node("MatMul", ["c", "w"], ["logits"], name="head"),
    ]
    inits = {"freqs": np.geomspace(1, 1e-4, 8).astype(np.float32)[None], "w": rng_weights(8, 4)}
    model = name_nodes(infer_shapes(make_model(nodes, inits, features=1, out_dim=4)))
    keep = select_fp32_nodes(model, FP16Config())
    assert set(keep) == {"const", "scale", "freq", "cos"}
    converted, _ = convert_fp16(model, set(keep), FP16Config())
    x = np.linspace(0, 1, 64, dtype=np.float32)[:, None]
    np.testing.assert_allclose(run_batched(converted, x)[0], run_batched(model, x)[0], atol=5e-3)
    assert node_input_types(converted)["head"] == F16


class CodesVocoder(nn.Module):
    """A Vocos-like head on integer codes: embedding -> transformer -> ``exp(mag) * cos(phase)``."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(256, 64)
        layer = nn.TransformerEncoderLayer(64, 4, 128, batch_first=True, dropout=0.0)
        self.body = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(64, 2 * 17)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mag, p = self.head(self.body(self.emb(ids))).chunk(2, -1)
        return torch.exp(mag) * torch.cos(p), torch.exp(mag) * torch.sin(p)


class RotaryAttention(nn.Module):
    """Llama-style rotary embedding: positions from Range, ``inv_freq`` a buffer, the angles as Hugging Face
    computes them (``inv_freq[:, None] @ positions[None]``, a MatMul with inner axis 1) or as a product."""

    def __init__(self, outer_matmul: bool) -> None:
        super().__init__()
        self.outer_matmul = outer_matmul
        self.emb, self.q, self.k = nn.Embedding(256, 64), nn.Linear(64, 64), nn.Linear(64, 64)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64)))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device).float()
        if self.outer_matmul:
            inv = self.inv_freq[None, :, None].expand(ids.shape[0], -1, 1)
            freqs = (inv @ pos[None, None, :].expand(ids.shape[0], 1, -1)).transpose(1, 2)
        else:
            freqs = pos[None, :, None] * self.inv_freq
        angles = torch.cat([freqs, freqs], -1)
        cos, sin = angles.cos(), angles.sin()
        x = self.emb(ids)

        def rotate(t: torch.Tensor) -> torch.Tensor:
            a, b = t.chunk(2, -1)
            return torch.cat([-b, a], -1)

        q, k = self.q(x), self.k(x)
        return torch.softmax((q * cos + rotate(q) * sin) @ (k * cos + rotate(k) * sin).transpose(1, 2), -1) @ x


def _phase_kept(tmp_path: Path, model: nn.Module) -> tuple[onnx.ModelProto, dict[str, str]]:
    """``model`` exported on integer tokens [1, 32] and the nodes kept FP32 for a phase."""
    torch.manual_seed(0)
    path = tmp_path / "model.onnx"
    export_onnx(model.eval(), {"ids": torch.randint(0, 256, (1, 32))}, path)
    graph = name_nodes(infer_shapes(load_onnx(path)))
    keep = select_fp32_nodes(graph, FP16Config())
    return graph, {n: why for n, why in keep.items() if "phase" in why}


def test_activations_from_integer_codes_are_no_phase(tmp_path: Path) -> None:
    """A vocoder on integer codes takes cos of its last layer's output: the embedding lookup and the layers after
    it are the model, not a phase computed from the codes; they stay FP16."""
    graph, phase = _phase_kept(tmp_path, CodesVocoder())
    ops = {n.name: n.op_type for n in graph.graph.node}
    assert len(phase) <= 4, sorted(ops[n] for n in phase)
    assert not {ops[n] for n in phase} & {"Gather", "MatMul", "Gemm"}
    converted, _ = convert_fp16(graph, set(select_fp32_nodes(graph, FP16Config())), FP16Config())
    types = node_input_types(converted)
    assert all(types[n.name] == F16 for n in converted.graph.node if n.op_type in ("MatMul", "Gemm"))


@pytest.mark.parametrize("outer_matmul", [False, True])
def test_rotary_angles_stay_fp32_and_the_attention_does_not(tmp_path: Path, outer_matmul: bool) -> None:
    """Rotary angles (positions times inv_freq, by a product or Hugging Face's inner-axis-1 MatMul) are a phase;
    the token embedding and the q/k projections are not."""
    graph, phase = _phase_kept(tmp_path, RotaryAttention(outer_matmul))
    ops = {n.name: n.op_type for n in graph.graph.node}
    kept = [ops[n] for n in phase]
    assert 0 < len(kept) <= 12, kept
    assert "Gather" not in kept and "Gemm" not in kept
    assert kept.count("MatMul") == int(outer_matmul)
