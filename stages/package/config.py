"""The ``package:`` config section: which serving repositories and manifests the package stage writes."""

from __future__ import annotations

from pydantic import Field, ValidationInfo, field_validator

from kiln.core.sections import Section
from kiln.core.signature import HintedValueError

# The schemes KServe's storage initializer reads a model repository from (kserve.check_manifest holds the manifest
# to them too)
STORAGE_SCHEMES = ("s3://", "gs://", "pvc://", "https://", "http://", "hdfs://", "webhdfs://", "oci://")


class RayConfig(Section):
    """``package.ray``: the Ray Serve application (``package/ray/serve.yaml``), one deployment per engine."""

    enabled: bool = Field(True, description="write package/ray/serve.yaml (`serve run serve.yaml` starts it)")
    replicas: int = Field(1, ge=1, description="replicas of each engine's deployment")
    gpus_per_replica: float | None = Field(
        None, ge=0, description="GPUs each replica reserves (default: 1 for a CUDA engine, 0 for a CPU one)"
    )
    cpus_per_replica: float = Field(
        1.0,
        ge=0,
        description="CPUs each replica reserves in Ray's scheduler: Ray starts no replica the cluster has no CPUs "
        "left for (below 1 fits more replicas than cores; the engine's threads are not limited by it)",
    )
    max_batch_size: int = Field(32, ge=0, description="most rows @serve.batch puts in one engine call (0: no batching)")
    batch_wait_timeout_s: float = Field(0.002, ge=0, le=10, description="how long a request waits for batch mates")
    host: str = Field("127.0.0.1", description="the HTTP address Ray Serve listens on (0.0.0.0: every interface)")
    port: int = Field(8000, ge=1, le=65535, description="Ray Serve's HTTP port")


class KServeConfig(Section):
    """``package.kserve``: a KServe InferenceService manifest for the Triton repository (``package/kserve.yaml``)."""

    enabled: bool = Field(True, description="write package/kserve.yaml")
    storage_uri: str = Field(
        "pvc://kiln-models/triton",
        description="where the cluster finds package/triton (s3://, gs://, pvc://, https://): copy it there",
    )
    gpus: int = Field(1, ge=0, description="GPUs the predictor asks for (0: a CPU predictor)")

    @field_validator("storage_uri")
    @classmethod
    def _known_scheme(cls, uri: str, info: ValidationInfo) -> str:
        # The manifest check would refuse it only when the package stage writes kserve.yaml, after the whole run.
        if info.data.get("enabled", True) and not uri.startswith(STORAGE_SCHEMES):
            raise HintedValueError(
                f"'{uri}' is not a storage URI KServe reads (it takes {', '.join(STORAGE_SCHEMES)})",
                hint="set package.kserve.storage_uri to s3://..., gs://..., pvc://... (or package.kserve.enabled: "
                "false)",
            )
        return uri


class PackageConfig(Section):
    enabled: bool = True
    triton: bool = Field(True, description="write a Triton model repository for the stock backends (triton/)")
    triton_python: bool = Field(
        True,
        description="write a Triton Python-backend repository running the Kiln engines "
        "as validated (triton-python/; needs kiln in Triton's Python)",
    )
    max_batch_size: int = Field(32, ge=0)
    ray: RayConfig = Field(default_factory=RayConfig)
    kserve: KServeConfig = Field(default_factory=KServeConfig)
