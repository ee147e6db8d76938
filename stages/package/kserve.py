"""``package/kserve.yaml``: a KServe ``InferenceService`` (serving.kserve.io/v1beta1) whose Triton predictor serves
the stock Triton repository (``package/triton``) from ``package.kserve.storage_uri``, where the user copies it.

:func:`check_manifest` holds the fields KServe v1beta1 requires for a Triton predictor; the manifest is checked
when written (no cluster runs here to refuse it later).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from kiln.core.artifacts import write_text_atomic
from kiln.core.errors import ConfigError
from kiln.stages.package.config import STORAGE_SCHEMES, KServeConfig

API_VERSION = "serving.kserve.io/v1beta1"
# Kubernetes names of InferenceServices: a DNS-1035 label (KServe prefixes it into Service names)
DNS_1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


def service_name(run_name: str) -> str:
    """The run's name as a DNS-1035 label: lower case, '-' for anything else, at most 45 characters (KServe adds
    suffixes such as ``-predictor-00001`` to it)."""
    name = re.sub(r"[^a-z0-9]+", "-", run_name.lower()).strip("-")
    name = name if name[:1].isalpha() else f"kiln-{name}".rstrip("-")
    return name[:45].rstrip("-") or "kiln"


def manifest(run_name: str, cfg: KServeConfig, gpu_models: bool) -> dict[str, Any]:
    """The InferenceService: a ``triton`` model format predictor on the repository at ``storage_uri``."""
    resources: dict[str, Any] = {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"cpu": "2", "memory": "4Gi"}}
    if gpu_models and cfg.gpus:
        resources["limits"]["nvidia.com/gpu"] = str(cfg.gpus)
    doc = {
        "apiVersion": API_VERSION,
        "kind": "InferenceService",
        "metadata": {"name": service_name(run_name), "labels": {"app.kubernetes.io/managed-by": "kiln"}},
        "spec": {
            "predictor": {
                "model": {
                    "modelFormat": {"name": "triton"},
                    "protocolVersion": "v2",
                    "storageUri": cfg.storage_uri,
                    "resources": resources,
                }
            }
        },
    }
    check_manifest(doc)
    return doc


def check_manifest(doc: dict[str, Any]) -> None:
    """Raise :class:`ConfigError` where ``doc`` lacks what KServe v1beta1 requires of a Triton predictor."""
    problems = []
    if doc.get("apiVersion") != API_VERSION or doc.get("kind") != "InferenceService":
        problems.append(f"apiVersion/kind must be {API_VERSION} InferenceService")
    name = doc.get("metadata", {}).get("name", "")
    if not (isinstance(name, str) and DNS_1035.fullmatch(name) and len(name) <= 63):
        problems.append(f"metadata.name '{name}' is not a DNS-1035 label")
    predictor = doc.get("spec", {}).get("predictor", {})
    model = predictor.get("model") if isinstance(predictor, dict) else None
    if not isinstance(model, dict) or model.get("modelFormat", {}).get("name") != "triton":
        problems.append("spec.predictor.model.modelFormat.name must be 'triton'")
    elif not str(model.get("storageUri", "")).startswith(STORAGE_SCHEMES):
        problems.append(f"spec.predictor.model.storageUri '{model.get('storageUri')}' is not one of {STORAGE_SCHEMES}")
    elif model.get("protocolVersion", "v2") not in ("v1", "v2", "grpc-v2"):
        problems.append(f"protocolVersion {model.get('protocolVersion')} is not v1, v2 or grpc-v2")
    if problems:
        raise ConfigError(f"the KServe manifest is not valid: {'; '.join(problems)}", hint="check package.kserve")


def write_manifest(target: Path, run_name: str, cfg: KServeConfig, gpu_models: bool) -> None:
    header = (
        "# KServe InferenceService written by Kiln: serves package/triton; copy that folder to "
        f"{cfg.storage_uri} first (package.kserve.storage_uri), then: kubectl apply -f kserve.yaml\n"
    )
    write_text_atomic(target, header + yaml.safe_dump(manifest(run_name, cfg, gpu_models), sort_keys=False))
