"""Run by torchrun (2 gloo processes) for test_train_ddp: an uninterrupted run, then a run that crashes mid
epoch 2, then its resume, all in one process group. Rank 0 writes the epoch losses of the first and last."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from train_helpers import tiny_data, tiny_net, train_cfg  # beside this script, which torchrun runs by its path

from kiln.stages.train.dist import end_worker, env_from_torchrun, process_group
from kiln.stages.train.loop import train


class Crash(Exception):
    pass


def crash_at_8(step: int) -> None:
    if step == 8:
        raise Crash


def main(out: Path) -> None:
    env = env_from_torchrun()
    cfg = train_cfg(epochs=3, optimizer="adamw", lr=0.01, checkpoint={"every_steps": 3, "resume": "auto"})
    data = tiny_data(200)  # 160 train samples, 80 per process: 5 steps per epoch, a checkpoint at step 6
    with process_group(env, cfg.distributed, torch.device("cpu")):
        ref = train(tiny_net(), data, cfg, env=env, ckpt_dir=out / "ref", run_key="k")
        try:
            train(tiny_net(), data, cfg, env=env, ckpt_dir=out / "run", run_key="k", on_step=crash_at_8)
        except Crash:
            pass
        resumed = train(tiny_net(), data, cfg, env=env, ckpt_dir=out / "run", run_key="k")
    if env.is_main:
        (out / "losses.json").write_text(
            json.dumps(
                {
                    "ref": [m.loss for m in ref.history],
                    "resumed": [m.loss for m in resumed.history],
                    "resumed_from": resumed.resumed_from,
                }
            )
        )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    end_worker(0)
