"""One training process of a torchrun job: ``python -m torch.distributed.run ... -m kiln.stages.train.worker``.

Every process trains its shard; rank 0 writes ``model.safetensors``, ``model.json``, ``loss.png`` and
``summary.json`` into ``--out``; a process that a user-fixable error stops writes ``error.json`` there.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

from kiln.core.artifacts import write_json_atomic
from kiln.core.data import DatasetSplits
from kiln.core.errors import KilnError, TrainingError
from kiln.pipeline.config import KilnConfig, load_config
from kiln.pipeline.fingerprints import splits_hash
from kiln.pipeline.runner import cache_key, load_dataset, settings_for
from kiln.stages.train.declaration import STAGE
from kiln.stages.train.dist import end_worker, env_from_torchrun
from kiln.stages.train.launch import ERROR, SUMMARY
from kiln.stages.train.stage import train_to, trained_from


def check_same_data(data: DatasetSplits, sources: dict[str, Any] | None, rank: int) -> None:
    """Each process calls the data function itself: one that returns other data on each call (random, unseeded)
    gives every rank other data, so the sampler's shards overlap and a random split leaks. The data's hash is
    compared with the one Kiln's own process keyed the stage with (``sources``: a user dataset's only)."""
    recorded = ((sources or {}).get("user_data") or {}).get("dataset")
    if recorded is None or splits_hash(data) == recorded:
        return
    raise TrainingError(
        f"the data function returned other data in training process {rank} than in Kiln's own call: each "
        "process calls it, and every rank must train on the same dataset",
        hint="make the data function deterministic: seed its randomness (numpy.random.default_rng(seed), "
        "torch.Generator().manual_seed(seed)) and read files in a fixed order",
    )


def own_sources(config: KilnConfig, data: DatasetSplits, out: Path) -> dict[str, Any] | None:
    """The code and data the run trains from, fingerprinted as the pipeline keys the stage (``trained_from``): a
    worker started by hand (no ``--sources``) then resumes only a checkpoint of the same code and data too. The
    data's hash is computed afresh, never one kept in a workdir (``data.skip_unchanged``)."""
    fresh = config.model_copy(update={"data": config.data.model_copy(update={"skip_unchanged": False})})
    return trained_from(cache_key(STAGE, fresh, out, dataset=lambda: data)[1])


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
        ckpt_dir = args.checkpoint_dir or args.out / "checkpoints"
        data = load_dataset(config)
        if args.sources is not None:  # Kiln's own launcher: what its process keyed the stage with
            sources = json.loads(args.sources.read_text())
            check_same_data(data, sources, env.rank)
        else:
            sources = own_sources(config, data, args.out)
        summary = train_to(args.out, settings, data, ckpt_dir, sources=sources)
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
