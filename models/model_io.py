"""Load/save the trained model and find the run's dataset: the contract between train and later stages.

The train stage writes ``model.safetensors`` (state dict) and ``model.json`` (how to rebuild the module).
Checkpoints are read with safetensors or ``torch.load(weights_only=True)``: never arbitrary pickles.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from kiln.core.artifacts import write_bytes_atomic
from kiln.core.data import DatasetSplits
from kiln.core.errors import ConfigError, InputFileError
from kiln.models.registry import DATASETS, DEFAULT_DATASET, build_model, load_dataset
from torch import nn

if TYPE_CHECKING:  # the config assembles every stage's section and sits above them; types only
    from kiln.config import KilnConfig

WEIGHTS = "model.safetensors"
SPEC = "model.json"


def dataset_for(config: KilnConfig) -> DatasetSplits:
    name = config.data.name or DEFAULT_DATASET.get(config.model.name)
    if name is None:
        raise ConfigError(f"no dataset configured for model '{config.model.name}'",
                          hint="set data.name to a built-in dataset or 'package.module:function'")
    params = dict(config.data.params)
    params.setdefault("seed", config.seed) if name in DATASETS else None  # built-ins split by the run seed
    return load_dataset(name, params, config.export.dynamic_axes)


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise InputFileError(f"checkpoint not found: {path}", hint="fix model.checkpoint")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path))
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # corrupt or not a checkpoint: a user problem, not a Kiln bug
        reason = _load_failure(exc)
        raise InputFileError(f"cannot read checkpoint {path}: {reason}",
                             hint="give a safetensors file or a torch.save'd state_dict") from None
    if isinstance(state, dict) and "model" in state and isinstance(state["model"], dict):
        state = state["model"]
    if not isinstance(state, dict):
        raise InputFileError(f"checkpoint {path} holds {type(state).__name__}, not a state dict",
                             hint="save with torch.save(model.state_dict(), path)")
    return state


def _load_failure(exc: Exception) -> str:
    """The useful line of a load error. torch's weights-only refusal opens with advice to pass
    ``weights_only=False`` (which would run code from the file): Kiln never does, so give what it unpickled."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    if lines and lines[0].startswith("Weights only load failed"):
        detail = next((ln for ln in lines[1:] if not ln.startswith(("Please file", "Check the documentation"))),
                      "")
        return f"not a plain state dict (torch.load with weights_only=True: {detail or 'refused'})"
    return (lines or [type(exc).__name__])[0][:300]


def load_weights(model: nn.Module, state: dict[str, torch.Tensor], source: str) -> nn.Module:
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:
        first = " ".join(str(exc).splitlines()[0:3])
        first = first if len(first) <= 400 else first[:400] + " ..."  # it lists every missing key
        raise ModelShapeError(f"checkpoint {source} does not fit model: {first}") from None
    return model


class ModelShapeError(InputFileError):
    def __init__(self, message: str) -> None:
        super().__init__(message, hint="check model.name/model.params match the checkpoint's architecture")


def save_trained(out: Path, model: nn.Module, config: KilnConfig, extra: dict[str, Any] | None = None) -> None:
    from safetensors.torch import save

    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    # save() + our atomic write rather than save_file(): that one leaves a 0600 file a server cannot read
    write_bytes_atomic(out / WEIGHTS, save(state))
    spec = {"model": config.model.name, "params": config.model.params, **(extra or {})}
    (out / SPEC).write_text(json.dumps(spec, indent=2, sort_keys=True))


def load_trained(train_dir: Path, config: KilnConfig) -> nn.Module:
    """Rebuild the model from the config and load the train stage's weights; eval mode, FP32, CPU."""
    model = build_model(config.model.name, config.model.params)
    load_weights(model, read_state_dict(train_dir / WEIGHTS), str(train_dir / WEIGHTS))
    return model.float().eval()
