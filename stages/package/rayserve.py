"""``package/ray/serve.yaml``: a Ray Serve config for the packaged engines, one application (one deployment) per
engine, each under the route Triton would give it (``/v2/models/<model>``). Started from the package folder,
``serve run ray/serve.yaml`` runs it as written, on this machine or, with ``RAY_ADDRESS`` set, on a Ray cluster; the
application itself is :func:`kiln.serve.ray_app.build_app` (Ray is needed to run it, not to write it).

Engine folders are named relative to the package folder (``engines/<engine>``), so that the package is
self-contained: copied or moved anywhere, it serves its own engines. The replicas resolve the path from the working
directory of Ray's processes, which must be the package folder: a Ray cluster ``serve run`` starts runs where
``serve run`` ran; on a cluster started elsewhere, an application's ``runtime_env.working_dir`` names the package
(``local:///shared/path/package``, or the package zipped at ``s3://...``). A Serve config cannot name a local folder
any other way (Ray takes only URIs there), and an absolute path would keep serving the folder the package was written
in after the package moved.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from kiln.core.artifacts import write_text_atomic
from kiln.core.records import EngineMetadata
from kiln.stages.package.config import RayConfig
from kiln.stages.package.triton import served_max_batch

IMPORT_PATH = "kiln.serve.ray_app:build_app"
# KServe v2's server-level routes (/v2/health/live, /v2/health/ready) as an application of their own
HEALTH_APP = "kiln-health"
HEALTH_IMPORT_PATH = "kiln.serve.ray_app:build_health"
ENGINES = "engines"  # the package's engine folders, one per engine, beside ray/
HEADER = """\
# Ray Serve config written by Kiln's package stage: one application per validated engine, KServe v2 JSON at
# POST http://HOST:PORT/v2/models/<model>/infer, and kiln-health: GET /v2/health/ready once all of them run.
# Start it from the package folder (engine_dir is relative to it), with Ray Serve installed (pip install 'kiln[ray]'):
#   cd <package> && serve run ray/serve.yaml
# (on a Ray cluster: RAY_ADDRESS=... serve deploy ray/serve.yaml, each application's runtime_env.working_dir naming
# the package, e.g. local:///shared/path/package; every node needs kiln installed).
"""


def application(model: str, meta: EngineMetadata, cfg: RayConfig, max_batch: int | None = None) -> dict[str, Any]:
    """One engine's application: its route, the builder's args (the engine folder relative to the package folder;
    batches no larger than the engine takes and was validated for, as the replica forms them:
    :func:`~kiln.stages.package.triton.served_max_batch` of ``max_batch``, else of ``ray.max_batch_size``), the
    replicas and the GPUs each one takes."""
    gpus = cfg.gpus_per_replica if cfg.gpus_per_replica is not None else (1.0 if meta.device == "cuda" else 0.0)
    return {
        "name": model,
        "route_prefix": f"/v2/models/{model}",
        "import_path": IMPORT_PATH,
        "args": {
            "engine_dir": f"{ENGINES}/{meta.name}",
            "model_name": model,
            "replicas": cfg.replicas,
            "gpus_per_replica": gpus,
            "cpus_per_replica": cfg.cpus_per_replica,
            # 0: an engine that cannot batch requests (an output without a batch axis) runs each one whole
            "max_batch_size": served_max_batch(meta, cfg.max_batch_size if max_batch is None else max_batch),
            "batch_wait_timeout_s": cfg.batch_wait_timeout_s,
        },
    }


def serve_config(apps: list[dict[str, Any]], cfg: RayConfig) -> dict[str, Any]:
    # Ray's access log writes a line per request on serve run's stderr (thousands a second under load): off, as
    # Triton's front end logs none; errors are still logged
    logging_config = {"enable_access_log": False}
    return {
        "proxy_location": "EveryNode",
        "http_options": {"host": cfg.host, "port": cfg.port},
        "logging_config": logging_config,
        "applications": [*apps, health_application()],
    }


def health_application() -> dict[str, Any]:
    """The server's health routes, as Triton serves them: ready once every engine's application runs."""
    return {"name": HEALTH_APP, "route_prefix": "/v2/health", "import_path": HEALTH_IMPORT_PATH, "args": {}}


def write_serve_config(target: Path, apps: list[dict[str, Any]], cfg: RayConfig) -> None:
    text = HEADER + yaml.safe_dump(serve_config(apps, cfg), sort_keys=False)
    write_text_atomic(target / "serve.yaml", text)
