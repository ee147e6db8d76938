"""DDP on CPU: 2 gloo processes started by torchrun give the result of one process with the same global batch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kiln.core.errors import TrainingError
from kiln.pipeline.config import KilnConfig, config_from_dict
from kiln.pipeline.runner import settings_for
from kiln.pipeline.stage_list import stage_named
from kiln.stages.train.launch import run_torchrun, torchrun_command
from tests.stages.train.ddp_helpers import LOG, train_one_and_two

pytestmark = pytest.mark.slow  # torchrun: two processes per test


def _config(nproc: int, **train: Any) -> KilnConfig:
    return config_from_dict(
        {
            "seed": 1,
            "model": {"name": "transformer", "params": {"dim": 16, "heads": 2, "layers": 1}},  # LayerNorm, no BN
            "data": {"name": "synthetic", "params": {"size": 256}},  # 192 train samples: divisible by 2
            "train": {
                "epochs": 2,
                "batch_size": 32,
                "grad_accum_steps": 2,
                "precision": "fp32",
                "optimizer": "sgd",
                "lr": 0.05,
                "device": "cpu",
                "distributed": {"nproc_per_node": nproc},
                **train,
            },
        }
    )


def test_two_gloo_processes_equal_one_process(tmp_path: Path) -> None:
    r = train_one_and_two(tmp_path, _config)
    single, multi = r.single, r.multi

    assert r.weights_one.keys() == r.weights_two.keys()
    diff = r.max_weight_diff()
    assert diff < 1e-6, diff  # observed ~6e-8: float summation order only
    assert multi["world_size"] == 2 and single["world_size"] == 1
    assert multi["steps"] == single["steps"] == 12
    assert [m["loss"] for m in multi["epochs"]] == pytest.approx([m["loss"] for m in single["epochs"]], rel=1e-5)
    assert multi["val_accuracy"] == pytest.approx(single["val_accuracy"])
    # Only rank 0 wrote, and the folder looks like a one-process run's.
    assert sorted(p.name for p in r.two.iterdir()) == sorted(p.name for p in r.one.iterdir())
    assert (tmp_path / "ck2" / "last.pt").is_file()


def test_two_process_resume_mid_epoch_reports_the_epochs_loss(tmp_path: Path) -> None:
    """The running sums of a resumed epoch are saved over all processes, not rank 0's alone."""
    import json
    import subprocess
    import sys

    worker = Path(__file__).parent / "ddp_resume_worker.py"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(worker),
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads((tmp_path / "losses.json").read_text())
    assert got["resumed_from"] == str(tmp_path / "run" / "last.pt")
    assert got["resumed"] == pytest.approx(got["ref"], rel=1e-12)


def test_worker_error_reaches_the_user(tmp_path: Path) -> None:
    """A mistake only the workers can see (the run's length needs the data): said once, as the workers said it."""
    with pytest.raises(TrainingError, match="train.warmup_steps is 50 but the run has only 12 optimizer steps"):
        run_torchrun(_config(2, warmup_steps=50), tmp_path, tmp_path / "ck", LOG)


def test_torchrun_command_uses_torch_launcher(tmp_path: Path) -> None:
    cmd = torchrun_command(4, tmp_path / "c.json", tmp_path / "out", tmp_path / "ck")
    assert cmd[1:4] == ["-m", "torch.distributed.run", "--standalone"]
    assert "--nproc_per_node=4" in cmd and cmd[cmd.index("-m", 2) + 1] == "kiln.stages.train.worker"


def test_sync_batchnorm_on_cpu_is_a_clear_error() -> None:
    from kiln.models.registry import build_model
    from kiln.stages.train.config import DistributedConfig
    from kiln.stages.train.dist import DistEnv, wrap_ddp

    with pytest.raises(TrainingError, match="SyncBatchNorm is GPU-only"):
        wrap_ddp(build_model("cnn"), DistEnv(0, 2, 0), DistributedConfig(sync_batchnorm=True), torch.device("cpu"))


def test_fullgraph_compile_is_refused_under_ddp() -> None:
    """torch.compile of the DDP module breaks the graph in DDP's own forward: a clear error, before compiling. The
    module the loop compiles under torchrun, made in a one-process gloo group here (a worker's error reaching the
    user through torchrun: test_worker_error_reaches_the_user)."""
    import torch.distributed as dist
    from torch import nn

    from kiln.stages.train.compile import CompiledModel
    from kiln.stages.train.config import CompileConfig

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ddp = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
        with pytest.raises(TrainingError, match="fullgraph: true does not work with several processes") as err:
            CompiledModel(ddp, CompileConfig(fullgraph=True))
    finally:
        dist.destroy_process_group()
    assert "fullgraph: false" in (err.value.hint or "")


def _aux_head_settings(**distributed: Any) -> Any:
    """The train stage's settings of a 2-process run of a model with an output the loss does not read."""
    cfg = _config(2, epochs=1, distributed={"nproc_per_node": 2, **distributed})
    model = config_from_dict({"model": {"name": "tests.stages.train.train_helpers:aux_head"}}).model
    return settings_for(stage_named("train"), cfg.model_copy(update={"model": model}))


def test_a_parameter_without_gradient_names_it_and_the_fix(tmp_path: Path) -> None:
    """DDP's own error for it (a torchrun traceback) becomes one error with the setting that fixes it."""
    with pytest.raises(TrainingError, match=r"got no gradient from the loss \(aux.weight, aux.bias\)") as err:
        run_torchrun(_aux_head_settings(), tmp_path / "a", tmp_path / "ck_a", LOG)
    assert "find_unused_parameters: true" in (err.value.hint or "")
    summary = run_torchrun(_aux_head_settings(find_unused_parameters=True), tmp_path / "b", tmp_path / "ck_b", LOG)
    assert summary["world_size"] == 2


def test_ddp_error_for_unused_parameters_names_them() -> None:
    from kiln.stages.train.dist import unused_parameters_error
    from tests.stages.train.train_helpers import aux_head

    said = (
        "Expected to have finished reduction in the prior iteration before starting a new one. ...\\n"
        "Parameter indices which did not receive grad for rank 1: 2 3\\n In addition, ..."
    )
    err = unused_parameters_error(RuntimeError(said), aux_head())
    assert err is not None and "(aux.weight, aux.bias)" in err.message
    assert "train.distributed.find_unused_parameters: true" in (err.hint or "")
    assert unused_parameters_error(RuntimeError("CUDA out of memory"), aux_head()) is None
