"""One training process of a torchrun job: ``python -m torch.distributed.run ... -m kiln.stages.train.worker``.

Every process trains its shard; rank 0 writes ``model.safetensors``, ``model.json``, ``loss.png`` and
``summary.json`` into ``--out``; a process that a user-fixable error stops writes ``error.json`` there.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from kiln.core.artifacts import write_json_atomic
from kiln.core.errors import KilnError
from kiln.pipeline.config import load_config
from kiln.pipeline.runner import load_dataset, settings_for
from kiln.stages.train.declaration import STAGE
from kiln.stages.train.dist import end_worker, env_from_torchrun
from kiln.stages.train.launch import ERROR, SUMMARY
from kiln.stages.train.stage import train_to


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kiln.stages.train.worker", description=__doc__)
    parser.add_argument("--config", required=True, help="Kiln config file (.yaml/.toml/.json)")
    parser.add_argument("--out", required=True, type=Path, help="folder for the trained weights (rank 0)")
    parser.add_argument(
        "--checkpoint-dir",
        type=Path,
        default=None,
        help="folder for last.pt/best.safetensors (shared by all nodes); default <out>/checkpoints",
    )
    parser.add_argument(
        "--sources", type=Path, default=None, help="JSON of the code and data the run trains from (resume check)"
    )
    args = parser.parse_args(argv)
    env = env_from_torchrun()
    logging.basicConfig(
        level=logging.INFO if env.is_main else logging.WARNING,
        format=f"[rank {env.rank}] %(levelname)s %(name)s: %(message)s",
    )
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        config = load_config(args.config)
        settings = settings_for(STAGE, config)
        sources = json.loads(args.sources.read_text()) if args.sources else None
        ckpt_dir = args.checkpoint_dir or args.out / "checkpoints"
        summary = train_to(args.out, settings, load_dataset(config), ckpt_dir, sources=sources)
    except KilnError as exc:
        # Every process that stops writes it (atomically; the same error on every rank for a config error): the
        # first process out ends the job, and torchrun stops the others before they could write theirs.
        write_json_atomic(args.out / ERROR, {"message": exc.message, "hint": exc.hint})
        logging.getLogger("kiln").error("%s", exc)
        return exc.exit_code
    if env.is_main:
        write_json_atomic(args.out / SUMMARY, summary.model_dump(mode="json"))
    return 0


if __name__ == "__main__":
    end_worker(main())
