"""Name -> factory tables for models and datasets, and ``package.module:function`` resolution.

Plain dicts on purpose: a reader (or a type checker) sees every built-in in one place.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable

from torch import nn

from models.cnn import resnet18, small_cnn
from models.datasets import DatasetSplits, digits, digits_ids, synthetic
from models.mlp import mlp_embed
from models.transformer import bert_base, transformer
from pipeline.errors import ConfigError

MODELS: dict[str, Callable[..., nn.Module]] = {
    "cnn": small_cnn,
    "resnet18": resnet18,
    "transformer": transformer,
    "bert_base": bert_base,
    "mlp_embed": mlp_embed,
}

DATASETS: dict[str, Callable[..., DatasetSplits]] = {
    "digits": digits,
    "digits_ids": digits_ids,
    "synthetic": synthetic,
}

# Which built-in dataset a built-in model trains on when the config names none.
DEFAULT_DATASET: dict[str, str] = {"cnn": "digits", "transformer": "digits", "mlp_embed": "digits_ids",
                                   "resnet18": "synthetic", "bert_base": "synthetic"}


def resolve_callable(ref: str, table: dict[str, Callable[..., Any]], kind: str) -> Callable[..., Any]:
    """A built-in name from ``table`` or an import path ``package.module:function``."""
    if ref in table:
        return table[ref]
    if ":" not in ref:
        raise ConfigError(f"unknown {kind} '{ref}'",
                          hint=f"use one of {sorted(table)} or an import path like 'mypkg.models:build'")
    module_name, _, attr = ref.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"cannot import module '{module_name}' for {kind} '{ref}': {exc}",
                          hint="check the module is installed or on PYTHONPATH") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"'{attr}' in module '{module_name}' is not a callable {kind} factory",
                          hint=f"point {kind} at a function, e.g. '{module_name}:build'")
    return fn


def build_model(ref: str, params: dict[str, Any] | None = None) -> nn.Module:
    factory = resolve_callable(ref, MODELS, "model")
    try:
        model = factory(**(params or {}))
    except TypeError as exc:
        raise ConfigError(f"model '{ref}' rejected its params {params}: {exc}",
                          hint="fix model.params in the config") from exc
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model factory '{ref}' returned {type(model).__name__}, not a torch.nn.Module")
    return model


def load_dataset(ref: str, params: dict[str, Any] | None = None) -> DatasetSplits:
    factory = resolve_callable(ref, DATASETS, "dataset")
    try:
        data = factory(**(params or {}))
    except TypeError as exc:
        raise ConfigError(f"dataset '{ref}' rejected its params {params}: {exc}",
                          hint="fix data.params in the config") from exc
    if not isinstance(data, DatasetSplits):
        raise ConfigError(f"dataset factory '{ref}' returned {type(data).__name__}, not models.DatasetSplits",
                          hint="return models.DatasetSplits(train_x, train_y, val_x, val_y, num_classes)")
    return data
