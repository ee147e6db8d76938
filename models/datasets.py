"""Datasets that ship with Kiln's dependencies, so nothing downloads at run time.

``digits`` is scikit-learn's 8x8 handwritten digits (1,797 images, 10 classes): a small real task.
``synthetic`` makes a learnable classification problem of any input shape, for tests and benchmarks.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch

from kiln.core.data import DatasetSplits


def _split(x: torch.Tensor, y: torch.Tensor, val_fraction: float, seed: int) -> tuple[torch.Tensor, ...]:
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_val = max(1, int(round(len(x) * val_fraction)))
    val, train = perm[:n_val], perm[n_val:]
    return x[train], y[train], x[val], y[val]


def digits(val_fraction: float = 0.2, seed: int = 0, as_ids: bool = False) -> DatasetSplits:
    """scikit-learn digits: ``[N, 1, 8, 8]`` floats in [0, 1], or ``[N, 64]`` int64 ids 0..16 with ``as_ids``."""
    pixels, target = digits_arrays()  # pixel values 0..16
    if as_ids:
        x = torch.as_tensor(pixels, dtype=torch.long)
    else:
        x = torch.as_tensor(pixels / 16.0, dtype=torch.float32).reshape(-1, 1, 8, 8)
    y = torch.as_tensor(target, dtype=torch.long)
    return DatasetSplits(*_split(x, y, val_fraction, seed), num_classes=10, name="digits_ids" if as_ids else "digits")


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits as ``(pixels [N, 64], labels [N])``, read from the CSV file scikit-learn ships (64
    pixel columns, then the label): ``import sklearn.datasets`` imports scipy, about 0.9 s of every process that
    loads the demo's data, to read a file numpy reads in 10 ms. ``load_digits`` where the file is not there."""
    spec = importlib.util.find_spec("sklearn")  # a top-level package: found, not imported
    folder = spec.submodule_search_locations if spec else None
    path = Path(folder[0]) / "datasets" / "data" / "digits.csv.gz" if folder else None
    if path is None or not path.is_file():
        from sklearn.datasets import load_digits

        bunch = load_digits()
        return np.asarray(bunch.data), np.asarray(bunch.target)
    table = np.loadtxt(path, delimiter=",")
    return table[:, :-1], table[:, -1].astype(np.int64)


def digits_ids(val_fraction: float = 0.2, seed: int = 0) -> DatasetSplits:
    return digits(val_fraction=val_fraction, seed=seed, as_ids=True)


def synthetic(
    shape: tuple[int, ...] | list[int] = (1, 8, 8),
    num_classes: int = 10,
    size: int = 512,
    val_fraction: float = 0.25,
    seed: int = 0,
    noise: float = 0.5,
) -> DatasetSplits:
    """Gaussian clusters around one random prototype per class: learnable, deterministic for a seed."""
    g = torch.Generator().manual_seed(seed)
    shape = tuple(int(s) for s in shape)
    protos = torch.randn((num_classes, *shape), generator=g)
    y = torch.randint(0, num_classes, (size,), generator=g)
    x = protos[y] + noise * torch.randn((size, *shape), generator=g)
    return DatasetSplits(*_split(x, y, val_fraction, seed), num_classes=num_classes, name="synthetic")


def synthetic_rgb(num_classes: int = 10, size: int = 512, seed: int = 0) -> DatasetSplits:
    """``[N, 3, 32, 32]`` images: the smallest input the ResNet-18 layout (stride 32) takes; resnet18's default."""
    return synthetic(shape=(3, 32, 32), num_classes=num_classes, size=size, seed=seed)


def synthetic_tokens(num_classes: int = 2, size: int = 256, seed: int = 0) -> DatasetSplits:
    """``[N, 128, 768]`` token features, the BERT-base input; bert_base's default."""
    return synthetic(shape=(128, 768), num_classes=num_classes, size=size, seed=seed)


def synthetic_text(
    vocab_size: int = 64,
    max_len: int = 16,
    num_classes: int = 4,
    size: int = 512,
    val_fraction: float = 0.25,
    seed: int = 0,
) -> DatasetSplits:
    """Padded token sequences of varying length as ``{input_ids, attention_mask}`` (int64, ``[N, max_len]``, 0 is
    padding): each class draws most tokens from its own slice of the vocabulary. ``token_classifier``'s default."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, num_classes, (size,), generator=g)
    lengths = torch.randint(max(1, max_len // 4), max_len + 1, (size,), generator=g)
    span = (vocab_size - 1) // num_classes
    own = 1 + y[:, None] * span + torch.randint(0, span, (size, max_len), generator=g)
    noise = torch.randint(1, vocab_size, (size, max_len), generator=g)
    ids = torch.where(torch.rand((size, max_len), generator=g) < 0.7, own, noise)
    mask = (torch.arange(max_len)[None, :] < lengths[:, None]).long()
    ids = ids * mask
    tx, ty, vx, vy = _split(torch.stack([ids, mask], 1), y, val_fraction, seed)
    return DatasetSplits(
        {"input_ids": tx[:, 0], "attention_mask": tx[:, 1]},
        ty,
        {"input_ids": vx[:, 0], "attention_mask": vx[:, 1]},
        vy,
        num_classes=num_classes,
        name="synthetic_text",
    )


def synthetic_regression(
    in_features: int = 8,
    outputs: int = 1,
    size: int = 512,
    val_fraction: float = 0.25,
    seed: int = 0,
    noise: float = 0.05,
) -> DatasetSplits:
    """Float targets ``[N, outputs]`` = a smooth function of ``[N, in_features]`` features, plus noise; no classes."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((size, in_features), generator=g)
    w = torch.randn((in_features, outputs), generator=g) / in_features**0.5
    y = torch.sin(x @ w) + noise * torch.randn((size, outputs), generator=g)
    return DatasetSplits(*_split(x, y, val_fraction, seed), num_classes=0, name="synthetic_regression")
