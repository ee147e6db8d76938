"""The torch backend: AOTInductor packages of the trained model, through the same registry, runner interface,
validation and packaging as the ONNX engines."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

from kiln.core.errors import BuildError, ConfigError
from kiln.models.registry import build_model
from kiln.stages.engines.backend import read_metadata
from kiln.stages.engines.config import BuildConfig
from kiln.stages.engines.registry import BACKENDS, load_engine, runnable
from kiln.stages.engines.stage import build_engine
from kiln.stages.engines.torch import _can_run, _plan
from kiln.stages.engines.torch.build import PROGRAM, _settings
from kiln.stages.engines.torch.config import TorchConfig
from kiln.stages.engines.torch.program import compile_program, inductor_options
from tests.conftest import tiny_config_dict
from tests.stages.engines.build_graphs import assert_engine_matches, sample

pytestmark = pytest.mark.slow  # AOTInductor and Inductor builds: a minute of C++ compiling each


def test_registered_opt_in_and_planned_for_fp32_or_gpu_fp16() -> None:
    assert "torch" in BACKENDS and "torch" not in BuildConfig().backends
    cfg = BuildConfig(backends=["torch"], torch=TorchConfig(devices=["cpu", "cuda"]))
    assert _plan(cfg.torch, "fp32").devices == ["cpu", "cuda"]
    fp16 = _plan(cfg.torch, "fp16")
    assert fp16.devices == ["cuda"] and "torch-cpu-fp16" in fp16.skipped[0]
    assert _plan(cfg.torch, "int8").devices == []


def test_needs_the_pytorch_model(zoo, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="needs the PyTorch model"):
        build_engine(zoo("cnn"), tmp_path / "e", "torch", "cpu", "fp32", BuildConfig(), tmp_path / "c")


def _cnn() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model("cnn", {}).eval()


def test_cpu_package_matches_pytorch_at_any_batch_and_refuses_another_torch(zoo, tmp_path: Path) -> None:
    model = _cnn()  # the weights zoo("cnn") was exported from
    meta = build_engine(
        zoo("cnn"), tmp_path / "e", "torch", "cpu", "fp32", BuildConfig(), tmp_path / "c", max_batch=8, torch_model=_cnn
    )
    assert meta.files == {"model": "model.pt2"} and meta.versions["torch"] == torch.__version__
    assert meta.builder_settings["channels_last"] and not meta.builder_settings["max_autotune"]  # conv, CPU
    assert runnable(meta) == (True, "")
    with load_engine(tmp_path / "e") as runner:
        for batch in (1, 3, 8):
            x = sample("cnn", batch, seed=batch)
            got = runner.infer({"input": x})["logits"]
            with torch.inference_mode():
                want = model(torch.from_numpy(x)).numpy()
            np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
        assert len(runner.time_ms({"input": sample("cnn", 2)}, 1, 3)) == 3
    other = read_metadata(tmp_path / "e").model_copy(update={"versions": {"torch": "0.0.1"}})
    ok, why = _can_run(other)
    assert not ok and "tied to the torch that built them" in why


@pytest.mark.parametrize("freezing", [False, True])  # True: the weights folded as constants
def test_compiled_flavour_matches_pytorch_and_reloads_from_its_files(zoo, tmp_path: Path, freezing: bool) -> None:
    """Inductor's work shipped without AOTInductor's loader: the exported program and the compile caches; the
    runner compiles the loaded program (a batch not compiled at build time compiles on first use)."""
    model = _cnn()
    cfg = BuildConfig(backends=["torch"], torch=TorchConfig(flavour="compiled", freezing=freezing))
    meta = build_engine(
        zoo("cnn"), tmp_path / "e", "torch", "cpu", "fp32", cfg, tmp_path / "c", max_batch=8, torch_model=_cnn
    )
    assert meta.flavour == "compiled" and meta.files["program"] == "program.pt2"
    assert meta.builder_settings["freezing"] is freezing
    assert meta.builder_settings["channels_last_weights"]  # frozen or not: right in this flavour (see the package's)
    assert meta.builder_settings["compiled_batches"] == [1, 8] and "aotinductor_failed" not in meta.builder_settings
    assert meta.builder_settings["cuda_graphs"] is False  # CUDA graphs: the GPU's (build.torch.cuda_graphs auto)
    assert not (tmp_path / "e" / "model.pt2").exists()
    torch.compiler.reset()  # the runner compiles in a process that has not seen the model
    with load_engine(tmp_path / "e") as runner:
        assert runner.per_shape_sessions
        for batch in (1, 3, 8):
            x = sample("cnn", batch, seed=batch)
            with torch.inference_mode():
                want = model(torch.from_numpy(x)).numpy()
            np.testing.assert_allclose(runner.infer({"input": x})["logits"], want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "settings, frozen, vectorized",
    [
        ({"freezing": False}, False, True),
        ({"freezing": True}, True, True),
        ({"inductor": {"cpp.simdlen": 1}}, False, False),
    ],
    ids=["plain", "freezing", "inductor-entry"],
)
def test_inductor_config_reaches_the_compilation(
    tmp_path: Path, settings: dict, frozen: bool, vectorized: bool
) -> None:
    """torch.compile's ``options`` do not reach Inductor's freezing (an H200 run built "frozen" engines with the
    kernels of unfrozen ones): the compiled program must compile with the weights as constants when asked, and with
    a build.torch.inductor entry (here: scalar CPU code); a second call of the same shape does not compile again."""
    from torch._dynamo.utils import counters
    from torch._inductor.utils import run_and_get_code

    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).eval()
    x = torch.randn(3, 16)
    torch.export.save(torch.export.export(model, (x,)), str(tmp_path / PROGRAM))
    torch.compiler.reset()
    run, _ = compile_program(tmp_path / PROGRAM, settings)
    with torch.inference_mode(), torch._inductor.config.patch(fx_graph_cache=False):
        out, code = run_and_get_code(run, x)  # (it resets Dynamo first: the call compiles)
        graphs = counters["stats"]["unique_graphs"]
        run(x)
    assert ("_frozen_param" in "\n".join(code)) is frozen
    assert ("Vectorized" in "\n".join(code)) is vectorized
    assert counters["stats"]["unique_graphs"] == graphs  # the same shape again: no new compilation
    torch.testing.assert_close(out, model(x).detach())


def test_an_aotinductor_package_freezes_its_weights(zoo, tmp_path: Path) -> None:
    """AOTInductor freezes only when compiled without autograd: the package holds frozen constants when asked, and
    computes the model (channels_last weights frozen into a package gave errors of 0.02-0.03 here: Kiln leaves the
    frozen weights' layout to Inductor)."""
    import zipfile

    cfg = BuildConfig(backends=["torch"], torch=TorchConfig(flavour="aotinductor", freezing=True, load_check=False))
    meta = build_engine(
        zoo("cnn"), tmp_path / "e", "torch", "cpu", "fp32", cfg, tmp_path / "c", max_batch=2, torch_model=_cnn
    )
    assert meta.flavour == "aotinductor" and meta.builder_settings["freezing"] is True
    assert meta.builder_settings["channels_last"] and not meta.builder_settings["channels_last_weights"]
    with zipfile.ZipFile(tmp_path / "e" / "model.pt2") as package:
        text = b"".join(package.read(n) for n in package.namelist() if n.endswith((".cpp", ".py", ".json", ".h")))
    assert b"_frozen_param" in text
    assert_engine_matches(tmp_path / "e", _cnn(), "cnn", (1, 2))


@pytest.mark.parametrize(
    "device, has_conv, setting, want",
    [
        ("cuda", True, "auto", True),
        ("cuda", False, "auto", False),
        ("cuda", False, "on", True),
        ("cuda", True, "off", False),
        ("cpu", True, "on", False),
    ],
)  # no max-autotune on the CPU: nothing to tune
def test_coordinate_descent_follows_the_setting_and_older_engines_keep_theirs(
    device: str, has_conv: bool, setting: str, want: bool
) -> None:
    settings = _settings(TorchConfig(coordinate_descent=setting), device, "fp16", has_conv)
    assert settings["coordinate_descent"] is want
    options = inductor_options(settings)
    assert options.get("coordinate_descent_tuning", False) is want
    assert options.get("max_autotune", False) is (device == "cuda")
    older = {k: v for k, v in settings.items() if k != "coordinate_descent"}  # recorded before the setting existed
    assert inductor_options(older).get("coordinate_descent_tuning", False) is (device == "cuda")


def test_coordinate_descent_on_tunes_without_max_autotune_on_the_gpu() -> None:
    """An FP8 engine builds without max-autotune; its quantizing kernels can still get their block sizes tuned."""
    settings = _settings(TorchConfig(coordinate_descent="on", max_autotune="off"), "cuda", "fp8", False)
    assert settings["max_autotune"] is False and settings["coordinate_descent"] is True
    options = inductor_options(settings)
    assert options["coordinate_descent_tuning"] is True and not options.get("max_autotune", False)
    plain = inductor_options(_settings(TorchConfig(), "cuda", "fp8", False))
    assert "coordinate_descent_tuning" not in plain and not plain.get("max_autotune", False)


@pytest.mark.parametrize(
    "entries, message, hint",
    [
        ({"max_autotune_gem_backends": "ATEN"}, "did you mean max_autotune_gemm_backends", "nested ones dotted"),
        ({"freezing": True}, "freezing is set by Kiln's own settings", "build.torch.freezing"),
        ({"coordinate_descent_tuning": False}, "is set by Kiln's own settings", "build.torch.coordinate_descent"),
        ({"epilogue_fusion": "yes"}, "epilogue_fusion takes a bool", "set epilogue_fusion to a bool"),
    ],
)
def test_a_wrong_inductor_entry_is_a_config_error(zoo, tmp_path: Path, entries: dict, message: str, hint: str) -> None:
    cfg = BuildConfig(backends=["torch"], torch=TorchConfig(inductor=entries))
    with pytest.raises(ConfigError, match=message) as err:
        build_engine(zoo("cnn"), tmp_path / "e", "torch", "cpu", "fp32", cfg, tmp_path / "c", torch_model=_cnn)
    assert hint in err.value.hint


def test_a_package_that_crashes_its_loader_falls_back_to_the_compiled_flavour(
    zoo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the H200 host does (aoti_load_package: SIGSEGV in a fresh process), reproduced by making the child's
    load check report it: auto builds the compiled flavour and records why; aotinductor alone stops."""
    import kiln.stages.engines.torch.build as tb

    def crashed(*args: object, **kwargs: object) -> None:
        raise BuildError("the AOTInductor package does not load in a fresh process (killed by SIGSEGV)")

    monkeypatch.setattr(tb, "_load_check", crashed)
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", lambda *a, **k: None)  # the crash is the point
    meta = build_engine(
        zoo("cnn"),
        tmp_path / "e",
        "torch",
        "cpu",
        "fp32",
        BuildConfig(backends=["torch"]),
        tmp_path / "c",
        max_batch=2,
        torch_model=_cnn,
    )
    assert meta.flavour == "compiled" and "SIGSEGV" in meta.builder_settings["aotinductor_failed"]
    strict = BuildConfig(backends=["torch"], torch=TorchConfig(flavour="aotinductor"))
    with pytest.raises(BuildError, match="SIGSEGV"):
        build_engine(
            zoo("cnn"), tmp_path / "f", "torch", "cpu", "fp32", strict, tmp_path / "c", max_batch=2, torch_model=_cnn
        )


@pytest.mark.parametrize("flavour", ["aotinductor", "compiled"])
@pytest.mark.long
def test_two_inputs_with_a_dynamic_sequence_axis(tmp_path: Path, flavour: str) -> None:
    """Token ids + mask sharing a `seq` axis (signature.dynamic_axes): exported with that axis dynamic too, validated
    at both sequence lengths (before, the build stopped the whole run: only the batch axis could be dynamic)."""
    from kiln.pipeline.api import run_pipeline
    from kiln.pipeline.config import config_from_dict

    seq = {"input_ids": {1: "seq"}, "attention_mask": {1: "seq"}}
    cfg = config_from_dict(
        tiny_config_dict(
            **{
                "model.name": "token_classifier",
                "model.params": {"dim": 16, "layers": 1},
                "train.enabled": False,
                "signature.dynamic_axes": seq,
                "validate.max_samples": 32,
                "build.backends": ["onnxruntime", "torch"],
                "build.torch": {"flavour": flavour, "devices": ["cpu"]},
            }
        )
    )
    result, report = run_pipeline(cfg, tmp_path / "wd")
    assert result.ok, result.error
    engine = next(e for e in report["validation"]["engines"] if e["backend"] == "torch")
    assert engine["passed"] and len(engine["shapes"]) == 2 and engine["shapes"][0] != engine["shapes"][1], engine
    assert read_metadata(tmp_path / "wd" / "build" / engine["name"]).flavour == flavour


class DictScorer(torch.nn.Module):
    """forward(ids, mask) returning a dict (as a ``transformers`` ModelOutput is one), fed by a dict whose keys come
    in another order than the forward's parameters."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = torch.nn.Embedding(20, 8), torch.nn.Linear(8, 1)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        m = mask.to(torch.float32)[..., None]
        h = (self.emb(ids) * m).sum(1) / m.sum(1).clamp(min=1.0)
        return {"score": self.head(h).squeeze(-1), "embedding": h}


def test_dict_inputs_and_outputs_keep_their_names(tmp_path: Path) -> None:
    """The engine binds the ONNX inputs by name (by position, mask would have gone in as ids: both integer, no
    error, wrong outputs) and flattens a dict output as the export did (before: the build failed on the dict)."""
    from kiln.stages.export.torch_export import export_onnx

    model = DictScorer().eval()
    rng = np.random.default_rng(0)
    feed = {"mask": rng.integers(0, 2, size=(3, 6)), "ids": rng.integers(0, 20, size=(3, 6))}
    export_onnx(model, {k: torch.from_numpy(v) for k, v in feed.items()}, tmp_path / "m.onnx")
    cfg = BuildConfig(backends=["torch"], torch=TorchConfig(flavour="compiled"))
    build_engine(
        tmp_path / "m.onnx",
        tmp_path / "e",
        "torch",
        "cpu",
        "fp32",
        cfg,
        tmp_path / "c",
        max_batch=4,
        torch_model=DictScorer,
    )
    with load_engine(tmp_path / "e") as runner:
        assert runner.input_names == ["mask", "ids"]
        got = runner.infer(feed)
    with torch.inference_mode():
        want = model(ids=torch.from_numpy(feed["ids"]), mask=torch.from_numpy(feed["mask"]))
    assert list(got) == ["score", "embedding"]
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value.numpy(), atol=1e-5, rtol=1e-5)


class TinyUNet(torch.nn.Module):
    """Pooling down and up and a skip connection: it takes heights and widths that are even, and no others."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.down, self.up = torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ConvTranspose2d(4, 4, 2, stride=2)
        self.out = torch.nn.Conv2d(7, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.cat([self.up(torch.nn.functional.max_pool2d(self.down(x), 2)), x], 1))


def test_axes_the_model_constrains_are_refined_as_torch_suggests(tmp_path: Path) -> None:
    """Dynamic height/width on a model that needs them even: torch.export refused the plain dims ("Constraints
    violated (height, width)"), so the engine was skipped; with torch's suggested fixes it takes both sizes."""
    from kiln.stages.export.torch_export import export_onnx

    model = TinyUNet().eval()
    export_onnx(model, torch.randn(2, 3, 16, 16), tmp_path / "m.onnx", dynamic_axes={"input": {2: "h", 3: "w"}})
    cfg = BuildConfig(backends=["torch"], torch=TorchConfig(flavour="compiled"))
    build_engine(
        tmp_path / "m.onnx",
        tmp_path / "e",
        "torch",
        "cpu",
        "fp32",
        cfg,
        tmp_path / "c",
        max_batch=2,
        torch_model=TinyUNet,
        axis_sizes={"h": [8, 16], "w": [8, 16]},
    )
    with load_engine(tmp_path / "e") as runner:
        for size in (8, 16):
            x = np.random.default_rng(size).standard_normal((1, 3, size, size)).astype(np.float32)
            with torch.inference_mode():
                want = model(torch.from_numpy(x)).numpy()
            np.testing.assert_allclose(runner.infer({"input": x})["logits"], want, atol=1e-5, rtol=1e-5)


def test_pipeline_validates_and_packages_the_torch_engine(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from kiln.pipeline.api import run_pipeline
    from kiln.pipeline.config import config_from_dict

    by_default = config_from_dict(tiny_config_dict(**{"build.backends": ["onnxruntime", "torch"]}))
    result, _ = run_pipeline(by_default, tmp_path)  # no GPU: the CPU is left to ONNX Runtime's engines
    build = json.loads((tmp_path / "build" / "manifest.json").read_text())["summary"]
    assert result.ok and any("torch-cpu-fp32: not built by default" in s for s in build["skipped"]), build
    said = [r for r in caplog.records if "not building torch-cpu-fp32" in r.getMessage()]
    assert said and said[0].levelname == "WARNING"  # the user named the backend: told, not only in report.md
    overrides = {"build.backends": ["onnxruntime", "torch"], "build.torch.devices": ["cpu"]}
    result, _ = run_pipeline(config_from_dict(tiny_config_dict(**overrides)), tmp_path)
    assert result.ok
    v = json.loads((tmp_path / "validate" / "validation.json").read_text())
    torch_engine = next(e for e in v["engines"] if e["backend"] == "torch")
    assert torch_engine["passed"] and torch_engine["cosine"] > 0.9999 and set(torch_engine["latency_ms"]) == {"1", "8"}
    packaged = {m["engine"] for m in json.loads((tmp_path / "package" / "kiln-package.json").read_text())["models"]}
    assert "torch-cpu-fp32" in packaged
    assert (tmp_path / "package" / "triton-python").is_dir()
    assert "torch-cpu-fp32" in (tmp_path / "report.md").read_text()


@pytest.mark.gpu
@pytest.mark.timeout(900)  # max-autotune benchmarks kernel choices per shape
# auto: an FP16 GPU engine is the compiled flavour (its default gemm_epilogues cannot go into a package). No GPU test
# builds a CUDA AOTInductor package: on the H200 host (torch 2.11) the ResNet-18 packages crashed their loader.
@pytest.mark.parametrize("flavour", ["auto", "compiled"])
def test_cuda_fp16_package_with_max_autotune(zoo, tmp_path: Path, flavour: str) -> None:
    cfg = BuildConfig(backends=["torch"], torch=TorchConfig(devices=["cuda"], flavour=flavour))
    meta = build_engine(
        zoo("cnn"), tmp_path / "e", "torch", "cuda", "fp16", cfg, tmp_path / "c", max_batch=32, torch_model=_cnn
    )
    assert meta.flavour == "compiled" and "aotinductor_failed" not in meta.builder_settings
    assert meta.builder_settings["max_autotune"] and meta.builder_settings["dtype"] == "float16"
    assert meta.builder_settings["freezing"] is False  # the default
    assert meta.builder_settings["coordinate_descent"] is True  # auto: the model has convolutions
    ref = ort.InferenceSession(str(zoo("cnn")), providers=["CPUExecutionProvider"])
    with load_engine(tmp_path / "e") as runner:
        for batch in (1, 32):
            x = sample("cnn", batch, seed=batch)
            got, want = runner.infer({"input": x})["logits"], ref.run(None, {"input": x})[0]
            assert got.dtype == np.float32 and got.shape == want.shape
            assert float(np.dot(got.ravel(), want.ravel()) / np.linalg.norm(got) / np.linalg.norm(want)) > 0.999
        assert np.median(runner.time_ms({"input": sample("cnn", 32)}, 3, 20)) > 0
        # a server's rows written into the runner's kept host buffer: page-locked, uploaded from there, read anew
        # at every call
        host = runner.host_inputs({"input": (32, 1, 8, 8)})
        assert host["input"].base.is_pinned() and runner.host_inputs({"input": (32, 1, 8, 8)}) is host
        for seed in (3, 4):
            x = sample("cnn", 32, seed=seed)
            host["input"][:] = x
            np.testing.assert_array_equal(runner.infer(host)["logits"], runner.infer({"input": x})["logits"])
        if meta.flavour == "compiled":  # CUDA graphs: a kept output survives the next replay (outputs are copied)
            assert meta.builder_settings["cuda_graphs"]
            first, graphed = runner.prepared({"input": sample("cnn", 1, seed=1)})
            assert graphed  # Kiln's own per-shape CUDA graph (GraphReplays)
            kept = first()
            again = kept.clone()
            second, _ = runner.prepared({"input": sample("cnn", 1, seed=2)})
            other = second()
            assert torch.equal(kept, again) and not torch.equal(kept, other)
