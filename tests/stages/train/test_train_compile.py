"""train.compile: torch.compile (inductor, on CPU here) inside the real loop, with AMP, accumulation, checkpoints,
evaluation and the fallback to eager. The compiled DDP test is in test_train_ddp_gpu.py (2 GPUs).

Each test starts from empty in-process Dynamo caches (torch.compiler.reset): a forward compiled by an earlier
test would otherwise be reused, and its counts and settings (fullgraph) would not be this test's.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from kiln.core.errors import TrainingError
from kiln.pipeline.config import load_config
from kiln.pipeline.runner import Runner
from kiln.pipeline.stage_list import STAGES
from kiln.stages.train import checkpoint as ckpt
from kiln.stages.train.compile import CompileCounts
from kiln.stages.train.config import TrainConfig
from kiln.stages.train.loop import train
from tests.stages.train.train_helpers import Crash, crash_at, max_diff, tiny_data, tiny_net, train_cfg


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch.compiler.reset()
    yield
    torch.compiler.reset()


@pytest.fixture
def no_disk_caches() -> Iterator[None]:
    """Compile for real: a graph found in inductor's on-disk caches would not reach a patched compiler."""
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        yield


def compiling(cfg: TrainConfig, setting: Any) -> TrainConfig:
    """``cfg`` with ``train.compile: setting``, validated (model_copy would keep a dict as a dict)."""
    return TrainConfig.model_validate({**cfg.model_dump(), "compile": setting})


def test_demo_trains_one_epoch_compiled(tmp_path: Path) -> None:
    cfg = load_config(None, {"train.epochs": 1, "train.compile": True, "train.plot": False})
    result = Runner(cfg, tmp_path, STAGES).run(stop="train")
    assert result.ok, result.error
    s = json.loads((tmp_path / "train" / "manifest.json").read_text())["summary"]
    c = s["compile"]
    assert c["compiled"] and c["fallback"] is None and c["mode"] == "default"
    # The full batches, the epoch's short last batch (automatic dynamic shapes) and evaluation: a few graphs,
    # each with its reason; no graph breaks in this CNN.
    assert 1 <= c["graphs"] <= 4 and c["graph_breaks"] == 0 and c["compile_s"] > 0
    assert len(c["recompile_reasons"]) <= c["recompiles"] <= 3
    assert s["val_accuracy"] > 0.5  # a real epoch of training (one eager epoch reaches ~0.9)
    weights = load_file(str(tmp_path / "train" / "model.safetensors"))
    assert not any(k.startswith(ckpt.COMPILED_PREFIX) for k in weights)


def test_compiled_equals_eager_with_accumulation_and_compiles_once(tmp_path: Path) -> None:
    """fp32: compiling changes float rounding only. 160 samples, batch 32 in 4 micro-batches of 8: no step
    after the first compiles anything, so the micro-steps and later steps run the same graph."""
    data = tiny_data(200)
    cfg = train_cfg(epochs=2, grad_accum_steps=4)
    eager = tiny_net()
    train(eager, data, cfg)

    graphs: list[int] = []  # graphs compiled so far in this run, after each step (the counters are process-wide)
    before = CompileCounts.now().graphs
    compiled = tiny_net()
    r = train(
        compiled, data, compiling(cfg, True), on_step=lambda step: graphs.append(CompileCounts.now().graphs - before)
    )
    assert len(graphs) == r.global_step == 10
    # Nothing compiled after step 1 but the evaluation graph, at the end of epoch 1 (after step 5).
    assert graphs == [1] * 5 + [2] * 5, graphs
    c = r.compile
    assert c is not None and c["compiled"] and c["graph_breaks"] == 0
    # one training graph, one evaluation graph (no_grad, no autocast): one recompile, for evaluation
    assert c["graphs"] == 2 and c["recompiles"] == 1 and "grad_mode" in c["recompile_reasons"][0]
    assert max_diff(eager, compiled) < 1e-5


def test_a_short_last_batch_runs_eagerly_and_full_batches_keep_the_static_graph() -> None:
    """160 samples in batches of 48: three full batches and a last one of 16, each epoch. The static training
    graph (48 rows) is the only training graph; the batch of 16 runs eagerly (no 'size mismatch' recompile,
    which with automatic dynamic shapes would have replaced the graph used by the later full batches).
    Evaluation runs in batches of 48: 40 validation rows, one call of another shape, eager too."""
    data = tiny_data(200)
    cfg = train_cfg(epochs=2, batch_size=48)
    r = train(tiny_net(), data, compiling(cfg, True))
    c = r.compile
    assert c is not None and c["compiled"] and c["dynamic"] is None
    assert c["graphs"] == 1 and c["recompiles"] == 0, c  # the training graph only: every other call was eager
    assert c["eager_calls"] == 2 + 2  # the short batch in each epoch, the 40-row evaluation after each epoch
    r = train(tiny_net(), data, compiling(cfg, {"dynamic": True}))
    assert r.compile is not None and r.compile["eager_calls"] == 0  # one dynamic graph takes every shape


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_compiled_amp_trains_and_skips_a_nan_step(precision: str) -> None:
    """bf16 autocast (FP32 LayerNorm patch traced through), fp16 with a GradScaler; a NaN batch is skipped."""
    data = tiny_data(200)
    data.train_x[5] = float("nan")
    model = tiny_net()
    r = train(model, data, train_cfg(epochs=2, precision=precision, optimizer="adamw", lr=0.01, compile=True))
    assert r.compile is not None and r.compile["compiled"]
    assert sum(m.nonfinite_steps + m.skipped_steps for m in r.history) >= 2  # the NaN batch, once per epoch
    assert r.history[-1].loss < r.history[0].loss
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_checkpoints_have_no_compile_prefix_and_resume_both_ways(tmp_path: Path) -> None:
    """A compiled run's last.pt resumes without compiling, an eager run's resumes compiled; both reach the
    uninterrupted eager run's weights up to float rounding."""
    data = tiny_data(200)
    cfg = train_cfg(epochs=3, optimizer="adamw", lr=0.01, checkpoint={"every_steps": 3, "resume": "auto"})
    ref = tiny_net()
    train(ref, data, cfg, ckpt_dir=tmp_path / "ref", run_key="k")

    for first, then in ((True, False), (False, True)):
        folder = tmp_path / f"compile-{first}-then-{then}"
        with pytest.raises(Crash):
            train(tiny_net(), data, compiling(cfg, first), ckpt_dir=folder, run_key="k", on_step=crash_at(8))
        state = ckpt.load_state(folder / ckpt.LAST)
        assert state["global_step"] == 6 and not any(k.startswith(ckpt.COMPILED_PREFIX) for k in state["model"])
        resumed = tiny_net(seed=99)
        r = train(resumed, data, compiling(cfg, then), ckpt_dir=folder, run_key="k")
        assert r.resumed_from == str(folder / ckpt.LAST) and r.global_step == 15
        assert (r.compile is not None) == then
        assert max_diff(ref, resumed) < 1e-4, (first, then)
        assert not any(k.startswith(ckpt.COMPILED_PREFIX) for k in load_file(str(folder / ckpt.BEST)))


def test_a_checkpoint_saved_from_a_compiled_module_resumes(tmp_path: Path) -> None:
    """last.pt written by a script that saved torch.compile(model).state_dict(): keys with _orig_mod."""
    data, cfg = tiny_data(200), train_cfg(epochs=1, checkpoint={"resume": "auto"})
    first = tiny_net()
    train(first, data, cfg, ckpt_dir=tmp_path, run_key="k")
    state = ckpt.load_state(tmp_path / ckpt.LAST)
    state["model"] = {ckpt.COMPILED_PREFIX + k: v for k, v in state["model"].items()}
    assert set(state["model"]) == set(torch.compile(tiny_net()).state_dict())  # what such a script saves
    torch.save(state, tmp_path / "prefixed.pt")
    resumed = tiny_net(seed=5)
    r = train(resumed, data, train_cfg(epochs=1, checkpoint={"resume": str(tmp_path / "prefixed.pt")}))
    assert r.resumed_from == str(tmp_path / "prefixed.pt") and max_diff(first, resumed) == 0.0


def test_compile_is_not_part_of_the_run_key(tiny_config: Any) -> None:
    dump = tiny_config.dump()
    compiled = json.loads(json.dumps(dump))
    compiled["train"]["compile"] = {"mode": "max-autotune", "dynamic": True, "fullgraph": True}
    assert ckpt.run_key(dump) == ckpt.run_key(compiled)


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "torch.compile" in r.getMessage()
    ]


def test_torch_compile_raising_falls_back_to_eager_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("Dynamo is not supported on this Python")

    monkeypatch.setattr(torch, "compile", refuse)
    data, cfg = tiny_data(200), train_cfg(epochs=1)
    eager = tiny_net()
    train(eager, data, cfg)
    model = tiny_net()
    with caplog.at_level(logging.WARNING, logger="kiln.train"):
        r = train(model, data, compiling(cfg, True))
    assert r.compile is not None and not r.compile["compiled"]
    assert r.compile["fallback"] == "RuntimeError: Dynamo is not supported on this Python"
    assert len(_warnings(caplog)) == 1 and "continues in eager mode" in _warnings(caplog)[0]
    assert max_diff(eager, model) == 0.0  # the eager run, exactly

    with pytest.raises(TrainingError, match="fullgraph: true") as err:
        train(tiny_net(), data, compiling(cfg, {"fullgraph": True}))
    assert "Dynamo is not supported" in err.value.message and err.value.hint


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_backend_failure_falls_back_to_eager_with_one_warning(
    where: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, no_disk_caches: None
) -> None:
    """inductor fails compiling the forward graph (first call) or the backward graph (AOTAutograd compiles
    it lazily, in the first backward): the step is redone eagerly and training goes on without compiling."""
    import torch._inductor.compile_fx as cfx
    from torch._inductor.exc import InductorError

    real, inner = cfx.compile_fx, cfx.compile_fx_inner

    def failing_inner(gm: Any, example_inputs: Any, **kw: Any) -> Any:
        if kw.get("is_backward", False) == (where == "backward"):
            # what compile_fx_inner raises for any error inside inductor (a failed C++ build, a lowering, ...)
            raise InductorError(RuntimeError(f"simulated {where} compile failure"), None)
        return inner(gm, example_inputs, **kw)

    monkeypatch.setattr(cfx, "compile_fx", lambda gm, inputs, **kw: real(gm, inputs, inner_compile=failing_inner, **kw))
    data, cfg = tiny_data(200), train_cfg(epochs=2, optimizer="adamw", lr=0.01, precision="bf16")
    eager = tiny_net()
    want = train(eager, data, cfg)
    model = tiny_net()
    with caplog.at_level(logging.WARNING, logger="kiln.train"):
        r = train(model, data, compiling(cfg, True))
    assert r.compile is not None and not r.compile["compiled"]
    assert f"simulated {where} compile failure" in r.compile["fallback"]
    assert len(_warnings(caplog)) == 1
    assert r.global_step == want.global_step and max_diff(eager, model) == 0.0  # nothing half-applied

    torch.compiler.reset()
    with pytest.raises(TrainingError, match="fullgraph: true"):
        train(tiny_net(), data, compiling(cfg, {"fullgraph": True}))


class ItemBranch(nn.Module):
    """A data-dependent branch on a Python float (``.item()``): a graph break for torch.compile."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(64, 16), nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x.flatten(1)))
        if h.abs().max().item() > 1e6:  # never true here, but the value is only known at run time
            h = h / 2
        return self.b(h)


def test_graph_break_is_counted_or_stops_training_with_fullgraph() -> None:
    data = tiny_data(200)
    torch.manual_seed(0)
    r = train(ItemBranch(), data, train_cfg(epochs=1, compile=True))
    assert r.compile is not None and r.compile["compiled"] and r.compile["graph_breaks"] >= 1
    assert any("item()" in reason for reason in r.compile["graph_break_reasons"])

    torch.compiler.reset()
    with pytest.raises(TrainingError, match="could not compile the model as one graph") as err:
        train(ItemBranch(), data, train_cfg(epochs=1, compile={"fullgraph": True, "mode": "default"}))
    assert "test_train_compile.py" in err.value.message and "in forward: if h.abs().max().item()" in err.value.message
    assert "fullgraph: false" in err.value.hint


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compiled_fp16_on_one_gpu_skips_a_nan_step(mode: str) -> None:
    """CUDA: fp16 + GradScaler, fused AdamW, accumulation; reduce-overhead adds CUDA graphs. A NaN batch is
    skipped on the device (no host sync) and training goes on."""
    data = tiny_data(200)
    data.train_x[5] = float("nan")
    model = tiny_net()
    r = train(
        model,
        data,
        train_cfg(
            device="cuda",
            precision="fp16",
            optimizer="adamw",
            lr=0.01,
            epochs=3,
            grad_accum_steps=2,
            compile={"mode": mode},
        ),
    )
    assert r.compile is not None and r.compile["compiled"] and r.compile["fallback"] is None, r.compile
    assert sum(m.nonfinite_steps + m.skipped_steps for m in r.history) >= 3
    assert r.history[-1].loss < r.history[0].loss
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compiled_accumulation_on_one_gpu_equals_eager(mode: str) -> None:
    """fp32 on CUDA, 4 micro-batches per step. With CUDA graphs the first micro-step's gradients are outputs of
    the backward graph; were they installed as .grad, the next replay would overwrite them (an error, or on some
    releases wrong gradients). TF32 stays off, so only kernel rounding differs."""
    data = tiny_data(200)
    cfg = train_cfg(device="cuda", optimizer="adamw", lr=0.01, epochs=2, grad_accum_steps=4)
    eager = tiny_net()
    train(eager, data, cfg)
    compiled = tiny_net()
    r = train(compiled, data, compiling(cfg, {"mode": mode}))
    assert r.compile is not None and r.compile["compiled"] and r.compile["fallback"] is None, r.compile
    assert max_diff(eager, compiled) < 1e-4
