"""build.torch.gemm_epilogues: linear layers as cuBLASLt GEMMs with bias (and GELU) epilogues, through two custom
ops the compiled flavour's program is rewritten to. The speed is the GPU's (benchmarks/engine_bench.py); here: the
rewrite finds the right layers, computes the same function, and survives torch.compile and a build + reload."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml
from pydantic import ValidationError
from torch import nn

from kiln.models.registry import build_model
from kiln.stages.engines.config import BuildConfig
from kiln.stages.engines.registry import load_engine
from kiln.stages.engines.stage import build_engine
from kiln.stages.engines.torch.build import _settings
from kiln.stages.engines.torch.config import TorchConfig
from kiln.stages.engines.torch.gemm_epilogues import accuracy_hint, fuse_linear_epilogues
from tests.conftest import tiny_config_dict
from tests.stages.engines.build_graphs import assert_engine_matches, assert_runner_agrees, sample


class Block(nn.Module):
    """An FFN with GELU, a projection, a bias-less head: what each rewrite does and does not take."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down, self.proj = nn.Linear(16, 32), nn.Linear(32, 16), nn.Linear(16, 16)
        self.head = nn.Linear(16, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.down(nn.functional.gelu(self.up(x)))
        return self.head(torch.relu(self.proj(h + x)))


def _ops(gm: torch.fx.GraphModule) -> Counter:
    return Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


def _exported(model: nn.Module, *args: torch.Tensor) -> torch.fx.GraphModule:
    with torch.inference_mode():
        return torch.export.export(model.eval(), args).module()


@pytest.mark.parametrize(
    "mode, counts",
    [("bias", {"linear_bias": 3, "linear_bias_gelu": 0}), ("bias_gelu", {"linear_bias": 2, "linear_bias_gelu": 1})],
)
def test_the_rewrite_takes_biased_linears_and_keeps_the_function(mode: str, counts: dict) -> None:
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    model, x = Block(), torch.randn(3, 5, 16)
    gm = _exported(model, x)
    assert fuse_linear_epilogues(gm, mode) == counts
    ops = _ops(gm)
    assert ops["aten.linear.default"] == 1  # the bias-less head: nothing for an epilogue, Inductor's GEMM stays
    assert ops["kiln.linear_bias.default"] == counts["linear_bias"]
    assert ops["kiln.linear_bias_gelu.default"] == counts["linear_bias_gelu"]
    assert ops["aten.gelu.default"] == (1 if mode == "bias" else 0)
    with torch.inference_mode():
        want = model(x)
        torch.testing.assert_close(gm(x), want, atol=1e-5, rtol=1e-5)  # CPU: _addmm_activation's GELU is exact
        compiled = torch.compile(gm, dynamic=False)  # Inductor leaves the custom ops alone and compiles the rest
        got, code = run_and_get_code(compiled, x)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    calls = "\n".join(code)
    assert calls.count("torch.ops.kiln.linear_bias.default(") == counts["linear_bias"]
    assert calls.count("torch.ops.kiln.linear_bias_gelu.default(") == counts["linear_bias_gelu"]


class Gelus(nn.Module):
    """A tanh GELU, an exact GELU, and a linear read by a GELU and by the residual (not fusable: two users)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.gelu(self.a(x), approximate="tanh")
        h = nn.functional.gelu(self.b(h))
        y = self.c(h)
        return nn.functional.gelu(y) + y


@pytest.mark.parametrize("mode, fused", [("bias_gelu", 1), ("bias_any_gelu", 2)])
def test_gelus_are_fused_only_where_the_epilogue_computes_them_as_the_model(mode: str, fused: int) -> None:
    """On the CPU the epilogue's GELU is the exact one: bias_gelu leaves the tanh GELU as it is and the function
    unchanged; bias_any_gelu takes it too (computing it exactly, 4.7e-4 at most from tanh). The linear with two users
    only loses its bias to the GEMM."""
    torch.manual_seed(0)
    model, x = Gelus(), torch.randn(4, 8) * 3
    gm = _exported(model, x)
    assert fuse_linear_epilogues(gm, mode) == {"linear_bias": 3 - fused, "linear_bias_gelu": fused}
    with torch.inference_mode():
        diff = (gm(x) - model(x)).abs().max().item()
    if mode == "bias_gelu":
        assert diff < 1e-5
    else:
        assert 1e-6 < diff < 2e-3  # the tanh GELU computed exactly: a real, bounded difference


@pytest.mark.parametrize(
    "merge, counts",
    [
        (False, {"linear_bias": 2 * 5 + 1, "linear_bias_gelu": 2}),
        (True, {"linear_bias": 2 * 3 + 1, "linear_bias_gelu": 2, "merged_linears": 2 * 3}),
    ],
    ids=["plain", "merged"],
)
def test_a_transformers_bert_keeps_its_outputs(merge: bool, counts: dict) -> None:
    """A model nobody here wrote: every biased projection of a `transformers` BERT (Q, K, V, attention output, FFN up
    with its GELU, FFN down, pooler) is rewritten and the pooled output is unchanged; merged, each layer's Q, K and
    V are one GEMM, and the engine holds no more weights than the model."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    bert = transformers.BertModel(
        transformers.BertConfig(
            vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
        )
    ).eval()

    class Pooled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return self.bert(input_ids=ids, attention_mask=mask).pooler_output

    ids, mask = torch.randint(0, 100, (2, 12)), torch.ones(2, 12, dtype=torch.long)
    mask[1, 8:] = 0
    gm = _exported(Pooled(), ids, mask)
    held = sum(t.numel() for t in (*gm.parameters(), *gm.buffers()))
    assert fuse_linear_epilogues(gm, "bias_gelu", merge=merge) == counts
    assert sum(t.numel() for t in (*gm.parameters(), *gm.buffers())) == held
    with torch.inference_mode():
        torch.testing.assert_close(gm(ids, mask), Pooled()(ids, mask), atol=1e-5, rtol=1e-5)


def test_a_merged_weight_read_elsewhere_stays() -> None:
    """Q and K read the same tensor and merge; Q's weight is also read by a matmul of its own (tied weights), so it
    stays in the program beside the merged copy, and V, which reads another tensor, keeps its own GEMM."""

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.q(x) * self.k(x) + self.v(x.relu()) + x @ self.q.weight

    torch.manual_seed(0)
    model, x = Tied(), torch.randn(3, 8)
    gm = _exported(model, x)
    assert fuse_linear_epilogues(gm, "bias", merge=True) == {
        "linear_bias": 2,
        "linear_bias_gelu": 0,
        "merged_linears": 2,
    }
    names = {name for name, _ in (*gm.named_parameters(), *gm.named_buffers())}
    assert "q.weight" in names and "k.weight" not in names and "v.weight" in names
    with torch.inference_mode():
        torch.testing.assert_close(gm(x), model(x), atol=1e-5, rtol=1e-5)


def _transformer() -> nn.Module:
    torch.manual_seed(0)
    return build_model("transformer", {}).eval()


@pytest.mark.slow
def test_a_compiled_engine_with_epilogues_matches_pytorch_and_records_its_layers(zoo, tmp_path: Path) -> None:
    cfg = BuildConfig(backends=["torch"], torch=TorchConfig(gemm_epilogues="bias_gelu"))  # flavour auto
    meta = build_engine(
        zoo("transformer"),
        tmp_path / "e",
        "torch",
        "cpu",
        "fp32",
        cfg,
        tmp_path / "c",
        max_batch=4,
        torch_model=_transformer,
    )
    assert meta.flavour == "compiled"  # auto goes straight to the flavour that can hold the custom ops
    settings = meta.builder_settings
    assert settings["gemm_epilogues"] == "bias_gelu" and settings["gemm_epilogue_layers"]["linear_bias_gelu"] >= 1
    assert settings["merge_linears"] and settings["gemm_epilogue_layers"]["merged_linears"] == 6  # Q, K, V of 2
    torch.compiler.reset()  # the runner rewrites and compiles again in a process that has not seen the model
    assert_engine_matches(tmp_path / "e", _transformer(), "transformer", (1, 4))


@pytest.mark.parametrize(
    "device, precision, flavour, mode",
    [
        ("cuda", "fp16", "auto", "bias_any_gelu"),
        ("cuda", "fp16", "compiled", "bias_any_gelu"),
        ("cuda", "fp16", "aotinductor", "off"),
        ("cuda", "fp32", "auto", "off"),
        ("cpu", "fp32", "auto", "off"),
    ],
)
def test_auto_means_the_epilogues_for_fp16_gpu_engines_only(
    device: str, precision: str, flavour: str, mode: str
) -> None:
    """The default, as the build records it: FP16 GPU engines get them (the H200 measurement); CPU engines, FP32
    engines (not measured) and AOTInductor packages (which cannot hold the ops) not; an explicit mode is kept."""
    assert TorchConfig().gemm_epilogues == "auto"
    assert _settings(TorchConfig(flavour=flavour), device, precision, has_conv=False)["gemm_epilogues"] == mode
    explicit = "off" if mode == "bias_any_gelu" else "bias_gelu"
    if flavour != "aotinductor":  # (an explicit mode with aotinductor is refused: the test below)
        assert (
            _settings(TorchConfig(flavour=flavour, gemm_epilogues=explicit), device, precision, has_conv=False)[
                "gemm_epilogues"
            ]
            == explicit
        )


def test_only_an_explicit_setting_warns_when_there_is_nothing_to_rewrite(caplog: pytest.LogCaptureFixture) -> None:
    """`auto` applies to every FP16 GPU engine, whatever its layers: silence for it, a warning for a user's mode."""
    model, x = nn.Sequential(nn.Linear(4, 4, bias=False), nn.ReLU()), torch.randn(2, 4)
    for warn in (False, True):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kiln.build"):
            assert fuse_linear_epilogues(_exported(model, x), "bias", warn_if_none=warn) == {
                "linear_bias": 0,
                "linear_bias_gelu": 0,
            }
        assert ("no linear layer with a bias" in caplog.text) is warn


def test_a_missed_accuracy_gate_names_the_gelu_approximation_only_where_there_is_one() -> None:
    approximated = {
        "gemm_epilogues": "bias_any_gelu",
        "gemm_epilogue_layers": {"linear_bias": 6, "linear_bias_gelu": 2},
    }
    hint = accuracy_hint(approximated, "cuda")
    assert hint is not None and "2 GELU layer(s)" in hint and "with bias_gelu" in hint
    assert accuracy_hint(approximated, "cpu") is None  # the CPU's epilogue computes the exact GELU
    for settings in (
        {"gemm_epilogues": "bias_gelu", "gemm_epilogue_layers": {"linear_bias_gelu": 2}},
        {"gemm_epilogues": "bias_any_gelu", "gemm_epilogue_layers": {"linear_bias_gelu": 0}},
        {"gemm_epilogues": "bias_any_gelu"},
        {},
    ):  # exact GELUs, none fused, an older engine
        assert accuracy_hint(settings, "cuda") is None


def test_epilogues_refuse_the_aotinductor_flavour_when_the_config_is_read(tmp_path: Path) -> None:
    """Said when the config is read (before training), as `kiln run` prints it: one error line, one fix line."""
    with pytest.raises(ValidationError, match="needs flavour compiled or auto"):
        TorchConfig(flavour="aotinductor", gemm_epilogues="bias")
    config = tmp_path / "kiln.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                **tiny_config_dict(),
                "build": {
                    "backends": ["onnxruntime", "torch"],
                    "torch": {"flavour": "aotinductor", "gemm_epilogues": "bias"},
                },
            }
        )
    )
    # A process of its own: the CLI sets up logging for the whole process, which later tests' log capture would see
    result = subprocess.run(
        [sys.executable, "-m", "kiln.cli", "run", str(config), "--workdir", str(tmp_path / "w"), "--quiet"],
        capture_output=True,
        text=True,
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and not (tmp_path / "w" / "train").exists(), result.stdout + result.stderr
    assert lines[-2].startswith("error: ") and "gemm_epilogues needs flavour compiled" in lines[-2]
    assert lines[-1].startswith("fix: ")


@pytest.mark.gpu
@pytest.mark.timeout(900)  # max-autotune still tunes what is not a linear layer
@pytest.mark.parametrize("algorithms", ["heuristic", "measured"])
def test_cuda_fp16_engine_with_cublaslt_epilogues_agrees_and_replays_graphs(
    zoo, tmp_path: Path, algorithms: str
) -> None:
    """On the GPU the ops run cuBLASLt's bias / bias + GELU (tanh) epilogues inside Kiln's CUDA graphs (ATen's calls,
    or Kiln's binding with algorithms chosen by measurement). The default (auto) is bias_any_gelu for an FP16 GPU
    engine: the zoo model's exact GELU is taken too, as the tanh one."""
    cfg = BuildConfig(backends=["torch"], torch=TorchConfig(devices=["cuda"], gemm_algorithms=algorithms))
    meta = build_engine(
        zoo("transformer"),
        tmp_path / "e",
        "torch",
        "cuda",
        "fp16",
        cfg,
        tmp_path / "c",
        max_batch=32,
        torch_model=_transformer,
    )
    assert meta.flavour == "compiled" and meta.builder_settings["cuda_graphs"]
    assert meta.builder_settings["gemm_epilogues"] == "bias_any_gelu"
    assert meta.builder_settings["gemm_epilogue_layers"]["linear_bias_gelu"] >= 1
    assert meta.builder_settings["gemm_epilogue_layers"]["merged_linears"] == 6  # each layer's Q, K, V: one GEMM
    assert meta.builder_settings["gemm_algorithms"] == algorithms
    if algorithms == "measured":  # what the build chose, for the engine's loaders to adopt
        chosen = meta.builder_settings["gemm_algorithm_choices"]["algorithms"]
        assert chosen and all(key.endswith(",2") for key in chosen)  # float16 inputs (cuBLASLt's type 2)
    with load_engine(tmp_path / "e") as runner:
        assert_runner_agrees(runner, _transformer(), "transformer", (1, 32))
        assert runner.prepared({runner.input_names[0]: sample("transformer", 32)})[1]  # a CUDA graph per batch size


def test_measured_algorithms_reach_the_ops_and_only_gpu_engines_record_them() -> None:
    """``gemm_algorithms: measured`` travels as the ops' ``measure`` argument (on the CPU the op is ATen's call,
    so the answers are the same); the build records it for GPU engines of the compiled flavour only."""
    torch.manual_seed(0)
    model, x = Block(), torch.randn(3, 5, 16)
    gm = _exported(model, x)
    assert fuse_linear_epilogues(gm, "bias_gelu", measure=True) == {"linear_bias": 2, "linear_bias_gelu": 1}
    ops = [n for n in gm.graph.nodes if str(n.target).startswith("kiln.")]
    assert len(ops) == 3 and all(n.args[3] is True for n in ops)
    with torch.inference_mode():
        torch.testing.assert_close(gm(x), model(x), atol=1e-5, rtol=1e-5)
    measured = TorchConfig(gemm_algorithms="measured")
    assert _settings(measured, "cuda", "fp16", has_conv=False)["gemm_algorithms"] == "measured"
    assert _settings(measured, "cpu", "fp32", has_conv=False)["gemm_algorithms"] == "heuristic"
    assert _settings(TorchConfig(), "cuda", "fp16", has_conv=False)["gemm_algorithms"] == "heuristic"


@pytest.mark.parametrize(
    "device, precision, cfg, measured",
    [
        ("cuda", "fp16", {}, True),  # gemm_epilogues (auto): Kiln's linear ops
        ("cuda", "fp8", {"gemm_epilogues": "off"}, True),  # FP8 layers through the binding
        ("cuda", "fp16", {"gemm_epilogues": "off"}, False),  # Inductor's GEMMs: nothing of Kiln's to time
        ("cuda", "fp32", {}, False),
        ("cuda", "fp8", {"flavour": "aotinductor", "gemm_epilogues": "off"}, False),
        ("cpu", "fp32", {}, False),
    ],
)
def test_measured_algorithms_are_recorded_only_where_there_are_gemms_to_time(
    device: str, precision: str, cfg: dict, measured: bool, caplog: pytest.LogCaptureFixture
) -> None:
    settings = _settings(TorchConfig(gemm_algorithms="measured", **cfg), device, precision, False)
    assert settings["gemm_algorithms"] == ("measured" if measured else "heuristic")
    said = [r.getMessage() for r in caplog.records if "gemm_algorithms: measured" in r.getMessage()]
    assert bool(said) is not measured  # the user asked for it: where it does nothing, the build says so
    assert _settings(TorchConfig(**cfg), device, precision, False)["gemm_algorithms"] == "heuristic"
