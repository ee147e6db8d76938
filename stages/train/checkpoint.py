"""Training checkpoints: ``last.pt`` (everything needed to resume bit-exactly) and ``best.safetensors``.

Both are written atomically (temp file + fsync + rename), so a crash mid-write leaves the previous
checkpoint intact. ``last.pt`` holds only tensors and plain containers and is read back with
``torch.load(weights_only=True)``: never an arbitrary pickle.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

from kiln.core.artifacts import hash_json, write_bytes_atomic, write_json_atomic
from kiln.core.errors import InputFileError
from kiln.core.ownership import final_of
from kiln.models.model_io import weights_bytes

log = logging.getLogger("kiln.train")

LAST = "last.pt"
BEST = "best.safetensors"
INFO = "last.json"
# Settings that change how training runs but not what it computes: left out of the run key so that
# e.g. more loader workers or a profiler trace can still resume an interrupted run.
# torch.compile is among them: a compiled run resumes uncompiled and the other way round (same weights
# up to the float rounding of fused kernels). So is the update's CUDA graph (the same kernels, replayed).
NOT_IN_KEY = ("enabled", "loader", "checkpoint", "profile_steps", "plot", "eval_every", "compile", "update_graph")
# Settings that change only which files for people training writes (loss.png): a finished run whose settings differ
# from this one's in these alone is taken whole (weights, history) rather than trained again.
NOTES_ONLY = ("plot",)
# The prefix torch.compile's wrapper (OptimizedModule) puts before every key of its state_dict.
COMPILED_PREFIX = "_orig_mod."


def run_key(config_dump: dict[str, Any]) -> str:
    """Identity of a training run: seed, model, data and the train settings that affect the weights."""
    train = {k: v for k, v in config_dump["train"].items() if k not in NOT_IN_KEY}
    train["distributed"] = {k: v for k, v in train["distributed"].items() if k not in ("nproc_per_node", "backend")}
    return hash_json(
        {"seed": config_dump["seed"], "model": config_dump["model"], "data": config_dump["data"], "train": train}
    )[:16]


def settings_digest(train: dict[str, Any]) -> str:
    """Hash of every train setting but :data:`NOTES_ONLY`: two runs with equal digests and run keys train alike."""
    return hash_json({k: v for k, v in train.items() if k not in NOTES_ONLY})[:16]


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_state(path: Path, state: dict[str, Any]) -> None:
    buf = io.BytesIO()
    torch.save(state, buf)
    write_bytes_atomic(path, buf.getvalue())
    log.debug("checkpoint %s (epoch %s, step %s)", path, state.get("epoch"), state.get("global_step"))


def load_state(path: Path) -> dict[str, Any]:
    """Read on CPU: RNG states must stay CPU tensors; load_state_dict moves the rest to the model's device."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated/corrupt/not ours: the user pointed at the wrong file
        raise InputFileError(
            f"cannot read training checkpoint {path}: {exc}",
            hint="point train.checkpoint.resume at a last.pt written by Kiln, or use 'never'",
        ) from None
    if not isinstance(state, dict) or "model" not in state or "optimizer" not in state:
        raise InputFileError(
            f"{path} is not a Kiln training checkpoint (no model/optimizer state)",
            hint="train.checkpoint.resume takes a last.pt; use model.checkpoint for plain weights",
        )
    return state


def plain_keys(state: dict[str, Any]) -> dict[str, Any]:
    """A model state dict without torch.compile's ``_orig_mod.`` prefix. Kiln saves the uncompiled module's
    state (no prefix), but a last.pt written by a script that saved ``torch.compile(model).state_dict()``
    has it on every key. In place (the state's ``_metadata`` stays with it)."""
    consume_prefix_in_state_dict_if_present(state, COMPILED_PREFIX)  # torch's own helper (used for DDP's "module.")
    return state


def save_weights(path: Path, model: nn.Module) -> str:
    """Write the model's weights as safetensors; returns the file's sha256 (recorded in last.pt)."""
    data = weights_bytes(model)
    write_bytes_atomic(path, data)
    return hashlib.sha256(data).hexdigest()


def find_best(folders: Iterable[Path | None], digest: str | None, own_folder: Path) -> Path | None:
    """The best.safetensors whose sha256 is ``digest``, from the first folder that has it.

    Checkpoints written before the digest was recorded (``digest`` None) accept only the file beside
    their own last.pt (``own_folder``), which the same run wrote."""
    for folder in folders:
        if folder is None or not (folder / BEST).is_file():
            continue
        path = folder / BEST
        if digest is None and folder == own_folder:
            return path
        if digest is not None and hashlib.sha256(path.read_bytes()).hexdigest() == digest:
            return path
    return None


def copy_file(src: Path, dst: Path) -> None:
    write_bytes_atomic(dst, src.read_bytes())


def all_finite(*states: dict[Any, Any]) -> bool:
    """No NaN/Inf in any floating-point tensor of these (nested) state dicts; one host sync per device."""
    flags: dict[torch.device, list[torch.Tensor]] = {}
    for t in _tensors(states):
        if t.is_floating_point() and t.numel():
            flags.setdefault(t.device, []).append(torch.isfinite(t).all())
    return all(bool(torch.stack(f).all()) for f in flags.values())


def _tensors(obj: Any) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def find_resume(
    setting: str,
    ckpt_dir: Path,
    key: str,
    sources: dict[str, Any] | None = None,
    settings: dict[str, Any] | None = None,
    outputs: Path | None = None,
) -> Path | None:
    """The checkpoint to resume from: an explicit path, or (auto) an unfinished run of the same key trained from
    the same ``sources`` (:func:`changed_sources`; None: not compared), or a finished one whose train ``settings``
    differ from these in :data:`NOTES_ONLY` alone (:func:`notes_only_changed`) or whose stage ``outputs`` folder
    does not hold what it trained (:func:`outputs_written`: stopped before the stage wrote them)."""
    if setting == "never":
        return None
    if setting != "auto":
        path = Path(setting)
        if not path.is_file():
            raise InputFileError(
                f"train.checkpoint.resume: {path} not found", hint="give a last.pt path, 'auto' or 'never'"
            )
        return path
    last, info = ckpt_dir / LAST, _read_info(ckpt_dir)
    if not last.is_file() or info.get("run_key") != key:
        _say_interrupted_beside(ckpt_dir)
        return None  # nothing or another config's: start fresh
    if info.get("complete") and not notes_only_changed(info, settings) and outputs_written(info, outputs):
        return None  # a finished run whose outputs were written, asked for again (forced): train afresh
    why = changed_sources(info.get("sources"), sources)
    if why:
        log.warning("not resuming the interrupted run in %s: %s; training afresh", last, why)
        return None
    return last


def _say_interrupted_beside(ckpt_dir: Path) -> None:
    """Training afresh under new settings: where an interrupted run of other settings sits beside this one's folder
    (``auto`` resumes only a run of the same settings), say how to continue that one with these settings instead
    (an explicit ``resume: path``, which keeps its weights and optimizer state and takes the new schedule)."""
    try:
        siblings = sorted(d for d in ckpt_dir.parent.iterdir() if d != ckpt_dir and (d / LAST).is_file())
    except OSError:
        return
    stopped = [d for d in siblings if not _read_info(d).get("complete")]
    if stopped:
        newest = max(stopped, key=lambda d: (d / LAST).stat().st_mtime)
        log.warning(
            "training afresh with these settings; an interrupted run with other settings is in %s (to continue "
            "it with these instead: --set train.checkpoint.resume=%s)",
            newest,
            newest / LAST,
        )


def notes_only_changed(info: dict[str, Any], settings: dict[str, Any] | None) -> bool:
    """Whether the run recorded in ``info`` (last.json) had these train ``settings`` but for a :data:`NOTES_ONLY`
    one: then only its notes are to be written anew. Equal settings mean the run is asked for again on purpose."""
    if settings is None or info.get("settings") != settings_digest(settings):
        return False
    return {k: info.get("notes", {}).get(k) for k in NOTES_ONLY} != {k: settings.get(k) for k in NOTES_ONLY}


def taken_because(ckpt_dir: Path, settings: dict[str, Any]) -> str:
    """Why the finished run in ``ckpt_dir`` is taken rather than trained again, in words for the log."""
    if notes_only_changed(_read_info(ckpt_dir), settings):
        return "its settings differ in " + ", ".join(f"train.{k}" for k in NOTES_ONLY) + " alone"
    return "it was stopped after its last checkpoint, before its outputs were written"


def outputs_folder(out_dir: Path | None) -> Path | None:
    """The stage folder that the runner's staging folder ``out_dir`` (``.train.staging-<pid>-<hex>``, see
    :func:`kiln.core.ownership.temp_name`) becomes; None for any other folder: not run by the pipeline runner."""
    return final_of(out_dir) if out_dir is not None else None


def history_digest(epochs: Any) -> str:
    """Hash of a run's per-epoch metrics (timings included: one run's alone), NaN/Inf as null like the manifest."""
    clean = [
        {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in m.items()}
        for m in epochs or []
        if isinstance(m, dict)
    ]
    return hash_json(clean)[:16]


def outputs_written(info: dict[str, Any], outputs: Path | None) -> bool:
    """Whether the stage folder ``outputs`` holds what the finished run of ``info`` (last.json) trained: its
    manifest records that run's epochs. Only then is a run of equal settings asked for again (``--force``, or
    ``kiln train``); otherwise it was stopped before writing them and its checkpoint gives them without training.
    True where this cannot be told (no ``outputs`` folder known, a last.json that records no history)."""
    if outputs is None or "history" not in info:
        return True
    try:
        summary = json.loads((outputs / "manifest.json").read_text())["summary"]
        return history_digest(summary["epochs"]) == info["history"]
    except (OSError, ValueError, KeyError, TypeError):
        return False


def run_info(key: str, settings: dict[str, Any], **state: Any) -> dict[str, Any]:
    """last.json's content: the run key, the settings' digest and notes-only values, and ``state`` (epoch, ...)."""
    notes = {k: settings.get(k) for k in NOTES_ONLY}
    return {"run_key": key, "settings": settings_digest(settings), "notes": notes} | state


# The parts of the stage's cache key (kiln.pipeline.runner.cache_key) that the weights depend on besides the
# settings, as the user knows them
SOURCE_NAMES = {"code": "Kiln's training code", "user_code": "the user's code", "user_data": "the data"}


def changed_sources(old: dict[str, Any] | None, new: dict[str, Any] | None) -> str:
    """Why a checkpoint trained from ``old`` must not be resumed by a run from ``new`` (``code``, ``user_code``,
    ``user_data`` of the stage's cache key): which of them changed, in words; "" when none did or when this run has
    none to compare. A checkpoint that recorded none is not resumed: what it was trained from is unknown."""
    if new is None or old == new:
        return ""
    if not isinstance(old, dict):
        return "it does not record the code and data it was trained from"
    said = [s for part, name in SOURCE_NAMES.items() if (s := _changed_part(name, old.get(part), new.get(part)))]
    return " and ".join(said) + " changed since it was written" if said else ""


def _changed_part(name: str, old: Any, new: Any) -> str:
    """``name`` with the entries that differ (``the data (dataset)``), or "" when ``old`` and ``new`` are equal."""
    if old == new:
        return ""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return name
    keys = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    return f"{name} ({', '.join(keys)})"


def write_info(ckpt_dir: Path, info: dict[str, Any]) -> None:
    """A small JSON beside last.pt (run key, epoch, step, complete) so nobody loads the big file to ask."""
    write_json_atomic(ckpt_dir / INFO, info)


def _read_info(ckpt_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((ckpt_dir / INFO).read_text())
    except (OSError, ValueError):
        return {}
