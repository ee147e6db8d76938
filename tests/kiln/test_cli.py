"""The CLI through click's CliRunner: help everywhere, exit codes, clean errors (no tracebacks)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import click
import pytest
import yaml
from click.testing import CliRunner

from kiln.cli import main
from tests.conftest import tiny_config_dict

COMMANDS = ["run", "config", "train", "export", "optimize", "precision", "build", "validate", "package"]


@pytest.fixture
def cli() -> CliRunner:
    return CliRunner()


def assert_clean_error(result, code: int, *needles: str) -> None:
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    for n in needles:
        assert n in result.output, result.output


@pytest.mark.parametrize("cmd", [None, *COMMANDS])
def test_help(cli: CliRunner, cmd: str | None) -> None:
    result = cli.invoke(main, [cmd, "--help"] if cmd else ["--help"])
    assert result.exit_code == 0 and "Usage" in result.output


def test_help_loads_no_config_schema_array_or_model_library() -> None:
    """`kiln --help` is a user's first wait: the CLI module loads without the config schema (pydantic), numpy, ONNX
    or torch, which each command imports when it runs."""
    code = "import sys, kiln.cli; print(sorted({'pydantic', 'numpy', 'onnx', 'torch'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_the_build_command_offers_the_registered_backends() -> None:
    from kiln.stages.engines import BACKEND_NAMES
    from kiln.stages.engines.registry import BACKENDS

    assert BACKEND_NAMES == tuple(sorted(BACKENDS))


def test_config_prints_resolved_yaml(cli: CliRunner) -> None:
    result = cli.invoke(main, ["config", "--set", "train.epochs=3"])
    data = yaml.safe_load(result.output)
    assert result.exit_code == 0 and data["train"]["epochs"] == 3 and "validate" in data


def test_bad_config_key(cli: CliRunner, write_yaml) -> None:
    result = cli.invoke(main, ["run", str(write_yaml({"train": {"epoch": 2}}))])
    assert_clean_error(result, 2, "unknown key 'train.epoch'", "fix:")


def test_missing_config_file(cli: CliRunner, tmp_path: Path) -> None:
    assert_clean_error(cli.invoke(main, ["run", str(tmp_path / "nope.yaml")]), 2, "config file not found")


def test_unknown_stage_name(cli: CliRunner, tmp_path: Path) -> None:
    result = cli.invoke(main, ["run", "--until", "deploy", "-w", str(tmp_path)])
    assert_clean_error(result, 2, "unknown stage 'deploy'", "package")


def test_stage_without_upstream_says_what_to_run(cli: CliRunner, tmp_path: Path) -> None:
    result = cli.invoke(main, ["build", "-w", str(tmp_path / "empty")])
    assert_clean_error(
        result, 2, "needs the output of ['train', 'export', 'precision'], not yet made", "kiln run --from train"
    )


def test_corrupt_onnx(cli: CliRunner, tmp_path: Path) -> None:
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x00not an onnx model at all")
    assert_clean_error(cli.invoke(main, ["build", str(bad), "-o", str(tmp_path / "e")]), 2, "not a readable ONNX model")


def test_missing_onnx(cli: CliRunner, tmp_path: Path) -> None:
    assert_clean_error(cli.invoke(main, ["optimize", str(tmp_path / "m.onnx")]), 2, "not found")


def test_run_then_stage_commands(cli: CliRunner, tmp_path: Path, write_yaml) -> None:
    cfg = str(write_yaml(tiny_config_dict()))
    wd = str(tmp_path / "wd")
    first = cli.invoke(main, ["run", cfg, "-w", wd, "--quiet"])
    assert first.exit_code == 0, first.output
    assert (Path(wd) / "package" / "triton").is_dir()
    again = cli.invoke(main, ["validate", "-c", cfg, "-w", wd, "--quiet"])
    assert again.exit_code == 0, again.output
    cached = cli.invoke(main, ["run", cfg, "-w", wd])  # CliRunner's terminal: 80 columns
    assert cached.exit_code == 0, cached.output
    assert "onnxruntime-cpu-fp32" in cached.output  # engine names readable, not folded to `onnxrunt...`
    assert "(ran in " in cached.output and "result: PASSED" in cached.output


def test_the_result_line_wraps_between_words_within_80_columns(monkeypatch) -> None:
    """A log or a pipe is 80 columns: the verdict naming engines that were not validated wraps between words."""
    import io
    from types import SimpleNamespace

    from rich.console import Console

    import kiln.cli
    import kiln.pipeline.report

    out = io.StringIO()
    monkeypatch.setattr(kiln.cli, "results", Console(file=out, width=80))
    names = [f"tensorrt-engine-{i}" for i in range(8)]
    verdict = "PASSED, 8 engines built but not validated: " + ", ".join(names)
    monkeypatch.setattr(kiln.pipeline.report, "result_line", lambda report: verdict)
    kiln.cli._print_summary(SimpleNamespace(records=[]), {"stages": {}}, Path("wd"))
    lines = out.getvalue().splitlines()
    assert len(lines) > 3 and all(len(line) <= 80 for line in lines), lines
    assert all(any(name in line for line in lines) for name in names)  # no name cut in two


def test_a_variant_its_gates_left_unmade_is_not_called_failed(monkeypatch) -> None:
    """A variant no fallback round got through its gates is an outcome of its check: "not made", not "failed" (the
    word for a variant whose build raised)."""
    import io
    from types import SimpleNamespace

    from rich.console import Console

    import kiln.cli
    import kiln.pipeline.report

    out = io.StringIO()
    monkeypatch.setattr(kiln.pipeline.report, "result_line", lambda report: "PASSED")
    monkeypatch.setattr(kiln.cli, "console", Console(file=out, width=200))
    monkeypatch.setattr(kiln.cli, "results", Console(file=io.StringIO(), width=200))
    failed = {"int8": "int8 not made: no fallback round passed the gates", "fp16": "fp16 conversion raised"}
    report = {"stages": {"precision": {"status": "ran", "seconds": 1.0, "summary": {"failed": failed}}}}
    ran = SimpleNamespace(name="precision", status="ran", seconds=1.0)
    kiln.cli._print_summary(SimpleNamespace(records=[ran]), report, Path("wd"))
    said = out.getvalue()
    assert "precision variant int8 not made, the others were built: int8 not made" in said, said
    assert "precision variant fp16 failed, the others were built" in said, said
    # a command that stopped before precision (kiln export) does not repeat an earlier run's outcome
    out.truncate(0)
    export = SimpleNamespace(name="export", status="ran", seconds=1.0)
    kiln.cli._print_summary(SimpleNamespace(records=[export]), report, Path("wd"))
    assert "precision variant" not in out.getvalue(), out.getvalue()


def test_the_summary_gives_the_runs_wall_time_beside_the_stage_rows(monkeypatch) -> None:
    """The stage rows leave out the cache checks (the first loads the data): the summary says the run's wall time and
    the part of it those checks took, under the table."""
    import io
    from types import SimpleNamespace

    from rich.console import Console

    import kiln.cli
    import kiln.pipeline.report

    out = io.StringIO()
    monkeypatch.setattr(kiln.pipeline.report, "result_line", lambda report: "PASSED")
    monkeypatch.setattr(kiln.cli, "results", Console(file=out, width=80))
    report = {"stages": {}, "wall_seconds": 12.345, "check_seconds": 1.5}
    kiln.cli._print_summary(SimpleNamespace(records=[]), report, Path("wd"))
    assert "12.35 s in all, 1.50 s of it checking which stages are cached" in out.getvalue()


def test_a_speedup_whose_interval_is_wide_is_given_as_the_interval() -> None:
    """A baseline whose rounds a busy machine split between two speeds (0.23 ms and 530 ms) makes a point speedup of
    thousands that says nothing: the summary gives the interval in its place."""
    import io
    from types import SimpleNamespace

    from rich.console import Console

    import kiln.cli

    def lat(p50: float) -> SimpleNamespace:
        return SimpleNamespace(p50=p50, ci95=None)

    def engine(name: str, speed: float, ci: tuple[float, float]) -> SimpleNamespace:
        return SimpleNamespace(
            name=name,
            status="validated",
            device="cpu",
            latency_ms={"1": lat(0.16)},
            speedup_vs_baseline={"1": speed},
            speedup_ci={"eager-cpu": {"1": ci}},
        )

    base = SimpleNamespace(latency_ms={"1": lat(530.0)}, backend="torch", label="eager-cpu")
    v = SimpleNamespace(
        baseline=base,
        baselines=[base],
        engines=[engine("wide", 3334.27, (1.45, 5927.0)), engine("narrow", 2.1, (1.9, 2.3))],
        chosen={},
        timing={"busy": True},
    )
    out = io.StringIO()
    Console(file=out, width=80).print(kiln.cli._latency_table(v))
    said = out.getvalue()
    assert "1.45-5927x vs cpu" in said and "3334" not in said, said
    assert "2.10x vs cpu" in said, said


def test_gate_failure_exit_code(cli: CliRunner, tmp_path: Path, write_yaml) -> None:
    cfg = str(write_yaml(tiny_config_dict(**{"validate.gates.max_latency_p50_ms": 1e-9})))
    result = cli.invoke(main, ["run", cfg, "-w", str(tmp_path / "wd"), "--quiet"])
    assert_clean_error(result, 3, "validation gates failed", "p50 latency")


class EigModel(__import__("torch").nn.Module):
    """A model no ONNX exporter can express (eigenvalues)."""

    def forward(self, x):
        import torch

        return torch.linalg.eigvals(x.reshape(-1, 8, 8)).real


def eig_model() -> EigModel:
    return EigModel()


def test_unsupported_op_in_model(cli: CliRunner, tmp_path: Path) -> None:
    result = cli.invoke(
        main,
        [
            "export",
            "--model",
            "tests.kiln.test_cli:eig_model",
            "--input-shape",
            "1,8,8",
            "-o",
            str(tmp_path / "m.onnx"),
        ],
    )
    assert_clean_error(result, 2, "torch.onnx.export failed", "eigvals")


def test_checkpoint_that_does_not_fit_the_model(cli: CliRunner, tmp_path: Path, write_yaml) -> None:
    import torch

    from kiln.models.registry import build_model

    ckpt = tmp_path / "w.pt"
    torch.save(build_model("cnn", {"width": 4}).state_dict(), ckpt)
    cfg = write_yaml({**tiny_config_dict(), "model": {"name": "cnn", "params": {"width": 8}, "checkpoint": str(ckpt)}})
    result = cli.invoke(main, ["run", str(cfg), "-w", str(tmp_path / "wd"), "--quiet"])
    assert_clean_error(result, 2, "does not fit model", "size mismatch")


def test_corrupt_checkpoint(cli: CliRunner, tmp_path: Path, write_yaml) -> None:
    ckpt = tmp_path / "w.safetensors"
    ckpt.write_bytes(b"garbage")
    cfg = write_yaml({**tiny_config_dict(), "model": {"name": "cnn", "checkpoint": str(ckpt)}})
    result = cli.invoke(main, ["run", str(cfg), "-w", str(tmp_path / "wd"), "--quiet"])
    assert_clean_error(result, 2, "cannot read checkpoint")


def test_missing_tensorrt_backend(cli: CliRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import kiln.stages.engines.tensorrt.lib as tensorrt_lib

    # Simulate a machine without any TensorRT package (CI has tensorrt_rtx installed).
    monkeypatch.setattr(tensorrt_lib, "import_tensorrt", lambda flavour=None: None)
    model = tmp_path / "m.onnx"
    exported = cli.invoke(main, ["export", "--model", "cnn", "-o", str(model)])
    assert exported.exit_code == 0, exported.output
    result = cli.invoke(
        main, ["build", str(model), "--backend", "tensorrt", "--device", "cuda", "-o", str(tmp_path / "e")]
    )
    assert_clean_error(result, 2, "TensorRT", "pip install")


def test_direct_export_build_validate(cli: CliRunner, tmp_path: Path) -> None:
    """The README's direct-file workflow: a user's checkpoint -> ONNX -> optimized -> engine -> validated."""
    import torch

    from kiln.models.registry import build_model

    ckpt = tmp_path / "w.pt"
    torch.save(build_model("cnn").state_dict(), ckpt)
    onnx_path, opt, engine = tmp_path / "m.onnx", tmp_path / "m.opt.onnx", tmp_path / "engine"
    for args in (
        ["export", "--model", "cnn", "--checkpoint", str(ckpt), "-o", str(onnx_path)],
        ["optimize", str(onnx_path), "-o", str(opt)],
        ["build", str(opt), "--backend", "onnxruntime", "-o", str(engine)],
        ["validate", str(engine), "--reference", str(onnx_path)],
        ["validate", str(engine), "--reference", str(ckpt), "--model", "cnn"],
    ):
        result = cli.invoke(main, args)
        assert result.exit_code == 0, (args, result.output)
    assert '"passed": true' in result.output


def test_direct_validate_against_wrong_model_fails_gate(cli: CliRunner, tmp_path: Path) -> None:
    import torch

    from kiln.models.registry import build_model

    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    torch.manual_seed(0)
    torch.save(build_model("cnn").state_dict(), a)
    torch.manual_seed(1)
    torch.save(build_model("cnn").state_dict(), b)
    assert (
        cli.invoke(main, ["export", "--model", "cnn", "--checkpoint", str(a), "-o", str(tmp_path / "a.onnx")]).exit_code
        == 0
    )
    assert cli.invoke(main, ["build", str(tmp_path / "a.onnx"), "-o", str(tmp_path / "e")]).exit_code == 0
    result = cli.invoke(main, ["validate", str(tmp_path / "e"), "--reference", str(b), "--model", "cnn"])
    assert_clean_error(result, 3, "failed its gates", "cosine")


def test_set_with_invalid_yaml_value(cli: CliRunner) -> None:
    # Before: a yaml ParserError traceback.
    result = cli.invoke(main, ["config", "--set", "signature.batch_sizes=[1,"])
    assert result.exit_code == 2 and "not valid YAML" in result.output and "Traceback" not in result.output


def test_direct_validate_with_bad_inputs_files(cli: CliRunner, tmp_path: Path) -> None:
    # Before: a .npy, a non-numpy file or misnamed arrays gave numpy/ONNX Runtime tracebacks.
    import numpy as np
    import torch

    from kiln.models.registry import build_model

    ckpt, onnx_path, engine = tmp_path / "w.pt", tmp_path / "m.onnx", tmp_path / "e"
    torch.save(build_model("cnn").state_dict(), ckpt)
    assert (
        cli.invoke(main, ["export", "--model", "cnn", "--checkpoint", str(ckpt), "-o", str(onnx_path)]).exit_code == 0
    )
    assert cli.invoke(main, ["build", str(onnx_path), "-o", str(engine)]).exit_code == 0
    x = np.zeros((2, 1, 8, 8), np.float32)
    np.save(tmp_path / "x.npy", x)
    np.savez(tmp_path / "wrong.npz", pixels=x)
    np.savez(tmp_path / "good.npz", input=x)
    (tmp_path / "junk.npz").write_text("not numpy")
    for name, needle in (
        ("x.npy", "bare array"),
        ("wrong.npz", "the engine takes ['input']"),
        ("junk.npz", "cannot read inputs"),
    ):
        result = cli.invoke(
            main, ["validate", str(engine), "--reference", str(onnx_path), "--inputs", str(tmp_path / name)]
        )
        assert_clean_error(result, 2, needle, "np.savez")
    result = cli.invoke(
        main, ["validate", str(engine), "--reference", str(onnx_path), "--inputs", str(tmp_path / "good.npz")]
    )
    assert result.exit_code == 0, result.output


def test_data_that_does_not_fit_the_model(cli: CliRunner, tmp_path: Path, write_yaml) -> None:
    cfg = write_yaml({**tiny_config_dict(), "data": {"name": "synthetic", "params": {"shape": [3, 16, 16]}}})
    result = cli.invoke(main, ["run", str(cfg), "-w", str(tmp_path / "wd"), "--quiet"])
    assert_clean_error(result, 2, "cannot take the dataset's input (2, 3, 16, 16)", "fix:")


def test_model_with_too_few_classes(cli: CliRunner, tmp_path: Path, write_yaml) -> None:
    cfg = write_yaml({**tiny_config_dict(), "model": {"name": "cnn", "params": {"width": 8, "num_classes": 3}}})
    result = cli.invoke(main, ["run", str(cfg), "-w", str(tmp_path / "wd"), "--quiet"])
    assert_clean_error(result, 2, "dataset has 10 classes", "num_classes")


def test_second_run_on_a_busy_workdir_is_refused(cli: CliRunner, tmp_path: Path) -> None:
    # Before: the second run's start-up cleanup deleted the first run's staging folders under it.
    import subprocess
    import sys

    staging = tmp_path / ".train.staging-other-run"
    staging.mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from pathlib import Path; from kiln.pipeline.workdir_lock import workdir_lock\n"
            f"with workdir_lock(Path({str(tmp_path)!r})):\n print('locked', flush=True); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        result = cli.invoke(main, ["run", "-w", str(tmp_path)])
        assert_clean_error(result, 2, "in use by another kiln run", f"pid {holder.pid}", "--workdir")
        assert staging.is_dir()
    finally:
        holder.communicate("")
    assert holder.returncode == 0


def _exported_engine(cli: CliRunner, tmp_path: Path) -> tuple[Path, Path, Path]:
    import torch

    from kiln.models.registry import build_model

    ckpt, onnx_path, engine = tmp_path / "w.pt", tmp_path / "m.onnx", tmp_path / "e"
    torch.save(build_model("cnn").state_dict(), ckpt)
    assert (
        cli.invoke(main, ["export", "--model", "cnn", "--checkpoint", str(ckpt), "-o", str(onnx_path)]).exit_code == 0
    )
    assert cli.invoke(main, ["build", str(onnx_path), "-o", str(engine)]).exit_code == 0
    return ckpt, onnx_path, engine


def test_direct_validate_inputs_of_the_wrong_shape_or_dtype(cli: CliRunner, tmp_path: Path) -> None:
    # Before: ONNX Runtime's InvalidArgument traceback.
    import numpy as np

    _, onnx_path, engine = _exported_engine(cli, tmp_path)
    np.savez(tmp_path / "shape.npz", input=np.zeros((4, 3, 8, 8), np.float32))
    np.savez(tmp_path / "dtype.npz", input=np.zeros((4, 1, 8, 8), np.float64))
    for name in ("shape.npz", "dtype.npz"):
        result = cli.invoke(
            main, ["validate", str(engine), "--reference", str(onnx_path), "--inputs", str(tmp_path / name)]
        )
        assert_clean_error(result, 2, "input 'input' in", "the engine takes float32[batch, 1, 8, 8]")


@pytest.mark.slow
def test_direct_export_takes_the_configs_checkpoint(cli: CliRunner, tmp_path: Path, write_yaml) -> None:
    """model.checkpoint in the config is the weights to export (it once exported random weights, exit 0)."""
    import numpy as np
    import onnxruntime as ort

    ckpt, explicit, _ = _exported_engine(cli, tmp_path)
    cfg = write_yaml({"model": {"name": "cnn", "checkpoint": str(ckpt)}})
    result = cli.invoke(main, ["export", "-c", str(cfg), "-o", str(tmp_path / "from_config.onnx")])
    assert result.exit_code == 0, result.output
    x = np.random.default_rng(0).random((4, 1, 8, 8), dtype=np.float32)
    run = lambda p: ort.InferenceSession(str(p)).run(None, {"input": x})[0]  # noqa: E731
    np.testing.assert_allclose(run(tmp_path / "from_config.onnx"), run(explicit), atol=1e-6)


def test_direct_export_in_a_trained_workdir_takes_its_trained_weights(
    cli: CliRunner, tmp_path: Path, write_yaml
) -> None:
    """`kiln export CFG -w out -o m.onnx` after `kiln run`: the train stage's weights, not the initial ones (it once
    exported initial weights, exit 0, with a warning); another model's training is left alone."""
    import numpy as np
    import onnxruntime as ort
    import torch
    from safetensors.torch import save_file

    from kiln.core.artifacts import write_json_atomic
    from kiln.models.registry import build_model

    torch.manual_seed(7)
    trained = build_model("cnn")
    (tmp_path / "wd" / "train").mkdir(parents=True)
    save_file(trained.state_dict(), str(tmp_path / "wd" / "train" / "model.safetensors"))
    recorded = {"config": {"model": {"name": "cnn", "params": {}, "checkpoint": None, "onnx": None}}}
    manifest = {"key": "k", "outputs": {}, "key_parts": recorded, "summary": {}}
    write_json_atomic(tmp_path / "wd" / "train" / "manifest.json", manifest)
    cfg = write_yaml({"model": {"name": "cnn"}})
    result = cli.invoke(main, ["export", str(cfg), "-w", str(tmp_path / "wd"), "-o", str(tmp_path / "m.onnx")])
    assert result.exit_code == 0, result.output
    assert "the trained ones in" in result.stderr and "initial weights" not in result.output
    x = np.random.default_rng(0).random((4, 1, 8, 8), dtype=np.float32)
    got = ort.InferenceSession(str(tmp_path / "m.onnx")).run(None, {"input": x})[0]
    with torch.no_grad():
        np.testing.assert_allclose(got, trained.eval()(torch.from_numpy(x)).numpy(), atol=1e-5)
    other = write_yaml({"model": {"name": "cnn", "params": {"width": 8}}})  # not the model the workdir trained
    result = cli.invoke(main, ["export", str(other), "-w", str(tmp_path / "wd"), "-o", str(tmp_path / "o.onnx")])
    assert result.exit_code == 0, result.output
    assert "the trained ones in" not in result.output and "initial weights" in result.output


@pytest.mark.parametrize(
    "args",
    [
        ["build", "--backend", "tensorrt"],
        ["build", "-o", "out"],
        ["validate", "--reference", "m.onnx"],
        ["optimize", "-o", "x.onnx"],
        ["export", "--input-shape", "1,8,8"],
    ],
)
def test_direct_mode_options_without_their_file_are_refused(cli: CliRunner, tmp_path: Path, args) -> None:
    """They used to be ignored silently: the stage ran inside the workdir instead, exit 0."""
    result = cli.invoke(main, [*args, "-w", str(tmp_path / "w")])
    assert result.exit_code == 2 and "direct-mode option" in result.output, result.output
    assert not (tmp_path / "w").exists()


def test_bad_input_shape_is_a_clean_error(cli: CliRunner, tmp_path: Path) -> None:
    result = cli.invoke(main, ["export", "--model", "cnn", "--input-shape=-1,8,8", "-o", str(tmp_path / "m.onnx")])
    assert_clean_error(result, 2, "positive integers")


def test_user_model_module_next_to_the_config(
    cli: CliRunner, tmp_path: Path, write_yaml, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`model.name: mymodels:build` with mymodels.py beside the config imports without PYTHONPATH; a typo or a
    broken module is a clean error (both were tracebacks)."""
    import sys

    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "kiln_t_models.py").write_text(
        "import torch\n\ndef build():\n    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))\n"
    )
    (folder / "kiln_t_broken.py").write_text("def build(:\n")
    cfg = folder / "cfg.yaml"
    cfg.write_text(
        yaml.safe_dump({"model": {"name": "kiln_t_models:build"}, "data": {"name": "digits"}, "train": {"epochs": 1}})
    )
    monkeypatch.setattr(sys, "path", list(sys.path))
    try:
        ok = cli.invoke(main, ["run", str(cfg), "-w", str(tmp_path / "w"), "--until", "train", "-q"])
        assert ok.exit_code == 0, ok.output
        for name, needle in (
            ("nosuch.mod:fn", "cannot import module 'nosuch.mod'"),
            ("kiln_t_broken:build", "SyntaxError"),
        ):
            bad = cli.invoke(
                main,
                ["run", str(cfg), "--set", f"model.name={name}", "-w", str(tmp_path / "w"), "--until", "train", "-q"],
            )
            assert_clean_error(bad, 2, needle)
    finally:
        for m in ("kiln_t_models", "kiln_t_broken"):
            sys.modules.pop(m, None)


def test_package_after_a_failed_gate_keeps_the_good_package_and_the_full_report(
    cli: CliRunner, tmp_path: Path, write_yaml
) -> None:
    """`kiln package` after a failed gate used to exit 0, replace the package by an empty one and cut report.md
    down to the package stage, saying PASSED."""
    import json

    cfg = write_yaml(tiny_config_dict())
    wd = tmp_path / "w"
    assert cli.invoke(main, ["run", str(cfg), "-w", str(wd), "-q"]).exit_code == 0
    good = json.loads((wd / "package" / "kiln-package.json").read_text())
    assert good["models"]
    # a per-stage command keeps the other stages in the report
    assert cli.invoke(main, ["package", str(cfg), "-w", str(wd), "-q"]).exit_code == 0
    report = json.loads((wd / "report.json").read_text())
    assert report["stages"]["package"]["status"] == "ran" and report["stages"]["train"]["status"] == "kept"
    assert report["validation"]["passed"] and "Validation against PyTorch" in (wd / "report.md").read_text()
    # a failed gate, then `kiln package`: refused, the earlier package stays
    failed = cli.invoke(main, ["run", str(cfg), "-w", str(wd), "-q", "--set", "validate.gates.max_latency_p50_ms=1e-6"])
    assert failed.exit_code == 3 and "(package/ still from an earlier run that passed, not redone)" in failed.output
    result = cli.invoke(
        main, ["package", str(cfg), "-w", str(wd), "-q", "--set", "validate.gates.max_latency_p50_ms=1e-6"]
    )
    assert_clean_error(result, 3, "nothing is packaged; package/ keeps an earlier run's engines")
    assert json.loads((wd / "package" / "kiln-package.json").read_text()) == good
    assert "**Result: FAILED**" in (wd / "report.md").read_text()


def test_from_after_until_and_empty_lists_are_config_errors(cli: CliRunner, tmp_path: Path) -> None:
    wd = str(tmp_path / "w")
    assert_clean_error(
        cli.invoke(main, ["run", "--from", "validate", "--until", "export", "-w", wd]), 2, "comes after --until export"
    )
    for key in ("build.backends=[]", "precision.variants=[]"):
        assert_clean_error(cli.invoke(main, ["run", "--set", key, "-w", wd]), 2, "at least 1 item")


def test_damaged_upstream_output_is_named(cli: CliRunner, tmp_path: Path, write_yaml) -> None:
    """A deleted engine file used to be skipped silently by `kiln validate` (exit 0)."""
    cfg, wd = write_yaml(tiny_config_dict()), tmp_path / "w"
    assert cli.invoke(main, ["run", str(cfg), "-w", str(wd), "-q", "--until", "build"]).exit_code == 0
    next((wd / "build").glob("*/engine.onnx")).unlink()
    result = cli.invoke(main, ["validate", "-c", str(cfg), "-w", str(wd), "-q"])
    assert_clean_error(result, 2, "missing or damaged", "kiln run --from build")
    assert "stages before" not in result.output  # nothing of this command ran: no 'kept / resumes' line


def test_garbage_pt_checkpoint_and_wrong_input_shape_say_what_is_wrong(cli: CliRunner, tmp_path: Path) -> None:
    """A garbage .pt used to echo torch's advice to load with weights_only=False (running the file's code); a
    wrong --input-shape used to blame 'an op ONNX cannot express'."""
    garbage = tmp_path / "w.pt"
    garbage.write_bytes(b"garbage")
    result = cli.invoke(
        main, ["export", "--model", "cnn", "--checkpoint", str(garbage), "-o", str(tmp_path / "m.onnx")]
    )
    assert_clean_error(result, 2, "cannot read checkpoint", "not a plain state dict")
    assert "weights_only` set to `False`" not in result.output
    result = cli.invoke(main, ["export", "--model", "cnn", "--input-shape", "3,32,32", "-o", str(tmp_path / "m.onnx")])
    assert_clean_error(result, 2, "rejects the inputs --input-shape gives ('input' float32[batch, 3, 32, 32])", "fix:")


@pytest.mark.parametrize(
    "model,shapes",
    [
        ("tests.user_models:two_in", ["x=8", "meta=3"]),
        ("tests.user_models:ids_and_mask", ["input_ids=6:int64", "attention_mask=6:int64"]),
        ("tests.user_models:three_in", ["image=3,6,6", "vec=5", "scale=1"]),
    ],
)
def test_direct_export_of_a_multi_input_model_asks_for_its_inputs(
    cli: CliRunner, tmp_path: Path, model: str, shapes: list[str]
) -> None:
    """No config and no --input-shape: the demo's digits used to be the example, a TypeError traceback."""
    from safetensors.torch import save_file

    from kiln.models.registry import build_model

    weights = tmp_path / "w.safetensors"
    save_file(build_model(model).state_dict(), weights)
    args = ["export", "--model", model, "--checkpoint", str(weights), "-o", str(tmp_path / "m.onnx")]
    asked = cli.invoke(main, args)
    assert_clean_error(asked, 2, "cannot tell which inputs", *(f"--input-shape {s.split('=')[0]}=" for s in shapes))
    lines = asked.output.splitlines()
    assert sum(x.startswith("error:") for x in lines) == 1 and sum(x.startswith("fix:") for x in lines) == 1
    flags = [a for s in shapes for a in ("--input-shape", s)]
    done = cli.invoke(main, [*args, *flags])
    assert done.exit_code == 0 and "wrote" in done.output, done.output


def test_export_help_documents_input_shape(cli: CliRunner) -> None:
    out = cli.invoke(main, ["export", "--help"], terminal_width=200).output
    assert "--input-shape [NAME=]DIMS[:DTYPE]" in out and "one per input" in out


@pytest.mark.slow
def test_a_models_folder_in_the_working_directory_does_not_shadow_kiln(tmp_path: Path, write_yaml) -> None:
    """kiln puts the current folder on sys.path for user modules; a project folder named models/ (weights, say)
    must not replace Kiln's own package. A fresh process: in this one Kiln's packages are imported already."""
    import subprocess
    import sys

    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "weights.safetensors").write_bytes(b"")
    cfg = write_yaml(tiny_config_dict())
    # -P: like the `kiln` script, Python itself does not put the current folder first (as `-m` would)
    proc = subprocess.run(
        [sys.executable, "-P", "-m", "kiln.cli", "run", str(cfg), "-w", str(tmp_path / "w"), "-q", "--until", "train"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_a_validation_of_other_settings_does_not_judge_this_run(cli: CliRunner, tmp_path: Path, write_yaml) -> None:
    """`kiln validate` with a gate set on the command line fails; a later `kiln run --until build` without it must
    not be reported FAILED on that stale verdict: validate shows as 'stale'."""
    import json

    cfg, wd = write_yaml(tiny_config_dict()), tmp_path / "w"
    assert cli.invoke(main, ["run", str(cfg), "-w", str(wd), "-q"]).exit_code == 0
    bad = cli.invoke(
        main, ["validate", "-c", str(cfg), "-w", str(wd), "-q", "--set", "validate.gates.max_latency_p50_ms=1e-6"]
    )
    assert bad.exit_code == 3
    assert cli.invoke(main, ["run", str(cfg), "-w", str(wd), "-q", "--until", "build"]).exit_code == 0
    report = json.loads((wd / "report.json").read_text())
    assert report["ok"] and report["stages"]["validate"]["status"] == "stale" and "validation" not in report
    assert report["stages"]["train"]["status"] == "cached"


def test_set_off_for_an_on_off_key(cli: CliRunner) -> None:
    # Before: YAML read `off` as False and the config refused it.
    result = cli.invoke(main, ["config", "--set", "build.onnxruntime.transformer_fusion=off"])
    assert result.exit_code == 0, result.output
    assert yaml.safe_load(result.output)["build"]["onnxruntime"]["transformer_fusion"] == "off"


def _all_commands():
    return [(name, cmd) for name, cmd in main.commands.items()]


@pytest.mark.parametrize("name", sorted(main.commands))
def test_every_option_has_help_and_help_states_exit_codes(cli: CliRunner, name: str) -> None:
    cmd = main.commands[name]
    undocumented = [p.name for p in cmd.params if isinstance(p, click.Option) and not p.help]
    assert not undocumented, f"kiln {name}: options without help: {undocumented}"
    out = cli.invoke(main, [name, "--help"]).output
    assert "Exit codes: 0" in out and "2 a problem" in out and "3 a validation gate" in out


def test_help_lists_passes_and_stages(cli: CliRunner) -> None:
    from kiln.pipeline.stage_list import STAGE_NAMES
    from kiln.stages.optimize.registry import PASSES

    opt = " ".join(cli.invoke(main, ["optimize", "--help"]).output.split())
    assert all(p in opt for p in PASSES)
    run = " ".join(cli.invoke(main, ["run", "--help"]).output.split())
    assert run.count(" -> ".join(STAGE_NAMES)) == 3  # --force, --from, --until


@pytest.mark.parametrize(
    "name", ["run", "config", "train", "export", "optimize", "precision", "build", "validate", "package"]
)
@pytest.mark.parametrize("form", ["positional", "-c"])
def test_config_accepted_as_positional_and_option_everywhere(
    cli: CliRunner, write_yaml, tmp_path: Path, name: str, form: str
) -> None:
    cfg = str(write_yaml({"train": {"epochz": 2}}))  # an unknown key: proves the command read this file
    args = [name, cfg] if form == "positional" else [name, "-c", cfg]
    result = cli.invoke(main, args + (["-w", str(tmp_path / "wd")] if name != "config" else []))
    assert_clean_error(result, 2, "unknown key 'train.epochz'")


def test_two_different_configs_are_refused(cli: CliRunner, write_yaml) -> None:
    a, b = str(write_yaml({}, "a.yaml")), str(write_yaml({}, "b.yaml"))
    result = cli.invoke(main, ["config", a, "-c", b])
    assert result.exit_code == 2 and "two configs given" in result.output


@pytest.mark.tensorrt
def test_build_tensorrt_needs_no_device_flag(cli: CliRunner, tmp_path: Path) -> None:
    from tests.pipeline.test_faults import tiny_onnx

    model = tiny_onnx(tmp_path / "m.onnx")
    result = cli.invoke(main, ["build", str(model), "--backend", "tensorrt", "-o", str(tmp_path / "e")])
    assert result.exit_code == 0, result.output
    # rich wraps long lines at the terminal width, and pytest's tmp path makes this one long
    assert "targets CUDA" in " ".join(result.output.split())


def test_third_party_warnings_go_through_kilns_logger(capsys) -> None:
    import logging
    import warnings

    from kiln.cli import _setup_logging

    _setup_logging(quiet=False, verbose=False)
    try:
        with warnings.catch_warnings():  # pytest records warnings itself: hand them to logging inside this block
            warnings.simplefilter("always")
            logging.captureWarnings(False)
            logging.captureWarnings(True)
            warnings.warn("the float32 number 1e+09 will be truncated to 65504.0", stacklevel=2)
            logging.getLogger("onnxruntime.transformers.optimizer").warning("Model producer not matched: x")
            warnings.warn("something a user should see", stacklevel=2)
            # module-level logging.warning (ORT's quantize_static) and a library's own logger (ORT's fusions)
            logging.warning("Please consider to run pre-processing before quantization.")
            logging.getLogger("fusion_skiplayernorm").warning("symbolic shape inference disabled or failed.")
            logging.getLogger("some_library").warning("a library warning a user should see")
            warnings.warn("No complete tensor found in the group! Returning the first one.", UserWarning, stacklevel=2)
        err = capsys.readouterr().err
        assert "truncated" not in err and "producer" not in err  # known noise: --verbose only
        assert "pre-processing" not in err and "symbolic shape" not in err and "complete tensor" not in err
        assert "something a user should see" in err and "WARNING" in err  # through Kiln's handler
        assert "a library warning a user should see" in err and "WARNING:some_library" not in err
        assert "test_cli.py:" not in err and "warnings.warn(" not in err  # not the raw warnings format
        assert not any(type(h) is logging.StreamHandler for h in logging.getLogger().handlers)  # no basicConfig
    finally:
        logging.captureWarnings(False)
        root = logging.getLogger()
        root.handlers[:] = [h for h in root.handlers if not getattr(h, "kiln", False)]


def _engine_of(cli: CliRunner, tmp_path: Path, model: str, shapes: list[str], seed: int = 0) -> tuple[Path, Path]:
    """A checkpoint of ``model`` exported (``--input-shape`` values ``shapes``) and built: (checkpoint, engine)."""
    import torch

    from kiln.models.registry import build_model

    torch.manual_seed(seed)
    ckpt, onnx_path, engine = tmp_path / f"w{seed}.pt", tmp_path / f"m{seed}.onnx", tmp_path / f"e{seed}"
    torch.save(build_model(model).state_dict(), ckpt)
    flags = [a for s in shapes for a in ("--input-shape", s)]
    for args in (
        ["export", "--model", model, "--checkpoint", str(ckpt), "-o", str(onnx_path), *flags],
        ["build", str(onnx_path), "-o", str(engine)],
    ):
        result = cli.invoke(main, args)
        assert result.exit_code == 0, (args, result.output)
    return ckpt, engine


DIRECT_VALIDATE_MODELS = [
    ("cnn", ["1,8,8"]),
    ("tests.user_models:two_in", ["x=8", "meta=3"]),
    ("tests.user_models:ids_and_mask", ["input_ids=6:int64", "attention_mask=6:int64"]),
]


@pytest.mark.parametrize("model,shapes", DIRECT_VALIDATE_MODELS)
def test_direct_validate_says_when_its_inputs_are_random(
    cli: CliRunner, tmp_path: Path, model: str, shapes: list[str]
) -> None:
    """Without --inputs the engine used to be validated on random arrays without a word."""
    import json

    import numpy as np

    from kiln.stages.engines.backend import read_metadata

    ckpt, engine = _engine_of(cli, tmp_path, model, shapes)
    reference = ["--reference", str(tmp_path / "m0.onnx")]
    random = cli.invoke(main, ["validate", str(engine), *reference])
    assert random.exit_code == 0, random.output
    assert "no --inputs, so RANDOM arrays" in random.stderr
    assert json.loads(random.stdout)["inputs"]["kind"] == "random"
    arrays = {
        s.name: np.ones([2, *s.shape[1:]], np.dtype(s.dtype)) for s in read_metadata(engine).inputs
    }  # a fixed feed of the engine's own inputs
    np.savez(tmp_path / "real.npz", **arrays)
    real = cli.invoke(main, ["validate", str(engine), *reference, "--inputs", str(tmp_path / "real.npz")])
    assert real.exit_code == 0, real.output
    report = json.loads(real.stdout)
    assert report["inputs"] == {"kind": "file", "path": str(tmp_path / "real.npz")}
    assert report["batch_sizes"] == [2]  # what it compared at, as the stage's records say
    named = {
        d: arrays[s.name].shape[i]
        for s in read_metadata(engine).inputs
        for i, d in enumerate(s.shape)
        if i and isinstance(d, str)
    }
    assert report["shapes"] == ([named] if named else [])
    assert "RANDOM" not in real.output


@pytest.mark.parametrize("model,shapes", DIRECT_VALIDATE_MODELS)
def test_a_gate_failed_on_random_inputs_names_inputs_in_its_fix(
    cli: CliRunner, tmp_path: Path, model: str, shapes: list[str]
) -> None:
    _, engine = _engine_of(cli, tmp_path, model, shapes, seed=0)
    other, _ = _engine_of(cli, tmp_path, model, shapes, seed=1)  # other weights: the engine cannot match them
    result = cli.invoke(main, ["validate", str(engine), "--reference", str(other), "--model", model])
    assert_clean_error(result, 3, "failed its gates")
    fix = next(line for line in result.output.splitlines() if line.startswith("fix:"))
    assert "--inputs" in fix and "random inputs" in fix
    assert "fp32 engine whose cosine" in fix and "relax" not in fix  # no precision to inspect


@pytest.mark.parametrize(
    "args, named",
    [
        (["serve", "--http-port", "99999"], "99999 is not in the range"),
        (["frobnicate"], "No such command 'frobnicate'"),
        (["run", "--no-such-flag"], "No such option '--no-such-flag'"),
        (["loadtest"], "Missing argument"),
        (["validate", "some-engine"], "--reference"),
    ],
)
def test_command_line_mistakes_are_one_error_and_one_fix(args: list[str], named: str) -> None:
    """Click's own usage errors (a value out of range, an unknown option or command, a missing argument) read like
    every other mistake: one error line naming it, one fix line, exit 2, no usage dump."""
    result = CliRunner().invoke(main, args)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2, result.output
    assert [line.split(":")[0] for line in lines] == ["error", "fix"] and named in lines[0], result.output


@pytest.mark.parametrize("args", [["run", "-o", "out"], ["train", "--output=out"], ["validate", "--out", "o"]])
def test_an_output_option_on_a_workdir_command_points_to_the_workdir(args: list[str]) -> None:
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert f"{args[0]}` writes into a workdir: -w DIR (--workdir DIR)" in result.output, result.output


def test_a_load_test_that_failed_its_check_leaves_files_the_next_one_may_replace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The load test writes its three files before it fails on a wrong answer (exit 3): they are Kiln's, so the
    next `kiln loadtest -o` into the same folder replaces them rather than refusing a folder it wrote itself.
    The server and its answers are not what this checks: the load test's own function stands in for them."""
    import kiln.serve.loadtest as lt
    from kiln.core.errors import GateFailure

    def wrote_then_failed(url: str, model: str, engines: str, out: Path, *args: object, **kw: object) -> None:
        for name in ("loadtest.json", "loadtest.md", "loadtest.png"):
            (out / name).write_text("written by the load test")
        raise GateFailure("1 answers differed from the engine's direct output", hint="check the server")

    monkeypatch.setattr(lt, "loadtest", wrote_then_failed)
    monkeypatch.setattr(lt, "default_model", lambda engines: "m")
    (tmp_path / "wd").mkdir()
    args = ["loadtest", "http://127.0.0.1:8000", "-e", str(tmp_path / "wd"), "-o", str(tmp_path / "lt")]
    for _ in range(2):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 3 and "1 answers differed" in result.output, result.output


@pytest.mark.parametrize(
    ("url", "extra", "said"),
    [
        ("grpc://127.0.0.1:8001", ["--client", "kiln"], "HTTP requests whose tensors are in shared memory only"),
        ("http://10.1.2.3:8000", [], "is not this machine"),
        ("http://127.0.0.1:8000", ["-e", "no-such-workdir"], "pass -e WORKDIR"),
    ],
)
def test_a_load_test_that_cannot_run_says_why_before_making_its_folder(
    tmp_path: Path, url: str, extra: list[str], said: str
) -> None:
    out = tmp_path / "lt"
    result = CliRunner().invoke(main, ["loadtest", url, "-e", str(tmp_path), "-o", str(out), *extra])  # last -e wins
    assert result.exit_code == 2 and said in result.output and "fix:" in result.output, result.output
    assert not out.exists()


def test_direct_validate_compares_integer_outputs_value_for_value(cli: CliRunner, tmp_path: Path) -> None:
    """Token ids from a PyTorch checkpoint reference stay integers: wrong ids fail a 0.99 agreement gate, where
    their cosine as floats (ids near 2**24 differ by a few parts in ten million) would pass every gate."""
    import numpy as np
    import torch

    from kiln.models.registry import build_model

    model = "tests.user_models:token_ids"
    torch.manual_seed(0)
    net = build_model(model)
    x = torch.randn(8, 8)
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    torch.save(net.state_dict(), a)
    with torch.no_grad():  # B's head never picks row 0's class
        net.head.bias[net.head(x[:1]).argmax()] -= 100.0
    torch.save(net.state_dict(), b)
    np.savez(tmp_path / "x.npz", x=x.numpy())
    onnx_path = tmp_path / "a.onnx"
    args = ["export", "--model", model, "--checkpoint", str(a), "--input-shape", "x=8", "-o", str(onnx_path)]
    assert cli.invoke(main, args).exit_code == 0
    assert cli.invoke(main, ["build", str(onnx_path), "-o", str(tmp_path / "e")]).exit_code == 0
    common = ["validate", str(tmp_path / "e"), "--model", model, "--inputs", str(tmp_path / "x.npz")]
    same = cli.invoke(main, [*common, "--reference", str(a)])
    assert same.exit_code == 0, same.output
    result = cli.invoke(
        main, [*common, "--reference", str(b), "--set", "validate.gates.per_precision.fp32.min_top1_agreement=0.99"]
    )
    assert_clean_error(result, 3, "output 'token_id'", "of its values equal < min_top1_agreement 0.99")


@pytest.mark.slow  # two pipeline runs: about 5 s on 2 cores
def test_a_stage_after_one_made_anew_is_stale_though_its_own_inputs_stayed(
    cli: CliRunner, tmp_path: Path, write_yaml
) -> None:
    """`kiln run --until precision` after a precision change: build (from the old variants) is stale, and so is
    validate, although the build folder it read is unchanged; the report gives no verdict from them."""
    import json

    wd = tmp_path / "w"
    assert cli.invoke(main, ["run", str(write_yaml(tiny_config_dict())), "-w", str(wd), "-q"]).exit_code == 0
    changed = write_yaml(tiny_config_dict(**{"precision.variants": ["fp32", "int8"]}))
    assert cli.invoke(main, ["run", str(changed), "-w", str(wd), "-q", "--until", "precision"]).exit_code == 0
    stages = json.loads((wd / "report.json").read_text())["stages"]
    assert stages["precision"]["status"] == "ran" and stages["build"]["status"] == "stale"
    assert stages["validate"]["status"] == "stale" and stages["package"]["status"] == "stale"


def _kiln(*args: str, cwd: Path, **kw) -> subprocess.CompletedProcess:
    code = "import sys; from kiln.cli import command; sys.argv[0] = 'kiln'; command()"
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, text=True, timeout=300, **kw)


def test_sigterm_during_a_stage_is_one_error_exit_143_and_leaves_no_staging_or_scratch(tmp_path: Path) -> None:
    """SIGTERM (`timeout`, CI, `docker stop`) killed `kiln run` on the spot: exit 143 with nothing said, its
    .train.staging-<pid>-… and .kiln-tmp/.run.scratch-<pid>-… left for the next run to remove. Now it unwinds as
    Ctrl-C does: one error/fix pair, exit 143 (128 + 15), every temporary folder removed."""
    (tmp_path / "kiln_t_term.py").write_text(
        "import os, signal, time\nimport torch\n\n"
        "def build():\n"
        "    if any(n.startswith('.train.staging-') for n in os.listdir('wd')):  # inside the train stage\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "        time.sleep(60)\n"
        "    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))\n"
    )
    (tmp_path / "c.yaml").write_text(
        yaml.safe_dump({"model": {"name": "kiln_t_term:build"}, "data": {"name": "digits"}, "train": {"epochs": 1}})
    )
    done = _kiln("run", "c.yaml", "-w", "wd", "--until", "train", cwd=tmp_path, capture_output=True)
    assert done.returncode == 143, (done.returncode, done.stderr)
    assert done.stderr.splitlines()[-2:][0] == (
        "error: stopped by SIGTERM (what `timeout`, `kill`, CI runners and `docker stop` send)"
    )
    assert done.stderr.splitlines()[-1].startswith("fix: run the same command again") and "Traceback" not in done.stderr
    left = [p.name for p in (tmp_path / "wd").rglob(".*") if p.name != ".kiln.lock"]
    assert not left, left


def test_a_factory_calling_sys_exit_fails_the_run_with_its_report(cli: CliRunner, tmp_path: Path, monkeypatch) -> None:
    """`kiln run` with a factory that calls sys.exit(0) exited 0, saying nothing and writing no report."""
    (tmp_path / "kiln_t_exit_factory.py").write_text("import sys\n\ndef exits(**kw):\n    sys.exit(0)\n")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"name": "kiln_t_exit_factory:exits"}, "data": {"name": "digits"}}))
    monkeypatch.setattr(sys, "path", list(sys.path))
    try:
        result = cli.invoke(main, ["run", str(cfg), "-w", str(tmp_path / "w"), "--until", "train", "-q"])
    finally:
        sys.modules.pop("kiln_t_exit_factory", None)
    assert_clean_error(result, 2, "error: model factory 'kiln_t_exit_factory:exits' called sys.exit(0) (in exits() at ")
    assert "fix: return the model instead of exiting in exits() at " in result.output
    assert (tmp_path / "w" / "report.json").is_file()


def test_sys_exit_anywhere_in_a_command_is_an_error(cli: CliRunner, tmp_path: Path, monkeypatch) -> None:
    """User code Kiln calls outside a factory (a validate.metric, the check of a train.loss) calling sys.exit():
    an error naming it, not a silent exit 0."""
    import kiln.cli as cli_module

    (tmp_path / "kiln_t_exit_metric.py").write_text("import sys\n\ndef metric(*args, **kw):\n    sys.exit(0)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import kiln_t_exit_metric

    monkeypatch.setattr(cli_module, "_run", kiln_t_exit_metric.metric)
    try:
        result = cli.invoke(main, ["run", "-w", str(tmp_path / "w")])
    finally:
        sys.modules.pop("kiln_t_exit_metric", None)
    assert_clean_error(result, 2, "error: your code called sys.exit(0) (in metric() at ", "while running `kiln run`")
    assert "fix: return instead of exiting in metric() at " in result.output


def test_serve_stopped_before_it_was_ready_says_so(cli: CliRunner, tmp_path: Path, monkeypatch) -> None:
    """Ctrl-C or SIGTERM while the server started (serve's own handler: it returns quietly) exited 0, silent."""
    import signal

    import kiln.serve.server as server

    def stopped(*args, on_ready=None, **kw) -> None:  # the server's return from a stop before its models answered
        server._StopRequest()(signal.SIGINT, None)

    monkeypatch.setattr(server, "serve", stopped)
    result = cli.invoke(main, ["serve", str(tmp_path)])
    assert_clean_error(result, 130)
    assert result.output.splitlines()[-2:] == [
        "error: kiln serve was stopped (Ctrl-C) before the server was ready: nothing was served",
        "fix: run `kiln serve` again and stop it after its `ready` line (it comes once every engine answers)",
    ]

    def terminated(*args, on_ready=None, **kw) -> None:  # SIGTERM (a container's stop): 143, as for every command
        server._StopRequest()(signal.SIGTERM, None)

    monkeypatch.setattr(server, "serve", terminated)
    result = cli.invoke(main, ["serve", str(tmp_path)])
    assert_clean_error(result, 143, "stopped (SIGTERM) before the server was ready")

    def served(*args, on_ready=None, **kw) -> None:  # ready, then stopped: a clean stop
        on_ready([])

    monkeypatch.setattr(server, "serve", served)
    assert cli.invoke(main, ["serve", str(tmp_path)]).exit_code == 0


@pytest.mark.parametrize("fails", [False, True])
def test_a_reader_that_closes_stdout_ends_nothing_early(tmp_path: Path, fails: bool) -> None:
    """`kiln run | head -2` exited 1 with nothing said (rich's own exit on a broken pipe), a failed run's
    error and exit code lost. The answer's rest is dropped; the command ends as it would have."""
    script = textwrap.dedent(
        f"""
        import sys, time
        import kiln.cli as cli
        from kiln.core.errors import KilnError
        def answers(*args, **kwargs):
            time.sleep(0.5)  # the reader has gone
            for i in range(3000):
                cli.results.print(f"line {{i}} of a long answer")
            cli._answer("and a plain one")
            if {fails}:
                raise KilnError("the run failed", hint="fix it")
        cli._run = answers
        cli.main(["run", "-w", sys.argv[1]])
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path / "wd")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    proc.stdout.close()  # `head` done
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == (2 if fails else 0), err
    assert err.splitlines() == (["error: the run failed", "fix: fix it"] if fails else []), err


def test_a_rerun_says_which_stage_ran_again_and_what_changed(capsys: pytest.CaptureFixture[str]) -> None:
    """Without -v: the first stage whose own inputs changed, not the stages after it (they ran because it did)."""
    from kiln.cli import _say_what_changed
    from kiln.pipeline.runner import StageRecord

    records = [
        StageRecord("train", "cached"),
        StageRecord("export", "ran", changed=["config.export"]),
        StageRecord("optimize", "ran", changed=["inputs.export"]),
    ]
    _say_what_changed(records)
    err = capsys.readouterr().err
    assert "export ran again: changed since the last run: config.export" in err and "optimize" not in err, err


@pytest.mark.parametrize("reasons", [["no CUDA GPU"] * 3, ["no CUDA GPU", "no CUDA GPU", "no onnxruntime-gpu"]])
def test_engines_not_validated_here_are_listed_apart_only_where_their_reasons_differ(monkeypatch, reasons) -> None:
    """The result line names every engine not validated and the reasons; a line per engine on top of it repeats it
    where they share one reason, and says which engine has which where they do not."""
    import io
    from types import SimpleNamespace

    from rich.console import Console

    import kiln.cli

    out = io.StringIO()
    monkeypatch.setattr(kiln.cli, "console", Console(file=out, width=200))
    engines = [SimpleNamespace(name=f"e{i}", status="not run", device="cuda", reason=r) for i, r in enumerate(reasons)]
    kiln.cli._print_unvalidated([SimpleNamespace(name="cpu", status="validated", device="cpu", reason=None), *engines])
    lines = out.getvalue().splitlines()
    if len(set(reasons)) == 1:
        assert lines == []
    else:
        assert lines == [
            "e0, e1: built for CUDA, not validated here: no CUDA GPU",
            "e2: built for CUDA, not validated here: no onnxruntime-gpu",
        ]


def test_a_stages_repeated_warning_is_said_once_and_the_servers_each_time(capsys) -> None:
    import logging

    from kiln.cli import _setup_logging

    _setup_logging(quiet=False, verbose=False)
    try:
        for _ in range(2):
            logging.getLogger("kiln.validate").warning("the reference puts class 3 on top at all 64 of its rows")
            logging.getLogger("kiln.serve.server").warning("a request with 3 rows was refused")
        logging.getLogger("kiln.validate").warning("the reference puts class 4 on top at all 64 of its rows")
        err = capsys.readouterr().err
        assert err.count("class 3 on top") == 1 and err.count("class 4 on top") == 1
        assert err.count("was refused") == 2
    finally:
        root = logging.getLogger()
        root.handlers[:] = [h for h in root.handlers if not getattr(h, "kiln", False)]
