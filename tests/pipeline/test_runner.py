"""The stage runner's rules (cache, reruns, resume, gates, damage), on small fake stages; the real pipeline's
cache keys, computed without running it. End-to-end runs of the real stages are in tests/e2e/."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from kiln.core.artifacts import hash_file
from kiln.core.errors import BuildError, GateFailure
from kiln.core.stage import Stage, StageSettings
from kiln.pipeline import runner as runner_module
from kiln.pipeline.config import KilnConfig, config_from_dict
from kiln.pipeline.runner import Runner, cache_key, gate_hint, settings_for, what_changed
from kiln.pipeline.stage_list import STAGES, stage_named
from tests.conftest import tiny_config_dict
from tests.pipeline.fake_stages import RAN, GatedSummary, ModelSettings, ValueSummary, fake_stages


def run(workdir: Path, stages: list[Stage] | None = None, **config: Any) -> Any:
    """The fake pipeline under ``config`` (dotted keys), with what each stage did."""
    RAN.clear()
    cfg = config_from_dict(tiny_config_dict(**{"seed": 1, "train.epochs": 2, "optimize.rounds": 1, **config}))
    return Runner(cfg, workdir, stages or fake_stages()).run()


def statuses(result: Any) -> dict[str, str]:
    return {r.name: r.status for r in result.records}


def test_a_first_run_runs_every_stage_and_a_rerun_none(tmp_path: Path) -> None:
    first = run(tmp_path)
    assert statuses(first) == {"first": "ran", "second": "ran", "third": "ran"} and first.ok
    assert [r.summary for r in first.records] == [
        ValueSummary(value=3),
        ValueSummary(value=4),
        GatedSummary(value=4, failures=[]),
    ]
    again = run(tmp_path)
    assert set(statuses(again).values()) == {"cached"} and not RAN
    assert again.records[2].summary == GatedSummary(value=4, failures=[])  # read back typed
    assert all(r.original_seconds is not None and r.seconds >= 0 for r in again.records)


def test_a_setting_reruns_the_stages_that_declare_it_and_those_after(tmp_path: Path) -> None:
    run(tmp_path)
    assert statuses(run(tmp_path, **{"optimize.rounds": 3})) == {"first": "cached", "second": "ran", "third": "ran"}
    # train.epochs is declared by first and third: second reruns only because its input changed
    assert statuses(run(tmp_path, **{"optimize.rounds": 3, "train.epochs": 4})) == dict.fromkeys(
        ("first", "second", "third"), "ran"
    )
    # a section none of them declares changes nothing
    assert set(
        statuses(run(tmp_path, **{"optimize.rounds": 3, "train.epochs": 4, "package.enabled": False})).values()
    ) == {"cached"}


def test_an_output_that_comes_out_the_same_does_not_rerun_what_follows(tmp_path: Path) -> None:
    run(tmp_path)
    result = run(tmp_path, **{"seed": 0, "train.epochs": 3})  # first's value is 3 again
    assert statuses(result) == {"first": "ran", "second": "cached", "third": "ran"}


def test_a_stage_s_notes_for_people_do_not_rerun_what_follows(tmp_path: Path) -> None:
    """train.plot toggled: the train stage reran and every later stage too, though the weights came out the same
    (loss.png is among its outputs). Its notes are left out of the later stages' keys."""
    stages = fake_stages()
    stages[0] = dataclasses.replace(stages[0], entry=f"{stages[0].entry}_with_a_plot", notes=("plot.txt",))
    run(tmp_path, stages)
    result = run(tmp_path, stages, **{"train.plot": False})
    assert statuses(result)["first"] == "ran" and statuses(result)["second"] == "cached"
    assert (tmp_path / "first" / "plot.txt").read_text() == "plot False"
    manifest = json.loads((tmp_path / "first" / "manifest.json").read_text())
    assert manifest["notes"] == ["plot.txt"] and "plot.txt" in manifest["outputs"]


def test_force_start_and_stop(tmp_path: Path) -> None:
    run(tmp_path)
    cfg = config_from_dict(tiny_config_dict(**{"seed": 1, "train.epochs": 2, "optimize.rounds": 1}))
    result = Runner(cfg, tmp_path, fake_stages()).run(force={"first"}, stop="second")
    assert statuses(result) == {"first": "ran", "second": "cached"}
    result = Runner(cfg, tmp_path, fake_stages()).run(start="second")
    assert statuses(result) == {"first": "cached", "second": "ran", "third": "ran"}


def test_a_failed_stage_keeps_earlier_work_and_a_rerun_resumes_after_it(tmp_path: Path) -> None:
    broken = "tests.pipeline.fake_stages:broken"
    stages = [dataclasses.replace(s, entry=broken) if s.name == "second" else s for s in fake_stages()]
    result = run(tmp_path, stages)
    assert isinstance(result.error, BuildError)
    assert statuses(result) == {"first": "ran", "second": "failed", "third": "not-run"}
    assert result.records[1].seconds > 0  # how long it ran before failing
    assert not (tmp_path / "second").exists()  # nothing half-written left as if it were finished
    assert statuses(run(tmp_path)) == {"first": "cached", "second": "ran", "third": "ran"}


def test_a_failed_gate_stops_the_run_with_the_failures_cached_or_not(tmp_path: Path) -> None:
    result = run(tmp_path, **{"train.epochs": 3})  # 1 + 3 + 1: odd
    assert isinstance(result.error, GateFailure) and "value 5 is odd" in result.error.message
    again = run(tmp_path, **{"train.epochs": 3})
    assert statuses(again)["third"] == "cached" and isinstance(again.error, GateFailure)
    assert "--force validate" in again.error.hint  # an earlier run's verdict: how to measure again


def _flip(path: Path, n: int = 4) -> None:
    data = bytearray(path.read_bytes())
    data[:n] = bytes(b ^ 0xFF for b in data[:n])  # same size: a size check cannot see it
    path.write_bytes(bytes(data))


def test_flipped_bytes_in_a_cached_stage_rerun_it(tmp_path: Path) -> None:
    run(tmp_path)
    _flip(tmp_path / "second" / "value.txt", 1)
    result = run(tmp_path)
    assert statuses(result) == {"first": "cached", "second": "ran", "third": "cached"}
    manifest = json.loads((tmp_path / "second" / "manifest.json").read_text())
    assert hash_file(tmp_path / "second" / "value.txt") == manifest["outputs"]["value.txt"]


def test_a_rerun_never_deletes_a_file_a_user_put_in_a_stage_folder(tmp_path: Path) -> None:
    """A stage reruns by replacing its folder whole: a file of the user's there (an ensemble added to the Triton
    repository) stops the rerun, named, and stays; Kiln's own leftovers and Python's caches do not stop it."""
    run(tmp_path)
    (tmp_path / "second" / "__pycache__").mkdir()
    (tmp_path / "second" / "__pycache__" / "app.cpython-311.pyc").write_bytes(b"")
    (tmp_path / "second" / ".value.txt.tmp-999999-0123abcd.tmp").write_bytes(b"")
    (tmp_path / "second" / ".DS_Store").write_bytes(b"")  # a file browser's
    assert statuses(run(tmp_path, **{"train.epochs": 3})) == {"first": "ran", "second": "ran", "third": "ran"}
    mine = tmp_path / "second" / "mine" / "config.pbtxt"
    mine.parent.mkdir()
    mine.write_text("name: 'mine'")
    result = run(tmp_path, **{"train.epochs": 4})
    assert statuses(result) == {"first": "ran", "second": "failed", "third": "not-run"}
    assert "second/mine/config.pbtxt is not a file Kiln wrote" in str(result.error)
    assert "move your files out of" in (result.error.hint or "") and mine.read_text() == "name: 'mine'"


def test_a_first_run_never_deletes_a_file_in_a_stage_folder_it_has_not_written(tmp_path: Path) -> None:
    """A folder named like a stage that no run finished (no manifest) holds someone else's files: the stage stops,
    naming one, and the file stays; an empty folder, or one with Kiln's leftovers only, is simply replaced."""
    (tmp_path / "second").mkdir(parents=True)
    (tmp_path / "second" / ".value.txt.tmp-999999-0123abcd.tmp").write_bytes(b"")
    assert statuses(run(tmp_path)) == {"first": "ran", "second": "ran", "third": "ran"}
    mine = tmp_path / "fresh" / "third" / "my_ensemble" / "config.pbtxt"
    mine.parent.mkdir(parents=True)
    mine.write_text("name: 'mine'")
    result = run(tmp_path / "fresh")
    assert statuses(result) == {"first": "ran", "second": "ran", "third": "failed"}
    assert "third/my_ensemble/config.pbtxt is not a file Kiln wrote (the folder has no manifest.json)" in str(
        result.error
    )
    assert "if they are all Kiln's, delete the folder" in (result.error.hint or "")
    assert mine.read_text() == "name: 'mine'"


@pytest.mark.parametrize("damage", ["garbage", "wrong-kind", "folder", "empty-outputs", "other-summary"])
def test_a_damaged_manifest_means_the_stage_is_redone(tmp_path: Path, damage: str) -> None:
    run(tmp_path)
    m = tmp_path / "second" / "manifest.json"
    if damage == "garbage":
        m.write_bytes(b"\x00\xff{not json")
    elif damage == "wrong-kind":
        m.write_text("[1, 2, 3]")
    elif damage == "folder":
        m.unlink()
        m.mkdir()
    else:
        data = json.loads(m.read_text())
        if damage == "empty-outputs":
            data["outputs"], data["sizes"] = {}, {}
        else:  # a summary this version's record does not describe (another Kiln wrote it)
            data["summary"] = {"value": "four", "extra": 1}
        m.write_text(json.dumps(data))
    assert statuses(run(tmp_path))["second"] == "ran"


def test_a_missing_upstream_is_named(tmp_path: Path) -> None:
    run(tmp_path)
    (tmp_path / "first" / "value.txt").unlink()
    cfg = config_from_dict(tiny_config_dict(**{"seed": 1, "train.epochs": 2, "optimize.rounds": 1}))
    result = Runner(cfg, tmp_path, fake_stages()[1:]).run()
    assert "needs the output of ['first']" in result.error.message and "--from first" in result.error.hint


def four_stages() -> list[Stage]:
    """first -> second -> third -> fourth: a stage whose input is current but made from a stale one."""
    stages = fake_stages()
    return [*stages, dataclasses.replace(stages[1], name="fourth", inputs=("third",))]


def only(workdir: Path, names: list[str], stages: list[Stage] | None = None, **config: Any) -> Any:
    """What `kiln <stage>` does: those stages alone, forced, from what the workdir holds."""
    RAN.clear()
    cfg = config_from_dict(tiny_config_dict(**{"seed": 1, "train.epochs": 2, "optimize.rounds": 1, **config}))
    chosen = [s for s in stages or fake_stages() if s.name in names]
    return Runner(cfg, workdir, chosen).run(force=set(names))


def test_a_stage_whose_input_is_from_before_its_own_upstream_stops_before_it_runs(tmp_path: Path) -> None:
    """`kiln train` and `kiln export` anew, then `kiln validate`: the engines are from the old export, and validate
    would blame them for not matching the new model. It stops, naming what is out of date and since what."""
    run(tmp_path)
    assert only(tmp_path, ["first"], **{"train.epochs": 4}).ok  # first made anew: second is from the old one
    result = only(tmp_path, ["third"], **{"train.epochs": 4})
    assert statuses(result) == {"third": "failed"} and not RAN
    assert (
        result.error.message == "second is out of date: first was made anew since second ran (stage 'third' reads it)"
    )
    assert "`kiln run` (or `kiln run --from second`)" in result.error.hint and "what follows first" in result.error.hint
    # a whole run redoes second itself, and does not stop
    assert statuses(run(tmp_path, **{"train.epochs": 4})) == {"first": "cached", "second": "ran", "third": "ran"}
    assert only(tmp_path, ["third"], **{"train.epochs": 4}).ok


def test_a_stage_made_from_an_out_of_date_one_is_out_of_date_too(tmp_path: Path) -> None:
    """fourth reads third, whose recorded input (second) is unchanged; but second is from before first was made
    anew: third holds results of the old first, so fourth stops too, with the stage to redo from."""
    stages = four_stages()
    run(tmp_path, stages)
    assert only(tmp_path, ["first"], stages, **{"train.epochs": 4}).ok
    result = only(tmp_path, ["fourth"], stages, **{"train.epochs": 4})
    assert not RAN and result.error.message == (
        "third is out of date: it was made from second's output, and first was made anew since second ran "
        "(stage 'fourth' reads it)"
    )
    assert "--from second" in result.error.hint
    # --from and --force run the stages before, so they never stop here
    cfg = config_from_dict(tiny_config_dict(**{"seed": 1, "train.epochs": 4, "optimize.rounds": 1}))
    result = Runner(cfg, tmp_path, stages).run(start="fourth")
    assert result.ok and statuses(result) == {"first": "cached", "second": "ran", "third": "ran", "fourth": "ran"}
    run(tmp_path, stages)  # back to 2 epochs
    assert only(tmp_path, ["first"], stages, **{"train.epochs": 4}).ok
    result = Runner(cfg, tmp_path, stages).run(force={"third"})
    assert result.ok and statuses(result) == {"first": "cached", "second": "ran", "third": "ran", "fourth": "ran"}


def test_a_stage_rerun_on_current_inputs_is_not_stopped(tmp_path: Path) -> None:
    """`kiln validate` on current engines, then `kiln package`: each reads what the stage before made from the
    current outputs, although they differ from the last whole run's."""
    run(tmp_path)
    assert only(tmp_path, ["second"]).ok and RAN == {"second": 1}  # the same output again
    assert only(tmp_path, ["third"]).ok and RAN == {"third": 1}
    changed = only(tmp_path, ["second"], **{"optimize.rounds": 3})  # another output: third's record is now old
    assert changed.ok and changed.records[0].summary == ValueSummary(value=6)
    assert only(tmp_path, ["third"], **{"optimize.rounds": 3}).ok and RAN == {"third": 1}


def test_content_is_hashed_once_per_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run(tmp_path)
    seen: list[Path] = []
    real = runner_module.hash_tree

    def counting(root: Path, exclude: tuple[str, ...] = ()) -> dict[str, str]:
        seen.append(Path(root))
        return real(root, exclude)

    monkeypatch.setattr(runner_module, "hash_tree", counting)
    assert set(statuses(run(tmp_path)).values()) == {"cached"}
    assert len(seen) == len(set(seen)) == 3


def test_editing_user_model_code_reruns_the_stages_that_declare_the_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib
    import sys

    (tmp_path / "src").mkdir()
    module = tmp_path / "src" / "my_models.py"
    module.write_text("def build():\n    return 4\n")
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    stages = [
        *fake_stages(),
        Stage("model", "tests.pipeline.fake_stages:modelled", (), ModelSettings, ValueSummary, (), lambda s: {}),
    ]
    options = {"model.name": "my_models:build", "model.params": {}}
    run(tmp_path / "wd", stages, **options)
    module.write_text("def build():\n    return 6\n")
    sys.modules.pop("my_models", None)
    importlib.invalidate_caches()
    result = run(tmp_path / "wd", stages, **options)
    assert statuses(result) == {"first": "cached", "second": "cached", "third": "cached", "model": "ran"}


def test_a_rerun_names_only_what_changed_with_integer_keys_in_the_config(tmp_path: Path) -> None:
    """Dynamic axes are keyed by integers, which the manifest keeps as JSON strings: not a change."""
    axes = {"signature.dynamic_axes": {"input": {1: "seq"}}}
    cfg = config_from_dict(tiny_config_dict(**axes))
    cfg2 = config_from_dict(tiny_config_dict(**axes, **{"train.epochs": 5}))
    _, old = cache_key(stage_named("train"), cfg, tmp_path)
    _, new = cache_key(stage_named("train"), cfg2, tmp_path)
    stored = json.loads(json.dumps(old))  # as read back from the manifest
    assert what_changed(stored, new) == ["config.train"]


def test_a_rerun_says_what_changed() -> None:
    old = {"code": "a", "config": {"train": 1, "data": 2}, "user_data": {"dataset": "x"}}
    new = {"code": "a", "config": {"train": 1, "data": 3}, "user_data": {"dataset": "y"}, "user_code": {"m:f": "z"}}
    assert what_changed(old, new) == ["config.data", "user_code", "user_data.dataset"]
    assert what_changed(old, old) == []


# ---------------------------------------------------------------------------------- the real stages' settings
SECTIONS = [(f.alias or name) for name, f in KilnConfig.model_fields.items()]


@pytest.mark.parametrize("stage", STAGES, ids=lambda s: s.name)
def test_a_stage_sees_the_settings_it_declares_and_nothing_else(stage: Stage) -> None:
    settings = settings_for(stage, config_from_dict({}))
    assert isinstance(settings, StageSettings)
    signature = getattr(settings, "signature", None)
    if signature is not None:  # a view of the shared record: the keys it declared, no others
        keys = [k.split(".")[1] for k in stage.settings.keys() if k.startswith("signature.")]
        for key in set(type(signature).model_fields) - set(keys or type(signature).model_fields):
            with pytest.raises(AttributeError):
                getattr(signature, key)
    declared = {key.split(".")[0] for key in stage.settings.keys()}
    for section in set(SECTIONS) - declared:
        with pytest.raises(AttributeError):
            getattr(settings, section)


def test_a_stage_entry_is_module_colon_function() -> None:
    with pytest.raises(TypeError, match="entry must be 'module:function'"):
        Stage("x", "tests.pipeline.fake_stages.modelled", (), ModelSettings, ValueSummary, (), lambda s: {})


def test_a_stage_that_reads_the_dataset_must_declare_what_makes_it() -> None:
    with pytest.raises(TypeError, match="reads the dataset"):
        Stage(
            "x",
            "tests.pipeline.fake_stages:modelled",
            (),
            ModelSettings,
            ValueSummary,
            (),
            lambda s: {},
            data=("dataset",),
        )


def _keys(tmp_path: Path, **overrides: Any) -> dict[str, str]:
    cfg = config_from_dict(tiny_config_dict(**overrides))
    return {s.name: cache_key(s, cfg, tmp_path)[0] for s in STAGES}


@pytest.mark.parametrize(
    "override, stages",
    [
        # build sizes engine profiles / autotuned shapes from the largest batch size
        # ...and precision judges variants at the batch sizes validation will
        ({"signature.batch_sizes": [1, 64]}, {"precision", "build", "validate"}),
        # the default dataset (and so calibration data, parity data, held-out data) follows model.name; build reads
        # the model section too (the torch backend compiles the trained model)
        ({"model.name": "transformer", "model.params": {}}, {"train", "export", "precision", "build", "validate"}),
        # built-in datasets are split by seed
        ({"seed": 1}, {"train", "export", "precision", "validate"}),
        # the gates are the precision stage's too where a variant it makes is held to them (a variant is accepted by
        # the check its engines face); the FP32 variant, the only one made here, is held to none there
        # (tests/stages/precision/test_declaration.py: the variants that are)...
        ({"validate.gates.min_cosine": 0.5}, {"validate"}),
        ({"validate.gates.per_precision": {"int8": {"min_cosine": 0.5}}}, {"validate"}),
        # ...while timing is validation's alone
        ({"validate.iterations": 7}, {"validate"}),
        ({"package.max_batch_size": 8}, {"package"}),
    ],
)
def test_the_real_stages_keys_cover_what_each_reads(tmp_path: Path, override: dict, stages: set[str]) -> None:
    before, after = _keys(tmp_path), _keys(tmp_path, **override)
    assert {name for name in before if before[name] != after[name]} == stages


@pytest.mark.parametrize(
    "key, function, stages",
    [
        ("train.loss", "def loss(outputs, targets):\n    return outputs.sum() * {}\n", {"train"}),
        # the metric judges variants in precision as it judges engines in validate
        ("validate.metric", "def metric(outputs, targets):\n    return float({})\n", {"precision", "validate"}),
    ],
)
def test_editing_a_users_loss_or_metric_reruns_the_stages_that_use_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, key: str, function: str, stages: set[str]
) -> None:
    import importlib
    import sys

    name = f"my_{key.replace('.', '_')}"
    module = tmp_path / f"{name}.py"
    monkeypatch.syspath_prepend(str(tmp_path))
    keys = []
    for version in (1, 2):
        module.write_text(function.format(version))
        sys.modules.pop(name, None)
        importlib.invalidate_caches()
        keys.append(_keys(tmp_path, **{key: f"{name}:{function.split()[1].split('(')[0]}"}))
    assert {stage for stage in keys[0] if keys[0][stage] != keys[1][stage]} == stages


def test_the_build_key_follows_the_cpu_int8_kernels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ORT CPU INT8 engines built where the fast INT8 kernels saturate hold uint8 weights (kiln.core.cpu_int8): a
    workdir moved to or from such a CPU rebuilds its engines, and reuses every other stage."""
    monkeypatch.setattr("kiln.core.cpu_int8.this_cpu_saturates", lambda: False)
    fast = _keys(tmp_path)
    monkeypatch.setattr("kiln.core.cpu_int8.this_cpu_saturates", lambda: True)
    exact = _keys(tmp_path)
    assert {name for name in fast if fast[name] != exact[name]} == {"build"}


def test_code_versions_cover_what_stages_run() -> None:
    # validate runs engines through kiln.stages.engines's runners; train builds models from the zoo.
    assert "kiln.stages.engines" in stage_named("validate").code and "kiln.models" in stage_named("train").code
    assert "kiln.models" in stage_named("export").code and "kiln.models" in stage_named("validate").code


def test_the_gates_fix_line_fits_the_failure() -> None:
    """Relaxing a gate is advice for a number that missed it; with no engine this machine can run, it is not."""
    none = "no engine could be validated on this machine (built for other devices: tensorrt-fp16)"
    assert "`kiln validate` there" in gate_hint([none], "ran") and "relax" not in gate_hint([none], "ran")
    missed = ["onnxruntime-cpu-int8: cosine 0.99 < 0.999"]
    assert "relax validate.gates" in gate_hint(missed, "ran") and "--force validate" not in gate_hint(missed, "ran")
    assert "--force validate" in gate_hint([*missed, none], "cached")


def test_the_thread_message_waits_for_the_first_stage_that_lowers_the_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An idle machine at the first stage, a busy one at a later stage: the later stage's lowering is said (at
    info), not swallowed as already said."""
    import logging
    import os

    import torch

    from kiln.core import threads

    loads = iter([0.0] + [9.0] * 20)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda _: {0, 1})
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (next(loads),) * 3)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with caplog.at_level(logging.INFO, "kiln"):
            assert run(tmp_path).ok
    finally:
        torch.set_num_threads(before)
        monkeypatch.setattr(threads.os, "getloadavg", os.getloadavg)
    said = [r for r in caplog.records if "busy machine" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.INFO]


@pytest.mark.slow  # a whole run, three stage commands and a second run: about 10 s on 2 cores
def test_validate_after_train_and_export_anew_stops_until_the_engines_are_rebuilt(tmp_path: Path, write_yaml) -> None:
    """The tester's steps: after `kiln run`, `kiln train` and `kiln export` with another setting, then `kiln validate`.
    It stopped with failed gates ("relax the gates") on engines built from the old export; now it says the build is
    out of date, and after `kiln run` validate and package run on the current engines."""
    from click.testing import CliRunner

    from kiln.cli import main

    cli, wd, config = CliRunner(), str(tmp_path / "w"), str(write_yaml(tiny_config_dict()))
    assert cli.invoke(main, ["run", config, "-w", wd, "-q"]).exit_code == 0
    verdict = (Path(wd) / "validate" / "manifest.json").read_text()
    anew = ["-w", wd, "-q", "--set", "train.epochs=3"]
    for command in ("train", "export"):
        assert cli.invoke(main, [command, config, *anew]).exit_code == 0
    result = cli.invoke(main, ["validate", "-c", config, *anew])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert "build is out of date: train and export were made anew since build ran" in result.output
    assert "`kiln run` (or `kiln run --from optimize`)" in result.output and "relax" not in result.output
    assert (Path(wd) / "validate" / "manifest.json").read_text() == verdict  # the old verdict left alone
    assert cli.invoke(main, ["run", config, *anew]).exit_code == 0
    for command in (["validate", "-c", config], ["package", config]):
        result = cli.invoke(main, [*command, *anew])
        assert result.exit_code == 0, result.output


def modelled_stages() -> list[Stage]:
    """model -> second: an upstream stage that builds the model (as train does), and one that reads it."""
    first = Stage("model", "tests.pipeline.fake_stages:modelled", (), ModelSettings, ValueSummary, (), lambda s: {})
    return [first, dataclasses.replace(fake_stages()[1], inputs=("model",))]


def alone(workdir: Path, name: str, stages: list[Stage], **config: Any) -> Any:
    """`kiln <name>`: that stage alone, forced, knowing the whole pipeline's stages (as the CLI does)."""
    RAN.clear()
    cfg = config_from_dict(tiny_config_dict(**{"seed": 1, "train.epochs": 2, "optimize.rounds": 1, **config}))
    return Runner(cfg, workdir, [s for s in stages if s.name == name], upstream=stages).run(force={name})


def test_a_stage_alone_stops_where_its_upstream_was_made_for_another_model(tmp_path: Path) -> None:
    """`kiln train`, the model's settings changed, then `kiln export`: the export would build the new model and
    load weights trained for the old one. It stops, saying the model changed; a whole run does not stop."""
    stages = modelled_stages()
    run(tmp_path, stages)
    result = alone(tmp_path, "second", stages, **{"model.params": {"width": 8}})
    assert statuses(result) == {"second": "failed"} and not RAN
    assert result.error.message.startswith("model is out of date: the model changed since it ran (model")
    assert "kiln model" in result.error.hint
    assert alone(tmp_path, "second", stages).ok  # the model it was made with: current


def test_a_stage_alone_warns_where_its_upstream_had_other_settings(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`kiln first --set train.epochs=4`, then `kiln second` without it: second reads the 4-epoch output, which
    this config would not make. It runs, and the log says which settings differ."""
    stages = fake_stages()
    run(tmp_path, stages)
    assert alone(tmp_path, "first", stages, **{"train.epochs": 4}).ok
    with caplog.at_level("WARNING", logger="kiln"):
        result = alone(tmp_path, "second", stages)
    assert result.ok and statuses(result) == {"second": "ran"}
    assert "first was made with other settings than this command's (train differ)" in caplog.text


def test_a_stage_alone_warns_where_a_stage_further_up_had_other_settings(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`kiln run --set train.epochs=4`, then `kiln third` without it: third reads second's output, which was made
    from first's 4-epoch one (`kiln validate` reads build's engines, made from precision's variants of other
    gates). The stage read directly has the same settings; the one further up is said."""
    stages = fake_stages()
    run(tmp_path, stages, **{"train.epochs": 4})
    with caplog.at_level("WARNING", logger="kiln"):
        result = alone(tmp_path, "third", stages)
    assert result.ok
    assert "first was made with other settings than this command's (train differ)" in caplog.text, caplog.text


def test_a_stage_alone_warns_where_the_users_code_changed_since_its_upstream_ran(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The code hash covers the model's whole module: an edited data function in it changes the hash as an edited
    model does, and only the user knows which it was. A warning, not a stop (which refused legitimate runs)."""
    (tmp_path / "mine.py").write_text(
        "import torch\n\ndef make():\n    return torch.nn.Linear(2, 2)\n\n\ndef data():\n    return 1\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    stages, work = modelled_stages(), tmp_path / "w"
    assert alone(work, "model", stages, **{"model.name": "mine:make"}).ok
    (tmp_path / "mine.py").write_text((tmp_path / "mine.py").read_text().replace("return 1", "return 2"))
    with caplog.at_level("WARNING", logger="kiln"):
        result = alone(work, "second", stages, **{"model.name": "mine:make"})
    assert result.ok and statuses(result) == {"second": "ran"}
    assert "model ran before your code changed (mine:make)" in caplog.text


def test_an_edited_user_module_is_said_as_the_module_not_the_functions_named_in_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The user code's hash covers the module named and the local modules it imports: a function appended to it
    reruns the stage, and the rerun names that module and what the config takes from it, not those functions as if
    they had changed."""
    import importlib
    import sys

    from kiln.models.config import DataConfig, ModelConfig

    @dataclasses.dataclass(frozen=True)
    class ModelAndData(StageSettings):
        model: ModelConfig
        data: DataConfig

    module = tmp_path / "mine.py"
    module.write_text("def make():\n    return 1\n\n\ndef data():\n    return 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    stage = Stage("model", "tests.pipeline.fake_stages:modelled", (), ModelAndData, ValueSummary, (), lambda s: {})
    options = {"model.name": "mine:make", "model.params": {}, "data.name": "mine:data"}
    run(tmp_path / "wd", [stage], **options)
    module.write_text(module.read_text() + "\n\ndef unrelated():\n    return 3\n")
    sys.modules.pop("mine", None)
    importlib.invalidate_caches()
    (record,) = run(tmp_path / "wd", [stage], **options).records
    assert record.status == "ran" and record.changed == [
        "module mine (the module of model 'mine:make' and data 'mine:data', or a local module it imports)"
    ]


CHECKED: list[str] = []


def refuse_odd_epochs(settings: Any) -> None:
    """A stage check (Stage.checks) for the fake third stage: odd train.epochs is a config error."""
    from kiln.core.errors import ConfigError

    CHECKED.append("third")
    if settings.train.epochs % 2:
        raise ConfigError("train.epochs is odd", hint="set an even train.epochs")


def test_a_later_stages_checks_run_before_the_first_stage_does_work_and_not_on_a_cached_run(tmp_path: Path) -> None:
    """A mistake in the last stage's settings fails the run before the first stage runs; a fully cached run
    runs no check (nor imports what they name), and a run that stops before the checked stage runs none."""
    stages = fake_stages()
    stages[2] = dataclasses.replace(stages[2], checks=(f"{__name__}:refuse_odd_epochs",))
    CHECKED.clear()
    failed = run(tmp_path, stages, **{"train.epochs": 3})
    assert statuses(failed)["first"] == "failed" and not RAN and "train.epochs is odd" in str(failed.error)
    assert CHECKED == ["third"] and not (tmp_path / "first").exists()
    assert run(tmp_path, stages).ok and CHECKED == ["third", "third"]  # checked once a run
    assert run(tmp_path, stages).ok and CHECKED == ["third", "third"]  # all cached: no check
    RAN.clear()
    Runner(config_from_dict(tiny_config_dict(seed=2)), tmp_path, stages).run(stop="second")
    assert CHECKED == ["third", "third"] and RAN["first"] == 1


@pytest.mark.parametrize(
    ("source", "said"),
    [
        ("def score(outputs, labels, scale):\n    return 1.0\n", "cannot be called as fn(outputs, labels)"),
        ("def scored(outputs, labels):\n    return 1.0\n", "'score' in module 'early_metric' is not defined"),
    ],
)
def test_a_metric_that_cannot_score_fails_the_run_before_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, said: str
) -> None:
    """validate.metric is first called after training and building: its import path and its call are checked
    before the train stage does any work."""
    (tmp_path / "early_metric.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, "early_metric", raising=False)
    cfg = config_from_dict(tiny_config_dict(**{"validate.metric": "early_metric:score"}))
    result = Runner(cfg, tmp_path / "wd", STAGES).run()
    assert statuses(result)["train"] == "failed" and said in str(result.error), result.error
    assert not (tmp_path / "wd" / "train").exists()
    if "called" in said:
        assert f"{tmp_path / 'early_metric.py'}:1" in str(result.error)  # the user's function, not Kiln's call


def test_a_fixed_batch_export_fails_the_run_before_training(tmp_path: Path) -> None:
    """export.dynamic_batch: false cannot run through the pipeline: the export stage's check says so before the
    train stage does any work, not after training."""
    cfg = config_from_dict(tiny_config_dict(**{"export.dynamic_batch": False}))
    result = Runner(cfg, tmp_path / "wd", STAGES).run()
    assert statuses(result)["train"] == "failed", result.error
    assert "export.dynamic_batch: false cannot run through the pipeline" in str(result.error)
    assert not (tmp_path / "wd" / "train").exists()


def test_shapes_for_an_axis_no_dynamic_axes_declare_fail_the_run_before_training(tmp_path: Path) -> None:
    """signature.shapes keyed by an axis signature.dynamic_axes does not declare: the export stage's check says so
    before the train stage does any work, not after the export."""
    cfg = config_from_dict(tiny_config_dict(**{"signature.shapes": {"frames": [8, 64]}}))
    result = Runner(cfg, tmp_path / "wd", STAGES).run()
    assert statuses(result)["train"] == "failed", result.error
    assert "signature.shapes names axes ['frames']; signature.dynamic_axes declares none" in str(result.error)
    assert not (tmp_path / "wd" / "train").exists()
