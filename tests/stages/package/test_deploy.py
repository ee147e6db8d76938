"""The package stage's Ray Serve config and KServe manifest: what `serve run` and `kubectl apply` are given."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from kiln.core.errors import ConfigError
from kiln.core.records import TensorSpec
from kiln.pipeline.api import run_pipeline
from kiln.pipeline.config import config_from_dict
from kiln.stages.package.config import KServeConfig, RayConfig
from kiln.stages.package.kserve import check_manifest, manifest, service_name
from tests.conftest import tiny_config_dict
from tests.stages.package.test_triton import CPU, TRT

# What KServe v1beta1 requires of an InferenceService with a Triton predictor (its CRD's required fields and
# the model spec's): checked here against the written manifest, since no cluster runs in these tests.
REQUIRED = [
    ("apiVersion",),
    ("kind",),
    ("metadata", "name"),
    ("spec", "predictor", "model", "modelFormat", "name"),
    ("spec", "predictor", "model", "storageUri"),
]


def dig(doc: dict[str, Any], path: tuple[str, ...]) -> Any:
    for key in path:
        doc = doc[key]
    return doc


def test_the_kserve_manifest_has_what_a_triton_predictor_requires() -> None:
    doc = manifest("My Run_2", KServeConfig(storage_uri="s3://bucket/triton", gpus=1), gpu_models=True)
    for path in REQUIRED:
        assert dig(doc, path), path
    assert (doc["apiVersion"], doc["kind"]) == ("serving.kserve.io/v1beta1", "InferenceService")
    assert doc["metadata"]["name"] == "my-run-2"
    model = doc["spec"]["predictor"]["model"]
    assert model["modelFormat"]["name"] == "triton" and model["protocolVersion"] == "v2"
    assert model["resources"]["limits"]["nvidia.com/gpu"] == "1"
    cpu = manifest("demo", KServeConfig(), gpu_models=False)["spec"]["predictor"]["model"]["resources"]
    assert "nvidia.com/gpu" not in cpu["limits"]


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d.update(kind="Service"), "apiVersion/kind"),
        (lambda d: d["metadata"].update(name="Bad_Name"), "DNS-1035"),
        (lambda d: d["spec"]["predictor"]["model"]["modelFormat"].update(name="onnx"), "modelFormat"),
        (lambda d: d["spec"]["predictor"]["model"].update(storageUri="/local/path"), "storageUri"),
    ],
)
def test_a_manifest_kserve_would_refuse_is_caught(edit: Any, message: str) -> None:
    doc = manifest("demo", KServeConfig(), gpu_models=False)
    edit(doc)
    with pytest.raises(ConfigError, match=message):
        check_manifest(doc)


def test_service_names_are_dns_labels() -> None:
    assert service_name("9lives") == "kiln-9lives" and service_name("___") == "kiln"
    assert len(service_name("x" * 100)) <= 45


def test_ray_applications_take_replicas_and_gpus_from_the_config() -> None:
    from kiln.stages.package.rayserve import application

    cfg = RayConfig(replicas=3, max_batch_size=16, batch_wait_timeout_s=0.005)
    gpu = application("m", TRT, cfg)
    assert gpu["route_prefix"] == "/v2/models/m" and gpu["import_path"] == "kiln.serve.ray_app:build_app"
    assert gpu["args"] == {
        "engine_dir": "engines/t",  # relative to the package folder: the package is self-contained
        "model_name": "m",
        "replicas": 3,
        "gpus_per_replica": 1.0,
        "cpus_per_replica": 1.0,
        "max_batch_size": 16,
        "batch_wait_timeout_s": 0.005,
    }
    assert application("m", CPU, cfg)["args"]["gpus_per_replica"] == 0.0
    validated = CPU.model_copy(update={"validated_batch_sizes": [1, 8]})  # batches past 8 are not offered
    assert application("m", validated, cfg)["args"]["max_batch_size"] == 8
    assert application("m", CPU, cfg)["args"]["max_batch_size"] == 16  # no sizes recorded: as configured
    # an output without a batch axis (a bi-encoder's score [batch] is one): the replica runs each request whole,
    # and the config says so
    scalar = CPU.model_copy(update={"outputs": [*CPU.outputs, TensorSpec(name="n", shape=[], dtype="int64")]})
    assert application("m", scalar, cfg)["args"]["max_batch_size"] == 0
    assert application("m", TRT, RayConfig(gpus_per_replica=0.5))["args"]["gpus_per_replica"] == 0.5


def test_a_packaged_run_writes_the_ray_config_and_the_manifest(tmp_path: Path) -> None:
    result, _ = run_pipeline(config_from_dict(tiny_config_dict()), tmp_path / "run")
    assert result.ok
    package = tmp_path / "run" / "package"
    serve = yaml.safe_load((package / "ray" / "serve.yaml").read_text())
    assert "pip install 'kiln[ray]'" in (package / "ray" / "serve.yaml").read_text()  # what `serve run` needs
    [app] = [a for a in serve["applications"] if a["args"].get("engine_dir", "").endswith("onnxruntime-cpu-fp32")]
    assert (package / app["args"]["engine_dir"]).is_dir()  # the packaged folder, not the stage's staging one
    assert app["route_prefix"] == f"/v2/models/{app['args']['model_name']}"
    assert serve["logging_config"] == {"enable_access_log": False}  # no line per request on serve run's stderr
    health = serve["applications"][-1]  # the server's /v2/health routes, beside the engines' applications
    assert health["route_prefix"] == "/v2/health" and health["import_path"].endswith(":build_health")
    ray_schema = pytest.importorskip("ray.serve.schema", reason="ray[serve] (kiln[ray]) is not installed")
    ray_schema.ServeDeploySchema.model_validate(serve)  # what `serve run` reads the file as
    check_manifest(yaml.safe_load((package / "kserve.yaml").read_text()))


def test_a_package_copied_elsewhere_serves_its_own_engines_through_ray(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The package copied to another folder and the run that wrote it deleted (a package shipped to another
    machine): each application of its serve.yaml, built as `serve run ray/serve.yaml` started in the copy builds it,
    opens its engine from the copy and answers; started anywhere else, the replica says where to start it."""
    pytest.importorskip("ray.serve", reason="needs Ray Serve (pip install 'kiln[ray]'; part of .[dev])")
    import numpy as np

    from kiln.core.errors import InputFileError
    from kiln.serve.ray_app import KilnEngine, build_app

    result, _ = run_pipeline(config_from_dict(tiny_config_dict()), tmp_path / "run")
    assert result.ok
    shipped = tmp_path / "elsewhere" / "package"
    shutil.copytree(tmp_path / "run" / "package", shipped)
    shutil.rmtree(tmp_path / "run")
    serve = yaml.safe_load((shipped / "ray" / "serve.yaml").read_text())
    monkeypatch.chdir(shipped)  # a local Ray cluster's processes run where `serve run` started
    for app in (a for a in serve["applications"] if a["import_path"].endswith(":build_app")):
        engine_dir, *rest = build_app(app["args"])._bound_deployment.init_args
        replica = KilnEngine.func_or_class(engine_dir, *rest)
        try:
            assert replica.meta.name == Path(engine_dir).name
            x = np.zeros((2, 1, 8, 8), np.float32)
            assert replica._run({"input": x})[replica.meta.outputs[0].name].shape == (2, 10)
        finally:
            replica.runner.deactivate()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InputFileError, match="is not a Kiln engine folder here") as err:
        KilnEngine.func_or_class(*build_app(serve["applications"][0]["args"])._bound_deployment.init_args)
    assert "cd <package> && serve run ray/serve.yaml" in str(err.value.hint)
