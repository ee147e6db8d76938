"""Triton configs are checked against the engine they serve when written, and parse as Triton's ModelConfig."""

from __future__ import annotations

from typing import Any

import pytest
from google.protobuf import text_format

from kiln.core.errors import ModelError
from kiln.core.records import EngineMetadata, TensorSpec
from kiln.stages.package.triton import (
    check_config,
    model_config,
    render_pbtxt,
    served_max_batch,
    triton_config,
    unbatchable_reason,
)

# Triton's own ModelConfig message: from the serving extra (`pip install 'kiln[serve]'`, part of `.[dev]`)
model_config_pb2 = pytest.importorskip(
    "tritonclient.grpc.model_config_pb2", reason="needs tritonclient (pip install 'kiln[serve]')"
)


def record(fields: dict[str, Any]) -> EngineMetadata:
    return EngineMetadata(
        precision="fp32",
        source={"file": "m.onnx", "sha256": "0"},
        files={"model": "engine"},
        flavour=fields["backend"],
        versions={},
        **fields,
    )


CPU_FIELDS = {
    "name": "e",
    "backend": "onnxruntime",
    "device": "cpu",
    "inputs": [{"name": "input", "shape": ["batch", 1, 8, 8], "dtype": "float32"}],
    "outputs": [{"name": "logits", "shape": ["batch", 10], "dtype": "float32"}],
}
TRT_FIELDS = {
    "name": "t",
    "backend": "tensorrt",
    "device": "cuda",
    "batch_range": (1, 16),
    "inputs": [{"name": "input", "shape": ["batch", 3, 8, 8], "dtype": "float16"}],
    "outputs": [{"name": "logits", "shape": ["batch", 10], "dtype": "float16"}],
}


CPU, TRT = record(CPU_FIELDS), record(TRT_FIELDS)


def parse(text: str) -> Any:
    return text_format.Parse(text, model_config_pb2.ModelConfig())


@pytest.mark.parametrize("backend", [None, "python"])
def test_configs_parse_as_triton_model_config(backend: str | None) -> None:
    cfg = parse(render_pbtxt(model_config("m", TRT, 32, backend=backend, queue_delay_us=250)))
    assert cfg.max_batch_size == 16  # capped by the engine's profile
    assert list(cfg.input[0].dims) == [3, 8, 8] and cfg.input[0].data_type == model_config_pb2.TYPE_FP16
    assert cfg.dynamic_batching.max_queue_delay_microseconds == 250
    assert cfg.instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_GPU
    assert (cfg.backend, cfg.platform) == (("python", "") if backend else ("", "tensorrt_plan"))


@pytest.mark.parametrize("backend", [None, "python"])
def test_tensor_names_with_quotes_backslashes_and_control_characters_parse_back_unchanged(backend: str | None) -> None:
    """ONNX allows any string as a tensor name; the config's string literals escape what protobuf's text format
    requires, so Triton reads the names the engine has."""
    names = ['pixel "values" é', "back\\slash\tand\nnewline\x01\x7f", "it's"]
    meta = CPU.model_copy(deep=True)
    meta.inputs = [meta.inputs[0].model_copy(update={"name": name}) for name in names]
    meta.outputs[0].name = 'logits "final"'
    cfg = parse(render_pbtxt(model_config('m "1"', meta, 32, backend=backend)))
    assert [t.name for t in cfg.input] == names and cfg.output[0].name == 'logits "final"'
    assert cfg.name == 'm "1"'


def test_a_fixed_batch_model_is_served_unbatched_with_its_full_shape() -> None:
    meta = CPU.model_copy(deep=True)
    meta.inputs[0].shape[0] = 1
    meta.outputs[0].shape[0] = 1
    cfg = parse(triton_config("m", meta, 32))
    assert cfg.max_batch_size == 0 and list(cfg.input[0].dims) == [1, 1, 8, 8]
    assert not cfg.HasField("dynamic_batching")


@pytest.mark.parametrize("found, shape", [(True, ["u0", 2]), (False, [])])
def test_an_output_whose_rows_are_not_the_samples_is_served_unbatched(found: bool, shape: list) -> None:
    """Validation found it (torch.nonzero's data-dependent length: the package records it in the engine), or it
    has no batch axis at all (a scalar)."""
    meta = CPU.model_copy(deep=True)
    meta.outputs.append(meta.outputs[0].model_copy(update={"name": "positives", "shape": shape}))
    meta.unbatched_outputs = ["positives"] if found else []
    cfg = parse(triton_config("m", meta, 32))
    assert cfg.max_batch_size == 0 and list(cfg.input[0].dims) == [-1, 1, 8, 8]  # a request's own batch, whole
    assert not cfg.HasField("dynamic_batching")
    other = CPU.model_copy(deep=True)  # an output whose batch axis another exporter named otherwise: batched
    other.outputs[0].shape[0] = "unk__7"
    assert parse(triton_config("m", other, 32)).max_batch_size == 32


TWO_TOWERS = record(
    {
        "name": "tt",
        "backend": "onnxruntime",
        "device": "cpu",
        "validated_batch_sizes": [1, 8],
        "inputs": [
            {"name": "ids", "shape": ["texts", "seq"], "dtype": "int64"},
            {"name": "mask", "shape": ["texts", "seq"], "dtype": "int64"},
            {"name": "pixels", "shape": ["images", 3, 8, 8], "dtype": "float32"},
        ],
        "outputs": [
            {"name": "text_embeds", "shape": ["texts", 16], "dtype": "float32"},
            {"name": "image_embeds", "shape": ["images", 16], "dtype": "float32"},
        ],
    }
)


@pytest.mark.parametrize("backend", [None, "python"])
def test_inputs_in_counts_of_their_own_are_served_unbatched(backend: str | None) -> None:
    """A two-tower model's texts and images (first axes of names of their own): Triton's batcher takes one batch
    size per request and would refuse 5 texts with 2 images, so the model is served whole, with its full shapes."""
    assert served_max_batch(TWO_TOWERS, 32) == 0
    cfg = parse(render_pbtxt(model_config("m", TWO_TOWERS, 32, backend=backend)))
    assert cfg.max_batch_size == 0 and not cfg.HasField("dynamic_batching")
    assert {t.name: list(t.dims) for t in [*cfg.input, *cfg.output]} == {
        "ids": [-1, -1],
        "mask": [-1, -1],
        "pixels": [-1, 3, 8, 8],
        "text_embeds": [-1, 16],
        "image_embeds": [-1, 16],
    }
    forced = model_config("m", TWO_TOWERS, 32, backend=backend)
    forced |= {"max_batch_size": 8, "dynamic_batching": {"max_queue_delay_microseconds": 100}}
    with pytest.raises(ModelError, match=r"max_batch_size 8 but .* first axes are \['texts', 'images'\]"):
        check_config(forced, TWO_TOWERS)


@pytest.mark.parametrize("where", ["inputs", "outputs"])
def test_a_tensor_of_the_batch_axis_alone_is_served_unbatched_with_valid_dims(where: str) -> None:
    """A per-sample scalar (``[batch]``: an age input, a regression's squeezed output) had ``dims: []`` in a batched
    config, which Triton refuses to load."""
    meta = CPU.model_copy(deep=True)
    getattr(meta, where).append(TensorSpec(name="age", shape=["batch"], dtype="float32"))
    for backend in (None, "python"):
        cfg = parse(render_pbtxt(model_config("m", meta, 32, backend=backend)))
        tensors = {t.name: list(t.dims) for t in [*cfg.input, *cfg.output]}
        assert cfg.max_batch_size == 0 and tensors["age"] == [-1] and tensors["input"] == [-1, 1, 8, 8], tensors


@pytest.mark.parametrize("backend", [None, "python"])
def test_the_config_offers_no_batch_past_the_largest_validated(backend: str | None) -> None:
    """Validated at batches 1 and 8, an engine whose runtime takes any batch is served up to 8, not the 32 asked
    for; one whose metadata predates validated batches keeps what was asked for."""
    meta = CPU.model_copy(update={"validated_batch_sizes": [1, 8]})
    assert parse(render_pbtxt(model_config("m", meta, 32, backend=backend))).max_batch_size == 8
    assert parse(render_pbtxt(model_config("m", meta, 4, backend=backend))).max_batch_size == 4
    assert parse(render_pbtxt(model_config("m", CPU, 32, backend=backend))).max_batch_size == 32
    cfg = model_config("m", meta, 8, backend=backend)
    cfg["max_batch_size"] = 32
    with pytest.raises(ModelError, match=r"exceeds the largest batch the engine was validated at \(8\)") as err:
        check_config(cfg, meta)
    assert "signature.batch_sizes" in str(err.value.hint)


def test_engines_that_cannot_take_one_request_are_refused() -> None:
    meta = TRT.model_copy(deep=True)
    meta.batch_range = (4, 16)
    with pytest.raises(ModelError, match="takes batches from 4"):
        model_config("m", meta, 32)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c.update(max_batch_size=64), "exceeds the engine's profile maximum 16"),
        (lambda c: c["input"][0].update(dims=[3, 8, 9]), "dims"),
        (lambda c: c["output"][0].update(data_type="TYPE_FP32"), "the engine takes float16"),
        (lambda c: c.pop("dynamic_batching"), "dynamic_batching"),
        (lambda c: c["instance_group"][0].update(kind="KIND_CPU"), "want KIND_GPU"),
        (lambda c: c.update(platform="onnxruntime_onnx"), "cannot run a tensorrt engine"),
        (lambda c: c["input"][0].update(name="x"), "input names"),
    ],
)
def test_a_config_that_disagrees_with_its_engine_is_caught(edit: Any, message: str) -> None:
    cfg = model_config("m", TRT, 8)
    edit(cfg)
    with pytest.raises(ModelError, match=message):
        check_config(cfg, TRT)


def test_unsupported_dtype_is_a_clear_error() -> None:
    meta = CPU.model_copy(deep=True)
    meta.inputs[0].dtype = "bfloat16"
    with pytest.raises(ModelError, match="bfloat16"):
        model_config("m", meta, 8)


def test_the_backend_registration_decides_which_engines_stock_triton_loads() -> None:
    from kiln.stages.package.triton import stock_model

    rtx = TRT.model_copy(update={"flavour": "tensorrt_rtx"})
    assert stock_model(TRT).platform == "tensorrt_plan" and stock_model(CPU).platform == "onnxruntime_onnx"
    assert stock_model(rtx) is None  # Triton's tensorrt_plan backend is full TensorRT: no RTX engines
    with pytest.raises(ModelError, match="platform tensorrt_plan cannot run"):
        check_config(model_config("m", TRT, 8), rtx)


def test_kiln_serve_gpus_0_and_1_gives_one_endpoint_with_instances_on_both(tmp_path: Any) -> None:
    """What `kiln serve --gpus 0,1 --instances-per-gpu 2` serves, checked on CPU: each model's instance group lists
    both GPUs, two instances on each, in the Python-backend repository it starts, pinned per instance."""
    from kiln.serve.server import ServedEngine, write_repository

    engine = tmp_path / "engine"
    engine.mkdir()
    (engine / "engine").write_bytes(b"plan")
    served = [ServedEngine("t", engine, TRT)]
    assert write_repository(tmp_path / "repo", served, [0, 1], 2, 32, 100) == ["t"]
    cfg = parse((tmp_path / "repo" / "t" / "config.pbtxt").read_text())
    [group] = cfg.instance_group
    assert group.kind == model_config_pb2.ModelInstanceGroup.KIND_GPU
    assert (group.count, list(group.gpus)) == (2, [0, 1]) and cfg.backend == "python"
    model_py = (tmp_path / "repo" / "t" / "1" / "model.py").read_text()
    assert 'os.environ["CUDA_VISIBLE_DEVICES"] = str(args["model_instance_device_id"])' in model_py


def test_gpus_are_refused_for_a_cpu_engine_and_checked_against_the_machine(tmp_path: Any) -> None:
    from kiln.core.errors import BackendUnavailable, ConfigError
    from kiln.serve.server import ServedEngine, parse_gpus, write_repository

    with pytest.raises(ModelError, match="CUDA engines only"):
        model_config("m", CPU, 32, backend="python", gpus=[0])
    with pytest.raises(ConfigError, match="--gpus serves CUDA engines"):
        write_repository(tmp_path, [ServedEngine("e", tmp_path, CPU)], [0], 1, 32, 100)
    assert parse_gpus("all", visible=2) == [0, 1] and parse_gpus("1", visible=2) == [1]
    with pytest.raises(ConfigError, match="GPU 2 is not visible"):
        parse_gpus("0,2", visible=2)
    with pytest.raises(ConfigError, match="listed twice"):
        parse_gpus("1,1", visible=2)
    with pytest.raises(BackendUnavailable, match="no CUDA GPU"):
        parse_gpus("all", visible=0)


def test_instances_default_to_eight_per_gpu_within_the_cores_and_one_on_the_cpu() -> None:
    from kiln.serve.server import default_instances

    assert default_instances([0], cores=16) == 8 and default_instances([0, 1], cores=16) == 4
    assert default_instances([0, 1], cores=64) == 8 and default_instances([0], cores=2) == 1
    assert default_instances(None, cores=64) == 1


def test_batches_default_to_a_few_requests_per_gpu_stub_and_larger_on_the_cpu() -> None:
    from kiln.serve.server import CPU_MAX_BATCH, GPU_STUB_MAX_BATCH, default_max_batch

    assert default_max_batch([0]) == default_max_batch([0, 1]) == GPU_STUB_MAX_BATCH < CPU_MAX_BATCH
    assert default_max_batch(None) == CPU_MAX_BATCH


def test_a_per_sample_scalar_input_is_said_to_need_a_reshape() -> None:
    """A ``[batch]`` input (a diffusion model's timestep) keeps the engine unbatched; the reason names what would
    batch it, and what Triton's reshape would ask of clients."""
    fields = {**CPU_FIELDS, "inputs": [*CPU_FIELDS["inputs"], {"name": "t", "shape": ["batch"], "dtype": "int64"}]}
    why = unbatchable_reason(record(fields))
    assert why is not None and "input 't' is [batch]" in why
    assert "dims [1] reshaped to []" in why and "exported as [batch, 1]" in why
    assert unbatchable_reason(CPU) is None
