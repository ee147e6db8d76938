"""``package/ray/serve.yaml``: a Ray Serve config for the packaged engines, one application (one deployment) per
engine, each under the route Triton would give it (``/v2/models/<model>``). ``serve run serve.yaml`` starts it as
written, on this machine or, with ``RAY_ADDRESS`` set, on a Ray cluster; the application itself is
:func:`kiln.serve.ray_app.build_app` (Ray is needed to run it, not to write it).

Engine folders are named by absolute path (the workdir's ``package/engines``): on a cluster every node needs the
package at that path (a shared file system), as it needs ``kiln`` installed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from kiln.core.artifacts import write_text_atomic
from kiln.core.records import EngineMetadata
from kiln.stages.package.config import RayConfig

IMPORT_PATH = "kiln.serve.ray_app:build_app"
HEADER = """\
# Ray Serve config written by Kiln's package stage: one application per validated engine, KServe v2 JSON at
# POST http://HOST:PORT/v2/models/<model>/infer. Start it as it is:  serve run serve.yaml
# (on a Ray cluster: RAY_ADDRESS=... serve deploy serve.yaml; every node needs kiln and this package's path).
"""


def application(model: str, engine_dir: Path, meta: EngineMetadata, cfg: RayConfig) -> dict[str, Any]:
    """One engine's application: its route, the builder's args, the replicas and the GPUs each one takes."""
    gpus = cfg.gpus_per_replica if cfg.gpus_per_replica is not None else (1.0 if meta.device == "cuda" else 0.0)
    return {
        "name": model,
        "route_prefix": f"/v2/models/{model}",
        "import_path": IMPORT_PATH,
        "args": {
            "engine_dir": str(Path(engine_dir).resolve()),  # not relative to where `kiln run` ran
            "model_name": model,
            "replicas": cfg.replicas,
            "gpus_per_replica": gpus,
            "cpus_per_replica": cfg.cpus_per_replica,
            "max_batch_size": cfg.max_batch_size,
            "batch_wait_timeout_s": cfg.batch_wait_timeout_s,
        },
    }


def serve_config(apps: list[dict[str, Any]], cfg: RayConfig) -> dict[str, Any]:
    return {"proxy_location": "EveryNode", "http_options": {"host": cfg.host, "port": cfg.port}, "applications": apps}


def write_serve_config(target: Path, apps: list[dict[str, Any]], cfg: RayConfig) -> None:
    text = HEADER + yaml.safe_dump(serve_config(apps, cfg), sort_keys=False)
    write_text_atomic(target / "serve.yaml", text)
