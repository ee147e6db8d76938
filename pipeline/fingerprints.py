"""Content hashes of user-supplied data that neither the config nor the code pins down.

A user's data module or calibration reader (``package.module:function``) may read files, and
``model.checkpoint`` names one: the cache key covers the config (paths) and the code, not what the files hold.
Stages that read such data name a fingerprint here (``Stage.data``) and the runner adds its value to their cache
key, computed once per run.
Built-in datasets are pinned by Kiln's code and config, so they need none (and cost nothing).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from kiln.core.artifacts import hash_file, hash_json
from kiln.core.errors import InputFileError
from kiln.pipeline.config import KilnConfig

if TYPE_CHECKING:
    import numpy as np


def _is_import_path(name: str | None) -> bool:
    return bool(name) and ":" in name


def dataset_fingerprint(config: KilnConfig) -> str | None:
    """Hash of every tensor of a user dataset (loaded the way stages load it), or None for a built-in one."""
    if not _is_import_path(config.data.name):
        return None
    from kiln.calibration.data import hash_batches  # torch and numpy: only for a user dataset
    from kiln.core.data import tensors
    from kiln.models.model_io import dataset_for

    d = dataset_for(config.model, config.data, config.signature, config.seed)
    parts = [d.train_x, d.train_y, d.val_x, d.val_y]
    return hash_batches([_array(t) for p in parts if p is not None for t in tensors(p)])


def _array(t: object) -> np.ndarray:
    """Any tensor or array as numpy, for hashing only: bytes are what count (bfloat16 has no numpy type, a CUDA
    or grad-tracking tensor no direct view), and a wrong type is left to the stage's own clear check."""
    import numpy as np
    import torch

    if isinstance(t, torch.Tensor):
        t = t.detach().cpu()
        return t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()
    return np.asarray(t)


def checkpoint_fingerprint(config: KilnConfig) -> str | None:
    """Hash of the ``model.checkpoint`` file the train stage starts from, if any."""
    if not config.model.checkpoint:
        return None
    path = Path(config.model.checkpoint)
    if not path.is_file():
        raise InputFileError(f"model.checkpoint not found: {path}", hint="fix the path or remove model.checkpoint")
    return hash_file(path)


LARGE_FILE = 256 * 2**20  # above this, a file named in model.params is known by its size and mtime, not hashed


def model_files_fingerprint(config: KilnConfig, workdir: Path | None = None) -> str | None:
    """A stamp of the files and folders ``model.params`` names (a ``config.json``, a ``from_pretrained`` folder):
    the factory builds the model from them, so editing one must retrain as editing its code does. A value counts
    when it is a path that exists, relative to where Kiln runs (as the factory opens it); the working folder, the
    folders above it, and anything holding or inside the ``workdir`` do not. A file is hashed (up to
    :data:`LARGE_FILE`); a folder's files, which may be many and large, are known by their sizes and mtimes."""
    here = Path.cwd().resolve()
    work = workdir.resolve() if workdir is not None else None
    found = {}
    for value in _strings(config.model.params):
        path = Path(value)
        if not value or not path.exists():
            continue
        real = path.resolve()
        if here.is_relative_to(real) or (work is not None and (work.is_relative_to(real) or real.is_relative_to(work))):
            continue
        if path.is_file():
            found[value] = _file_stamp(path)
        else:
            found[value] = {f.relative_to(path).as_posix(): _stat(f) for f in sorted(path.rglob("*")) if f.is_file()}
    return hash_json(found) if found else None


def _strings(value: object) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _strings(v)]
    return []


def _stat(path: Path) -> str:
    st = path.stat()
    return f"{st.st_size}:{st.st_mtime_ns}"


def _file_stamp(path: Path) -> str:
    return hash_file(path) if path.stat().st_size <= LARGE_FILE else _stat(path)


def onnx_fingerprint(config: KilnConfig) -> str | None:
    """Hash of the ``model.onnx`` file a run starts from and of the external-data files beside it, if any: the
    dynamo exporter keeps the weights in ``model.onnx.data``, which can change while the graph stays."""
    if not config.model.onnx:
        return None
    from kiln.core.onnx_io import onnx_files

    path = Path(config.model.onnx)
    if not path.is_file():
        raise InputFileError(f"model.onnx not found: {path}", hint="fix the path or remove model.onnx")
    return hash_json({f.relative_to(path.parent).as_posix(): hash_file(f) for f in onnx_files(path)})


def calibration_fingerprint(config: KilnConfig) -> str | None:
    """Hash of the batches a user calibration reader yields (what calibration would use), or None when there is
    no reader or the precision stage will not calibrate."""
    ccfg, pcfg = config.calibration, config.precision
    needs_data = "int8" in pcfg.variants or ("fp16" in pcfg.variants and pcfg.fp16.range_check)
    if not (ccfg.reader and needs_data):
        return None
    from kiln.calibration.data import hash_batches, read_reader

    return hash_batches(read_reader(ccfg))


# name -> (config, workdir) -> fingerprint
FINGERPRINTS: dict[str, Callable[[KilnConfig, Path], str | None]] = {
    "dataset": lambda config, _: dataset_fingerprint(config),
    "checkpoint": lambda config, _: checkpoint_fingerprint(config),
    "model_files": model_files_fingerprint,
    "onnx": lambda config, _: onnx_fingerprint(config),
    "calibration": lambda config, _: calibration_fingerprint(config),
}
