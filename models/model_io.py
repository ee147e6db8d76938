"""Load/save the trained model and find the run's dataset: the contract between train and later stages.

The train stage writes ``model.safetensors`` (state dict) and ``model.json`` (how to rebuild the module).
Checkpoints are read with safetensors or ``torch.load(weights_only=True)``: never arbitrary pickles.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.core.artifacts import write_bytes_atomic
from kiln.core.compare import class_axis
from kiln.core.data import DatasetSplits, feed_for_graph, is_tensor, rows
from kiln.core.errors import ConfigError, InputFileError
from kiln.core.feeds import check_feed
from kiln.core.inputs import check_batch_axis, random_inputs
from kiln.core.onnx_io import check_tensor_io, index_ranges, io_specs, load_onnx
from kiln.core.output_names import logits_name
from kiln.core.records import TensorSpec
from kiln.core.signature import Signature
from kiln.models.config import DataConfig, ModelConfig
from kiln.models.registry import DATASETS, DEFAULT_DATASET, MODELS, build_model, load_dataset, resolve_callable

if TYPE_CHECKING:  # torch is imported in the functions that read weights or make tensors, not to import this module
    import torch
    from torch import nn

log = logging.getLogger("kiln")
WEIGHTS = "model.safetensors"
SPEC = "model.json"


def torch_model_named(model: ModelConfig) -> bool:
    """Is there a PyTorch model? Always, unless the run starts from ``model.onnx`` without naming one too."""
    return model.onnx is None or "name" in model.model_fields_set


def on_random_inputs(model: ModelConfig, data: DataConfig) -> bool:
    """Whether the run's data are random inputs: a run from ``model.onnx`` with no data and no PyTorch model. Its
    held-out data (validation's, and the precision stage's check) are then random; its calibration is too unless
    ``calibration.reader`` is set."""
    return bool(model.onnx) and not data.name and not torch_model_named(model)


def dataset_for(model: ModelConfig, data: DataConfig, signature: Signature, seed: int) -> DatasetSplits:
    """The run's dataset: ``data.name`` (a built-in, split by ``seed``, or the user's function), the model's
    default dataset, or random inputs of ``model.onnx`` when a run starts from an ONNX file without data."""
    if on_random_inputs(model, data):
        return random_splits(Path(model.onnx), signature, seed)
    name = data.name or DEFAULT_DATASET.get(model.name)
    if name is None:
        resolve_callable(model.name, MODELS, "model")  # a misspelt model name is the problem, say so
        raise ConfigError(
            f"no dataset configured for model '{model.name}'",
            hint="set data.name to a built-in dataset or a data function's import path, e.g. 'mydata:load'",
        )
    params = dict(data.params)
    params.setdefault("seed", seed) if name in DATASETS else None  # built-ins split by the run seed
    splits = load_dataset(name, params, signature.dynamic_axes)
    if model.onnx:
        check_onnx_takes(Path(model.onnx), splits, name, signature)
    return splits


def check_onnx_takes(path: Path, data: DatasetSplits, ref: str, signature: Signature | None = None) -> None:
    """The dataset's inputs against the graph inputs of the ``model.onnx`` a run starts from (names, dtypes, ranks
    and fixed sizes), its labels' classes against the graph's class-logit output, and ``signature.dynamic_axes``
    against the graph (:func:`check_onnx_axes`), before any stage hands them to ONNX Runtime: a mismatch is named
    here, not deep inside it."""
    graph = load_onnx(path, load_external_data=False)
    check_tensor_io(graph, f"model.onnx {path.name}")
    graph_inputs, graph_outputs = io_specs(graph)
    if signature is not None:
        check_onnx_axes(path, graph_inputs, signature.dynamic_axes)
        _check_onnx_classes(path, graph_inputs, graph_outputs, data, ref, signature.logits_output)
    # the batch axis is the run's to choose (signature.batch_sizes), whatever size the file fixed it to
    specs = [s.model_copy(update={"shape": ["batch", *s.shape[1:]]}) if s.shape else s for s in graph_inputs]
    names = [s.name for s in specs]
    for split in ("train_x", "val_x"):
        x = getattr(data, split)
        if rows(x):
            feed = feed_for_graph(x, names, f"model.onnx {path.name}")
            check_feed(feed, specs, f"dataset '{ref}' {split}", f"model.onnx {path.name}")


def check_onnx_axes(path: Path, inputs: list[TensorSpec], dynamic_axes: dict[str, dict[int, str]]) -> None:
    """``signature.dynamic_axes`` against the inputs of the ``model.onnx`` a run starts from: each names an input
    the graph has, an axis it has, and one the file leaves free (a size the file fixes cannot vary; the batch axis
    is the run's to choose whatever the file says; a free axis the file leaves unnamed takes the name given here).
    Axes the file names alike are one size (:func:`_check_named_alike`)."""
    specs = {s.name: s for s in inputs}
    for name, axes in dynamic_axes.items():
        if name not in specs:
            raise ConfigError(
                f"signature.dynamic_axes names input '{name}', which model.onnx {path.name} does not have "
                f"(its inputs: {sorted(specs)})",
                hint="name the graph's inputs in signature.dynamic_axes",
            )
        shape = specs[name].shape
        for axis, label in axes.items():
            axis = int(axis)
            if not 0 <= axis < len(shape):
                raise ConfigError(
                    f"signature.dynamic_axes gives input '{name}' axis {axis} ({label}), and it has {len(shape)} "
                    f"axes in model.onnx {path.name} (shape {list(shape)})",
                    hint=f"give an axis from 0 to {len(shape) - 1}",
                )
            if axis > 0 and isinstance(shape[axis], int) and shape[axis] >= 1:  # 0: free, without a name
                raise ConfigError(
                    f"model.onnx {path.name} fixes input '{name}' axis {axis} at {shape[axis]}: it cannot vary as "
                    f"signature.dynamic_axes says ({label})",
                    hint="remove it from signature.dynamic_axes, or export the file with that axis dynamic",
                )
    _check_named_alike(path, inputs, dynamic_axes)


def _check_named_alike(path: Path, inputs: list[TensorSpec], dynamic_axes: dict[str, dict[int, str]]) -> None:
    """Axes besides the batch that the file gives one name (``ids [batch, seq_len]`` beside ``mask [batch,
    seq_len]``: one size) are all named in ``signature.dynamic_axes`` and alike there, where it names any of them:
    the checks vary each name of it apart, and an axis left out stays at the data's own size, so ``ids`` at 3
    positions would meet ``mask`` at 12, which the graph refuses with a broadcast error naming neither."""
    given = {(name, int(axis)): label for name, axes in dynamic_axes.items() for axis, label in axes.items()}
    for dim, places in _file_names(inputs).items():
        labels = {given[p] for p in places if p in given}
        if not labels:
            continue
        left = [p for p in places if p not in given]
        if not left and len(labels) == 1:
            continue
        if left:
            named = [p for p in places if p in given]
            problem = (
                f"signature.dynamic_axes names {_places(named, given)} and leaves out {_places(left)}, which "
                f"model.onnx {path.name} names '{dim}' too"
            )
        else:
            problem = (
                f"signature.dynamic_axes names {_places(places, given)} apart, which model.onnx {path.name} names "
                f"alike ('{dim}')"
            )
        alike = {k: {int(a): v for a, v in axes.items()} for k, axes in dynamic_axes.items()}
        for name, axis in places:
            alike.setdefault(name, {})[axis] = dim
        varies = "only the axes signature.dynamic_axes names" if left else "each name of signature.dynamic_axes apart"
        raise ConfigError(
            f"{problem}: the file declares them one size, and Kiln varies {varies}",
            hint=f"name them alike, as the file does: --set 'signature.dynamic_axes={_axes_flow(alike)}' (or the "
            "same under signature: in the run's config)",
        )


def _file_names(inputs: list[TensorSpec]) -> dict[str, list[tuple[str, int]]]:
    """Each name the file gives an input axis besides the batch, with the (input, axis) places that carry it; names
    an input's axis 0 carries are the batch's, the run's to size."""
    batch = {s.shape[0] for s in inputs if s.shape}
    out: dict[str, list[tuple[str, int]]] = {}
    for spec in inputs:
        for axis, dim in enumerate(spec.shape):
            if axis and isinstance(dim, str) and dim and dim not in batch:
                out.setdefault(dim, []).append((spec.name, axis))
    return out


def _places(places: list[tuple[str, int]], labels: dict[tuple[str, int], str] | None = None) -> str:
    """``input 'ids' axis 1 ('s1') and input 'mask' axis 1 ('s2')``, with the labels where given."""
    said = [f"input '{n}' axis {a}" + (f" ('{labels[(n, a)]}')" if labels else "") for n, a in places]
    return said[0] if len(said) == 1 else ", ".join(said[:-1]) + " and " + said[-1]


def _axes_flow(axes: dict[str, dict[int, str]]) -> str:
    """``{ids: {1: seq}, mask: {1: seq}}``: signature.dynamic_axes in YAML's flow style (a name YAML would not read
    as that text in quotes)."""

    def word(text: str) -> str:
        return text if re.fullmatch(r"[A-Za-z_][\w.-]*", text) else json.dumps(text)

    inner = ("{" + ", ".join(f"{a}: {word(v)}" for a, v in sorted(d.items())) + "}" for d in axes.values())
    return "{" + ", ".join(f"{word(k)}: {d}" for k, d in zip(axes, inner)) + "}"


def _check_onnx_classes(
    path: Path,
    inputs: list[TensorSpec],
    outputs: list[TensorSpec],
    data: DatasetSplits,
    ref: str,
    setting: str | int | None,
) -> None:
    """Class labels against the class-logit output of a ``model.onnx`` run: fewer logits than classes is another
    model's data, and a class axis named as an input's axis 0 (:func:`_batch_class_axis`) holds no classes at all
    (accuracy near chance, and a run that passes)."""
    name = logits_name([o.name for o in outputs], setting)
    labels = data.val_y if data.val_y is not None else data.train_y
    if name is None or labels is None or data.num_classes <= 0 or labels.ndim != 1 or labels.is_floating_point():
        return
    shape = next(o.shape for o in outputs if o.name == name)
    if setting is not None:  # a default output whose axis is no class axis is left out of accuracy by validation
        _batch_class_axis(path, inputs, name, shape)
    if len(shape) == 2 and isinstance(shape[1], int) and shape[1] < max(data.num_classes, 2):
        raise ConfigError(
            f"model.onnx {path.name} gives class logits of shape {list(shape)} (output '{name}'), but dataset "
            f"'{ref}' has {data.num_classes} classes",
            hint="give the data the model was trained for, or name the class-logit output in signature.logits_output",
        )


def _batch_class_axis(path: Path, inputs: list[TensorSpec], name: str, shape: list[int | str]) -> None:
    """Refuse the class-logit output ``signature.logits_output`` names where its class axis (:func:`class_axis`)
    is an input's axis 0 by name: its size is the count of rows of that input (CLIP's ``logits_per_image``
    ``[images, texts]``), so its argmax picks a row of the batch, not a class. A class axis of another dynamic
    axis (a question-answering head's ``start_logits [batch, seq]``) is a position, which labels may name."""
    if len(shape) < 2:
        return
    axis = shape[class_axis(len(shape))]
    firsts = {s.shape[0]: s.name for s in reversed(inputs) if s.shape and isinstance(s.shape[0], str) and s.shape[0]}
    if isinstance(axis, str) and axis in firsts:
        raise ConfigError(
            f"output '{name}' of model.onnx {path.name}, which signature.logits_output names, is {list(shape)}: its "
            f"class axis '{axis}' is axis 0 of input '{firsts[axis]}' (one entry per row of the batch), not classes",
            hint="name an output whose last axis holds the classes in signature.logits_output, or leave it unset "
            "and score the outputs with validate.metric (a retrieval score over the batch)",
        )


def random_axis_size(path: Path, inputs: list[TensorSpec], signature: Signature) -> int | None:
    """The size random inputs of ``model.onnx`` give every dynamic axis besides batch: the largest of
    ``signature.shapes``; None where the graph has no such axis; a ConfigError where it has one and nothing sizes it
    (checked as the run takes the file, before any stage works on it). An axis the file leaves unnamed (0 in
    ``inputs``, neither a size nor a name) is dynamic too, named by ``signature.dynamic_axes`` where it names it.
    The inputs' common batch axis is checked first (:func:`~kiln.core.inputs.check_batch_axis`): a graph without one
    (a paper-layout GNN's ``x [nodes, 16]`` beside ``edge_index [2, edges]``) is refused for that, which sizes would
    not mend."""
    check_batch_axis(inputs, f"model.onnx {path.name}")
    sizes = {k: max(v) for k, v in signature.shapes.items() if v}
    named = {d for s in inputs for d in s.shape[1:] if isinstance(d, str) and d}
    named |= {
        str(signature.dynamic_axes[n][a])
        for n, a in _unnamed_axes(inputs, {})
        if a in signature.dynamic_axes.get(n, {})
    }
    unnamed = _unnamed_axes(inputs, signature.dynamic_axes)
    if (named or unnamed) and not sizes:
        listed = [repr(d) for d in sorted(named)] + [f"{name} axis {axis} (unnamed)" for name, axis in unnamed]
        hint = "give data.name (a data function), or signature.shapes with their sizes"
        if unnamed:
            name, axis = unnamed[0]
            named_first = f"signature.dynamic_axes: {{{name}: {{{axis}: seq}}}}"
            hint += f"; name an unnamed axis first ({named_first}) and size it by that name"
        raise ConfigError(
            f"model.onnx {path.name} has dynamic axes [{', '.join(listed)}] besides batch, and no data to size them",
            hint=hint,
        )
    return max(sizes.values()) if sizes else None


def _unnamed_axes(inputs: list[TensorSpec], dynamic_axes: dict[str, dict[int, str]]) -> list[tuple[str, int]]:
    """(input, axis) of each axis besides the batch that the file leaves dynamic without a name (0 in the spec)
    and ``signature.dynamic_axes`` does not name."""
    given = {(name, int(axis)) for name, axes in dynamic_axes.items() for axis in axes}
    return [
        (s.name, i) for s in inputs for i, d in enumerate(s.shape) if i and d in (0, "") and (s.name, i) not in given
    ]


def random_splits(path: Path, signature: Signature, seed: int, rows: int = 64) -> DatasetSplits:
    """Random inputs of an ONNX file's declared shapes, without labels: a run from ``model.onnx`` with no data
    (agreement with the FP32 graph only; calibration on random data is unrepresentative, so it says so loudly)."""
    graph = load_onnx(path, load_external_data=False)
    check_tensor_io(graph, f"model.onnx {path.name}")
    inputs, _ = io_specs(graph)
    # the batch axis is the run's to choose, whatever size the file fixed it to (as check_onnx_takes takes it)
    inputs = [s.model_copy(update={"shape": ["batch", *s.shape[1:]]}) if s.shape else s for s in inputs]
    check_onnx_axes(path, inputs, signature.dynamic_axes)
    dynamic = random_axis_size(path, inputs, signature)
    ids = index_ranges(graph)  # token ids over their embedding's rows, not 0 and 1 only
    _say_random(str(path))

    def make(seed: int) -> dict[str, torch.Tensor]:
        import torch

        arrays = random_inputs(inputs, rows, dynamic=dynamic, seed=seed, int_ranges=ids)
        return {k: torch.from_numpy(v) for k, v in arrays.items()}

    return DatasetSplits(make(seed), None, make(seed + 1), None, name=f"random inputs of {path.name}")


@functools.cache
def _say_random(path: str) -> None:
    """The warning that a run from ``path`` uses random inputs: once a process, not once per stage that asks. The
    dataset is loaded without the calibration settings, so it says what holds either way: validation is on random
    inputs, and calibration only where no ``calibration.reader`` gives real batches."""
    log.warning(
        "model.onnx with no data.name: validating on RANDOM inputs, and calibrating on them unless calibration.reader "
        "is set; accuracy figures (and INT8 ranges calibrated on them) do not reflect real data (give data.name for "
        "real ones)"
    )


# Keys under which training code keeps the model's weights beside its other state: PyTorch's checkpoint recipe
# ('model_state_dict'), Lightning, timm and MMEngine ('state_dict'), torchvision's references, detectron2 and fairseq
# ('model'), DeepSpeed ('module'), and the many scripts that name their network 'net'.
WEIGHTS_KEYS = ("state_dict", "model_state_dict", "model", "module", "net")


def read_state_dict(path: Path, given: str = "model.checkpoint") -> dict[str, torch.Tensor]:
    """The state dict in the file ``path``: a safetensors file, or a ``torch.save``'d state dict or training
    checkpoint (:func:`_weights_in`), read without running code from the file. ``given``: what the user named the
    file with (the config key ``model.checkpoint``, or a direct command's ``--checkpoint``), which a missing file's
    error names, so the fix points at what the user wrote."""
    if not path.is_file():
        raise InputFileError(
            f"checkpoint not found: {path} (given by {given})",
            hint=f"give {given} the path of an existing checkpoint file (a .safetensors file or a torch.save'd state "
            "dict)",
        )
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path))
        import torch

        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # corrupt or not a checkpoint: a user problem, not a Kiln bug
        reason, hint = _load_failure(exc, path)
        raise InputFileError(f"cannot read checkpoint {path}: {reason}", hint=hint) from None
    return _weights_in(state, path)


def _weights_in(state: Any, path: Path) -> dict[str, torch.Tensor]:
    """The state dict in what ``torch.load`` read: the one dict of tensors under a key of :data:`WEIGHTS_KEYS` (a
    training checkpoint, with the epoch, optimizer state and scalar tensors beside it; the key used is logged),
    else the object itself where it holds tensors. Anything else is an error naming the dict's keys and those holding
    tensors, since which of those is the model's is not Kiln's to guess."""
    if not isinstance(state, dict):
        raise InputFileError(
            f"checkpoint {path} holds {type(state).__name__}, not a state dict",
            hint="save with torch.save(model.state_dict(), path)",
        )
    holders = [k for k, v in state.items() if isinstance(v, dict) and any(is_tensor(t) for t in v.values())]
    known = [k for k in holders if k in WEIGHTS_KEYS]
    # a state dict's values are tensors, never dicts: a known key holding tensors beside a scalar tensor (a step
    # count, best_acc1) is a training checkpoint's
    if not state or (len(known) != 1 and any(is_tensor(v) for v in state.values())):
        return state  # {}: a model without weights
    if len(known) == 1:
        log.info(
            "checkpoint %s: a training checkpoint (keys %s); loading the weights under '%s'",
            path,
            _few(list(state), 8),
            known[0],
        )
        _other_weights(path, known[0], [k for k in holders if k != known[0]])
        return state[known[0]]
    listed = f"checkpoint {path} holds a dict with keys [{_few([repr(k) for k in state], 8)}], not a state dict"
    if not holders:
        raise InputFileError(
            f"{listed}, and none of them holds a dict of tensors", hint="save with torch.save(model.state_dict(), path)"
        )
    held = " and ".join(repr(k) for k in holders[:4]) + (f" and {len(holders) - 4} more" if len(holders) > 4 else "")
    raise InputFileError(
        f"{listed}: {held} hold{'s' if len(holders) == 1 else ''} tensors",
        hint=f"save the model's weights alone, e.g. torch.save(ckpt['{holders[0]}'], path), and give that file",
    )


def _other_weights(path: Path, used: str, others: list[str]) -> None:
    """A warning where keys beside the one loaded hold weights too (an EMA copy, a GAN's discriminator): the run
    uses ``used``, and a user who deploys the other (a diffusion model's EMA weights) must hear which it took."""
    if others:
        shown = " and ".join(repr(k) for k in others[:3]) + (" and more" if len(others) > 3 else "")
        log.warning(
            "checkpoint %s: loading the weights under '%s'; %s hold%s weights too (an EMA copy?): to use those, save "
            "them alone, e.g. torch.save(ckpt[%s], path), and give that file",
            path,
            used,
            shown,
            "s" if len(others) == 1 else "",
            repr(others[0]),
        )


def _load_failure(exc: Exception, path: Path) -> tuple[str, str]:
    """The useful line of a load error, and its fix. torch's weights-only refusal opens with advice to pass
    ``weights_only=False`` (which would run code from the file): Kiln never does, so give the class it refused (a
    training script's ``argparse.Namespace`` beside the weights) and how to save the weights alone."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    plain = "give a safetensors file or a torch.save'd state_dict"
    if not (lines and lines[0].startswith("Weights only load failed")):
        return (lines or [type(exc).__name__])[0][:300], plain
    refused = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
    if refused is None:
        return f"not a plain state dict (torch.load with weights_only=True: {_unpickler_error(str(exc))})", plain
    state = _read_around_refused(path)
    holders = [str(k) for k, v in state.items() if isinstance(v, dict) and any(is_tensor(t) for t in v.values())]
    shown = f" (keys {_few([repr(k) for k in state], 8)})" if state else ""
    reason = (
        f"the checkpoint{shown} holds an object of class {refused.group(1)} beside the weights, which Kiln's "
        "torch.load(weights_only=True) refuses (Kiln runs no code from the file)"
    )
    which = (
        f"{' and '.join(repr(k) for k in holders[:3])} hold{'s' if len(holders) == 1 else ''} weights"
        if holders
        else "or 'model', 'state_dict', whichever key holds the weights"
    )
    key = holders[0] if holders else "ema"
    hint = (
        f"for a file you trust, save its state dict alone, e.g. torch.save(torch.load({str(path)!r}, "
        f"weights_only=False)[{key!r}], 'weights.pt') ({which}), and give that file"
    )
    return reason, hint


def _unpickler_error(text: str) -> str:
    """What torch's weights-only unpickler refused (``Unsupported operand 103`` for a file that is no pickle), from
    the line that follows its ``WeightsUnpickler error:``; not torch's advice around it."""
    after = text.split("WeightsUnpickler error:", 1)[1] if "WeightsUnpickler error:" in text else ""
    lines = [ln.strip() for ln in after.splitlines() if ln.strip()]
    return next((ln[:300] for ln in lines if not ln.startswith("Check the documentation")), "refused")


class _Refused:
    """Stands in for every class a weights-only load refuses, so :func:`_read_around_refused` reads the keys without
    building the file's own objects (that would run code from it)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass


def _read_around_refused(path: Path) -> dict[Any, Any]:
    """The top-level dict of a checkpoint that a weights-only load refuses, each refused class read as
    :class:`_Refused`, to name its keys in the error; empty where even that fails (a refused function, not a
    class)."""
    import torch

    try:
        refused = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        with torch.serialization.safe_globals([(_Refused, name) for name in refused]):
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # only a better message is at stake: the error stands without the keys
        return {}
    return state if isinstance(state, dict) else {}


def _storage_key(t: torch.Tensor) -> tuple[Any, ...] | None:
    """Equal for two tensors that are the same view of one storage (tied weights); None for an empty tensor."""
    if not t.numel():
        return None
    return t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype


def tied_names(model: nn.Module) -> dict[str, str]:
    """State-dict names that are another name's tensor (tied weights, as a language model's output projection is
    its token embedding): alias -> the first name in the state dict."""
    first: dict[tuple[Any, ...], str] = {}
    aliases: dict[str, str] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        key = _storage_key(t)
        if key is None:
            continue
        if key in first:
            aliases[name] = first[key]
        else:
            first[key] = name
    return aliases


def weights_bytes(model: nn.Module) -> bytes:
    """The model's state dict as safetensors bytes, each tied tensor once: safetensors refuses tensors that share
    memory (a transformers GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``); :func:`load_weights` ties them
    again, as ``safetensors.torch.save_model``/``load_model`` do (those write and read files; Kiln writes its files
    atomically with the permissions a server can read: :func:`kiln.core.artifacts.write_bytes_atomic`)."""
    from safetensors.torch import save

    aliases = tied_names(model)
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items() if k not in aliases}
    seen: set[int] = set()
    for k, v in state.items():  # distinct views of one storage (safetensors refuses overlapping ones): copied apart
        ptr = v.untyped_storage().data_ptr()
        if v.numel() and ptr in seen:
            state[k] = v.clone()
        seen.add(ptr)
    return save(state)


def load_weights(model: nn.Module, state: dict[str, torch.Tensor], source: str) -> nn.Module:
    """Load ``state`` strictly; a tied tensor saved once (by :func:`weights_bytes`, or Hugging Face's
    ``save_pretrained``) fills its aliases, since the model ties them itself. A checkpoint holding every key of the
    model, each of its shape, beside others loads, the others named in a warning (:func:`_without_unused`: one
    tower of a two-tower model from the whole model's checkpoint). Keys that do not fit are summed up
    (:func:`_misfit`), not quoted from torch's message, which lists every missing key first."""
    tied = tied_names(model)
    state = _without_wrapper_prefix(dict(state), set(model.state_dict()), tied, source)
    for alias, name in tied.items():
        if alias not in state and name in state:
            state[alias] = state[name]
        elif name not in state and alias in state:
            state[name] = state[alias]
    state = _weight_norm_matched(model, state, source)
    state = _without_unused(model, state, source)
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:
        message, prefixes = _misfit(model.state_dict(), state, exc)
        raise ModelShapeError(
            f"checkpoint {source} does not fit model {type(model).__name__}: {message}",
            prefixes,
            _weight_norm_hint(model.state_dict(), state),
        ) from None
    return model


# A weight under weight_norm is two tensors, g (its norm) and v (its direction): named by
# torch.nn.utils.parametrizations.weight_norm X.parametrizations.W.original0/original1, by the older
# torch.nn.utils.weight_norm X.W_g/X.W_v; without weight_norm the weight is X.W.
_PARAMETRIZED = re.compile(r"^(?P<at>(?:.+\.)?)parametrizations\.(?P<name>[^.]+)\.original(?P<part>[01])$")
_OLD_FORM = re.compile(r"^(?P<base>.+)_(?P<part>[gv])$")


def _weight_norm_pairs(keys: list[str]) -> dict[str, tuple[str, str]]:
    """The weights of ``keys`` held in either weight_norm form, both parts there: ``X.W`` -> (its g key, its v
    key)."""
    parts: dict[str, dict[str, str]] = {}
    for key in keys:
        new, old = _PARAMETRIZED.match(key), _OLD_FORM.match(key)
        if new:
            parts.setdefault(f"{new['at']}{new['name']}", {})["gv"[int(new["part"])]] = key
        elif old:
            parts.setdefault(old["base"], {})[old["part"]] = key
    return {base: (held["g"], held["v"]) for base, held in parts.items() if set(held) == {"g", "v"}}


def _weight_norm_matched(model: nn.Module, state: dict[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    """``state`` with each weight the model holds under weight_norm and the checkpoint in another form put in the
    model's: the g and v of the other weight_norm form as they are (the same two tensors), or a plain weight ``w``
    as ``g = ||w||`` (over the axes where the model's g has size 1, as ``torch.norm_except_dim``) and ``v = w``:
    the tensors applying weight_norm to a layer holding ``w`` sets, which weight_norm computes back to ``w``
    (``v * g / ||v||``, to float rounding). The reverse, a weight-normed checkpoint for a plain layer, is left to
    the error (:func:`_weight_norm_hint`): its weight depends on a parametrization the checkpoint does not name."""
    wanted = model.state_dict()
    missing = [k for k in wanted if k not in state]
    unexpected = [k for k in state if k not in wanted]
    have = _weight_norm_pairs(unexpected)
    out, matched = dict(state), []
    for base, (g_key, v_key) in _weight_norm_pairs(missing).items():
        if base in have:
            g, v = state[have[base][0]], state[have[base][1]]
        elif base in unexpected:
            g, v = _norm_of(state[base], tuple(wanted[g_key].shape)), state[base]
        else:
            continue
        if _shape(g) != tuple(wanted[g_key].shape) or _shape(v) != tuple(wanted[v_key].shape):
            continue
        if not _is_weight_norm(model, base, g_key, g, v):
            continue
        for key in have.get(base, (base,)):
            out.pop(key)
        out[g_key], out[v_key] = g, v
        matched.append(base)
    if matched:
        log.info(
            "checkpoint %s: %d weight%s in another weight_norm form than the model's (%s), loaded in the model's",
            source,
            len(matched),
            "s" if len(matched) != 1 else "",
            _few(matched),
        )
    return out


def _norm_of(w: Any, g_shape: tuple[int, ...]) -> torch.Tensor | None:
    """weight_norm's g of the weight ``w`` for a g of shape ``g_shape``: the 2-norm of ``w`` over the axes where
    ``g_shape`` is 1 (all of them for a g of one value); None where that shape is not one of ``w``'s norms."""
    if not is_tensor(w) or not w.is_floating_point():
        return None
    import torch

    if g_shape == ():
        return torch.linalg.vector_norm(w)
    if len(g_shape) != w.ndim or any(n not in (1, size) for n, size in zip(g_shape, w.shape)):
        return None
    axes = [i for i, n in enumerate(g_shape) if n == 1]
    return torch.linalg.vector_norm(w, dim=axes, keepdim=True) if axes else w.abs()


def _is_weight_norm(model: nn.Module, base: str, g_key: str, g: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the model computes its weight ``base`` (``X.W``, g at ``g_key``) as weight_norm does: the older form
    by its hook (``W_g``/``W_v`` are its names), the parametrizations form by running the model's parametrization on
    ``g`` and ``v`` (``original0``/``original1`` name any parametrization of two tensors)."""
    import torch
    from torch.nn.utils.parametrize import ParametrizationList
    from torch.nn.utils.weight_norm import WeightNorm

    at, _, name = base.rpartition(".")
    module = model.get_submodule(at)
    if not _PARAMETRIZED.match(g_key):
        hooks = module._forward_pre_hooks.values()  # the hook is the older form's only trace on the module
        return any(isinstance(h, WeightNorm) and h.name == name for h in hooks)
    chain, norm = module.get_submodule(f"parametrizations.{name}"), _norm_of(v, tuple(g.shape))
    if not isinstance(chain, ParametrizationList) or len(chain) != 1 or norm is None:
        return False
    with torch.no_grad():
        return bool(torch.allclose(chain[0](g, v), v * (g / norm), rtol=1e-5, atol=1e-7))


def _weight_norm_hint(wanted: dict[str, torch.Tensor], state: dict[str, Any]) -> str | None:
    """The fix where the checkpoint holds, in weight_norm's form, weights the model has plain (or the model has
    under weight_norm weights the checkpoint holds plain and of other shapes): apply or remove weight_norm to
    match; None where no weight pairs up so."""
    missing = [k for k in wanted if k not in state]
    unexpected = [k for k in state if k not in wanted]
    normed = [b for b in _weight_norm_pairs(unexpected) if b in missing]
    plain = [b for b in _weight_norm_pairs(missing) if b in unexpected]
    if normed:
        return (
            f"the checkpoint holds {_few(normed)} under weight_norm and the model without: apply "
            "torch.nn.utils.parametrizations.weight_norm to those layers in the model, as in the model that saved "
            "it, or save the checkpoint with weight_norm removed (torch.nn.utils.parametrize.remove_parametrizations"
            "(layer, 'weight'); torch.nn.utils.remove_weight_norm(layer) for weight_g/weight_v)"
        )
    if plain:
        return (
            f"the model holds {_few(plain)} as weight_norm's two tensors and the checkpoint as a plain weight of "
            "another shape (or the model's parametrization is not weight_norm): build the model as the one that "
            "saved the checkpoint, with weight_norm on the same layers or on none"
        )
    return None


def _without_unused(model: nn.Module, state: dict[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    """``state`` without the keys ``model`` has no use for, where it holds every key of the model with the model's
    shape: those are all its weights, and the rest belong to modules it leaves out (a CLIPModel checkpoint's
    ``vision_model.*`` and ``logit_scale`` for its text tower), said in a warning. Else ``state`` as it is, for the
    strict load to sum up what does not fit (a missing key or another shape is another architecture, and so is a
    key under a module the model has: ``layers.2.*`` of a deeper model beside its ``layers.0``, ``layers.1``)."""
    wanted = model.state_dict()
    unused = [k for k in state if k not in wanted]
    fits = all(k in state and _shape(state[k]) == tuple(v.shape) for k, v in wanted.items())
    modules = {prefix for k in wanted for prefix in _module_paths(k)}
    deeper = any(prefix in modules for k in unused for prefix in _module_paths(k))
    if not unused or not fits or deeper:
        return state
    log.warning(
        "checkpoint %s: %d key%s not used by model %s (%s); every key of the model is loaded from it",
        source,
        len(unused),
        "s" if len(unused) != 1 else "",
        type(model).__name__,
        _few(_key_groups(unused), 4),
    )
    return {k: v for k, v in state.items() if k in wanted}


def _module_paths(key: str) -> list[str]:
    """The modules a state key lies under, indices as ``#`` (the nth of a list of like modules is one of them):
    ``layers``, ``layers.#``, ``layers.#.attn`` for ``layers.2.attn.weight``."""
    parts = ["#" if part.isdigit() else part for part in key.split(".")[:-1]]
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def _shape(value: Any) -> tuple[int, ...] | None:
    """A state value's shape (None for one that is no tensor, which then fits no key)."""
    return tuple(value.shape) if is_tensor(value) else None


def _key_groups(keys: list[str]) -> list[str]:
    """``keys`` by their first dotted part, in order: ``vision_model.* (39 keys)`` for several under one, a key
    alone as itself (``logit_scale``)."""
    groups: dict[str, list[str]] = {}
    for key in keys:
        groups.setdefault(key.split(".", 1)[0], []).append(key)
    return [f"{first}.* ({len(held)} keys)" if len(held) > 1 else held[0] for first, held in groups.items()]


def _few(items: list[str], n: int = 3) -> str:
    """The first ``n`` of ``items`` and how many more: the examples of a long list of keys."""
    more = f", ... {len(items) - n} more" if len(items) > n else ""
    return ", ".join(items[:n]) + more


def _misfit(wanted: dict[str, torch.Tensor], state: dict[str, Any], exc: RuntimeError) -> tuple[str, list[str]]:
    """How ``state`` misses the model's keys ``wanted``: the count and first few of the missing keys, the unexpected
    ones and the size mismatches, and a prefix that explains missing keys; with the prefixes under which the
    checkpoint has all of its missing keys. Torch's own first lines where the keys and shapes all fit (a module's
    own loading refused the state)."""
    missing = [k for k in wanted if k not in state]
    unexpected = [k for k in state if k not in wanted]
    sizes = [
        f"{k}: {list(v.shape)} in the checkpoint, {list(wanted[k].shape)} in the model"
        for k, v in state.items()
        if k in wanted and is_tensor(v) and v.shape != wanted[k].shape
    ]
    parts = [f"{len(missing)} of the model's {len(wanted)} keys missing ({_few(missing)})"] if missing else []
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected key{'s' if len(unexpected) > 1 else ''} ({_few(unexpected)})")
    if sizes:
        parts.append(f"size mismatch for {len(sizes)} key{'s' if len(sizes) > 1 else ''} ({_few(sizes, 2)})")
    if not parts:
        return " ".join(str(exc).split())[:400], []
    note, prefixes = _prefix_note(missing, unexpected)
    return "; ".join(parts) + note, [] if sizes else prefixes


def _prefix_note(missing: list[str], unexpected: list[str]) -> tuple[str, list[str]]:
    """Where missing keys are unexpected ones under a prefix (the checkpoint's ``model.head.weight`` for the
    model's ``head.weight``), or the other way round: the sentence saying so, and the checkpoint's prefixes that
    hold every missing key."""
    ours = _prefix_counts(unexpected, set(missing))
    if ours:
        top = max(ours.values())
        prefixes = sorted(p for p, n in ours.items() if n == top)
        how_many = f"the {top}" if top == len(missing) else f"{top} of the"
        where = f"the prefix '{prefixes[0]}'" if len(prefixes) == 1 else "each of the prefixes "
        where += ", ".join(f"'{p}'" for p in prefixes) if len(prefixes) > 1 else ""
        example = next(k for k in missing if f"{prefixes[0]}{k}" in unexpected)
        note = f"; the checkpoint has {how_many} missing keys under {where} ({prefixes[0]}{example} for {example})"
        return note, prefixes if top == len(missing) else []
    theirs = _prefix_counts(missing, set(unexpected))
    if not theirs:
        return "", []
    prefix, top = theirs.most_common(1)[0]
    example = next(k for k in unexpected if f"{prefix}{k}" in missing)
    note = f"; the model has {top} of the unexpected keys under the prefix '{prefix}'"
    return f"{note} ({prefix}{example} for {example})", []


def _prefix_counts(keys: list[str], bare: set[str]) -> Counter[str]:
    """For each dotted prefix, how many of ``keys`` are a key of ``bare`` under it."""
    return Counter(k[: i + 1] for k in keys for i, c in enumerate(k) if c == "." and k[i + 1 :] in bare)


def _shared_prefix(keys: list[str]) -> str:
    """The dotted prefix every key starts with (``module.``, ``agent.policy.``), else ''."""
    parts = [k.split(".") for k in keys]
    if not parts:
        return ""
    common = []
    for level in zip(*(p[:-1] for p in parts)):
        if len(set(level)) > 1:
            break
        common.append(level[0])
    return "".join(f"{c}." for c in common)


def _without_wrapper_prefix(
    state: dict[str, torch.Tensor], wanted: set[str], tied: dict[str, str], source: str
) -> dict[str, torch.Tensor]:
    """``state`` with the prefix a wrapper put on every key (DDP's ``module.``, a training wrapper's ``agent.``)
    taken off, where the keys without it are the model's own, and said (:func:`_say_wrapper_prefix`); else the
    model's keys under one prefix (:func:`_model_under_prefix`); else ``state`` unchanged."""
    prefix = _shared_prefix(list(state))
    while prefix and not set(state) <= wanted:
        stripped = {k[len(prefix) :]: v for k, v in state.items()}
        if set(stripped) <= wanted:
            _say_wrapper_prefix(source, prefix)
            return stripped
        prefix = prefix[: prefix[:-1].rfind(".") + 1]  # one level shorter: 'agent.policy.' -> 'agent.'
    return _model_under_prefix(state, wanted, tied, source)


# The attributes of wrappers that run their module unchanged: DDP's and DataParallel's, torch.compile's
TRANSPARENT_WRAPPERS = {"module", "_orig_mod"}


def _say_wrapper_prefix(source: str, prefix: str) -> None:
    """Say that checkpoint ``source``'s keys were loaded without the wrapper's ``prefix``: as information for
    wrappers that run their module unchanged (each level one of :data:`TRANSPARENT_WRAPPERS`), else as a warning,
    since the wrapper's own forward (a guidance wrapper around a UNet, pre- or post-processing) is then not what is
    exported."""
    if set(prefix.split(".")[:-1]) <= TRANSPARENT_WRAPPERS:
        log.info("checkpoint %s: its keys carry the prefix '%s' (a wrapper's); loaded without it", source, prefix)
        return
    log.warning(
        "checkpoint %s: its keys carry the prefix '%s' (a wrapper's); loaded into the model without it, which runs "
        "without the wrapper's own forward (guidance, pre- or post-processing): give the wrapper as the model if it "
        "is the one to deploy",
        source,
        prefix,
    )


def _model_under_prefix(
    state: dict[str, torch.Tensor], wanted: set[str], tied: dict[str, str], source: str
) -> dict[str, torch.Tensor]:
    """The keys of ``state`` under the one prefix that holds every key the model has (a tied pair by either
    name), without it: a LightningModule's ``model.``, beside other modules of it (a loss's ``criterion.weight``),
    which are left out and said. Keys under the prefix are loaded as strictly as any. ``state`` unchanged where
    its top level has the model's keys, or no prefix or several (a student and a teacher) do."""
    need = {tied.get(k, k) for k in wanted}
    if need <= {tied.get(k, k) for k in state}:
        return state
    candidates = {k[: i + 1] for k in state for i, c in enumerate(k) if c == "." and k[i + 1 :] in wanted}
    covering = [p for p in candidates if need <= {tied.get(k[len(p) :], k[len(p) :]) for k in state if k.startswith(p)}]
    if len(covering) != 1:
        return state
    prefix = covering[0]
    left = [k for k in state if not k.startswith(prefix)]
    log.info(
        "checkpoint %s: the model's keys are under the prefix '%s'; loaded without it, leaving out %d key%s "
        "outside it (%s)",
        source,
        prefix,
        len(left),
        "s" if len(left) != 1 else "",
        _few(left),
    )
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}


class ModelShapeError(InputFileError):
    """A checkpoint that does not fit the model. ``hint``: the fix where the misfit says it (weight_norm on one side
    only); else, where the checkpoint holds all the model's keys under several prefixes (``prefixes``), to save one
    of them alone; otherwise to match the architecture."""

    def __init__(self, message: str, prefixes: list[str] | None = None, hint: str | None = None) -> None:
        super().__init__(message, hint=hint or _misfit_hint(prefixes))


def _misfit_hint(prefixes: list[str] | None) -> str:
    """The fix of a checkpoint that does not fit: save one of the ``prefixes`` alone, or match the architecture."""
    if prefixes:
        p = prefixes[0]
        return (
            f"save the weights under one prefix, without it: torch.save({{k.removeprefix('{p}'): v for k, v in "
            f"sd.items() if k.startswith('{p}')}}, path) for '{p}', and give that file"
        )
    return (
        "check model.name/model.params match the checkpoint's architecture; a factory that reads its "
        "architecture from a file: name the file in model.params (a change to it then retrains), or "
        "`kiln run --force train`"
    )


def save_trained(out: Path, model: nn.Module, config: ModelConfig, extra: dict[str, Any] | None = None) -> None:
    # weights_bytes + our atomic write rather than save_file(): that one leaves a 0600 file a server cannot read
    write_bytes_atomic(out / WEIGHTS, weights_bytes(model))
    spec = {"model": config.name, "params": config.params, **(extra or {})}
    (out / SPEC).write_text(json.dumps(spec, indent=2, sort_keys=True))


KEEP_BYTES = 1 << 30  # the largest weights file whose model :func:`load_trained` keeps for the next call
_kept: dict[tuple[Any, ...], nn.Module] = {}


def load_trained(train_dir: Path, config: ModelConfig) -> nn.Module:
    """Rebuild the model from the config and load the train stage's weights; eval mode, FP32, CPU.

    The export, build and validate stages of one run each ask for the same model, and rebuilding it initialises
    every weight at random before the load overwrites them: the last model
    loaded (weights up to :data:`KEEP_BYTES`) is kept unchanged and later calls get a copy of it, while the
    weights file, the model's name and its parameters stay the same."""
    path = train_dir / WEIGHTS
    key = _kept_key(path, config)
    if key in _kept:
        return copy.deepcopy(_kept[key])
    model = build_model(config.name, config.params)
    load_weights(model, read_state_dict(path), str(path))
    model = model.float().eval()
    _keep(key, path, lambda: copy.deepcopy(model), config)
    return model


def keep_trained(train_dir: Path, config: ModelConfig, model: nn.Module) -> None:
    """Hand :func:`load_trained` the model whose weights were just saved into ``train_dir`` (by
    :func:`save_trained`), so that the next stage copies it instead of building it again."""
    path = train_dir / WEIGHTS
    _keep(_kept_key(path, config), path, lambda: copy.deepcopy(model).float().eval(), config)


def _kept_key(path: Path, config: ModelConfig) -> tuple[Any, ...]:
    """The weights file by device and inode, not by path: the train stage writes it in a staging folder renamed
    into place once the stage is done, and a rewritten file (written atomically) has a new inode. Then the model."""
    stat = path.stat()
    params = json.dumps(config.params, sort_keys=True, default=repr)
    return (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, config.name, params)


def _keep(key: tuple[Any, ...], path: Path, copied: Callable[[], nn.Module], config: ModelConfig) -> None:
    """Keep ``copied()`` for ``key`` (and nothing else), unless its weights file is over :data:`KEEP_BYTES`."""
    _kept.clear()
    if path.stat().st_size > KEEP_BYTES:
        return
    try:
        _kept[key] = copied()
    except Exception:  # a module that cannot be copied is rebuilt each time
        log.debug("model %s cannot be deep-copied: not kept", config.name, exc_info=True)
