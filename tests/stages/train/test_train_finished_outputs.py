"""A finished checkpoint whose stage outputs were never written gives them without training; once written, a run
asked for again with equal settings trains afresh."""

from __future__ import annotations

import json
from pathlib import Path

from kiln.stages.train import checkpoint as ckpt
from kiln.stages.train.declaration import TrainSummary
from kiln.stages.train.loop import train
from tests.stages.train.train_helpers import max_diff, tiny_data, tiny_net, train_cfg


def _staging(workdir: Path, hexpart: str) -> Path:
    """A staging folder named as the pipeline runner names the train stage's (core.ownership.temp_name)."""
    out = workdir / f".train.staging-1-{hexpart}"
    out.mkdir(parents=True)
    return out


def test_finished_run_stopped_before_its_outputs_is_taken_and_a_written_one_trains_again(tmp_path: Path) -> None:
    data, cfg = tiny_data(), train_cfg(epochs=2, checkpoint={"resume": "auto"})
    first = tiny_net()
    want = train(first, data, cfg, ckpt_dir=tmp_path / "ck", run_key="k", out_dir=_staging(tmp_path, "0000aaaa"))

    def rerun(hexpart: str, seed: int) -> tuple[object, list[int], object]:
        steps: list[int] = []
        model = tiny_net(seed=seed)
        out = _staging(tmp_path, hexpart)
        got = train(model, data, cfg, ckpt_dir=tmp_path / "ck", run_key="k", out_dir=out, on_step=steps.append)
        return got, steps, model

    got, steps, model = rerun("0000bbbb", seed=7)  # stopped before the runner made tmp_path/train
    assert steps == [] and got.resumed_from == str(tmp_path / "ck" / ckpt.LAST)
    assert max_diff(first, model) == 0.0 and [m.loss for m in got.history] == [m.loss for m in want.history]
    summary = TrainSummary.model_validate(got.summary()).model_dump(mode="json")
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "manifest.json").write_text(json.dumps({"summary": summary}))  # what the runner writes
    got, steps, _ = rerun("0000cccc", seed=0)  # its outputs are there: asked for again (forced), trained afresh
    assert len(steps) == want.global_step and got.resumed_from is None
