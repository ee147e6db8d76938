"""The example inputs of ``kiln export -o``: ``--input-shape`` values (``[NAME=]DIMS[:DTYPE]``) parsed into specs
and made into random inputs (an attention mask a valid one), or else the configured data's first rows; and the hint
for a model whose inputs Kiln cannot tell."""

from __future__ import annotations

import inspect
import re

import numpy as np
import torch
from torch import nn

from kiln.core.data import SINGLE_INPUT, Inputs, call, input_names, take
from kiln.core.errors import ConfigError
from kiln.core.inputs import random_inputs
from kiln.core.labels import is_label_name, is_mask_name, is_padding_mask_name
from kiln.core.records import TensorSpec
from kiln.core.shapes import is_length_name
from kiln.core.text import first_line
from kiln.models.model_io import dataset_for
from kiln.models.registry import DEFAULT_DATASET
from kiln.stages.export.declaration import ExportSettings
from kiln.stages.export.parity import PARITY_ROWS
from kiln.stages.train.stage import check_fp32, wrong_float_inputs


def example_source(specs: list[TensorSpec] | None) -> str:
    """Where direct export's example inputs came from, for its parity error."""
    return "random inputs of the --input-shape sizes" if specs else "the first rows of the configured data"


def direct_example(cfg: ExportSettings, model: nn.Module, specs: list[TensorSpec] | None) -> Inputs:
    """``PARITY_ROWS`` rows of example inputs the model is known to take: of ``specs`` (``--input-shape``) or the
    data's (fewer where the data has fewer). A model of half-precision weights is refused first, as ``kiln run``'s
    train stage refuses it (:func:`check_fp32`): float32 inputs fail in it, or its graph in ONNX's shape inference,
    and neither error says why."""
    check_fp32(model, cfg.model.name)
    if specs:
        example = example_inputs(specs, PARITY_ROWS)
        what = "the inputs --input-shape gives (" + _describe(specs) + ")"
    elif cfg.data.name is None and cfg.model.name not in DEFAULT_DATASET and not cfg.model.onnx:
        raise ConfigError(
            f"cannot tell which inputs model '{cfg.model.name}' takes: no --input-shape and no data configured",
            hint=input_shape_hint(model),
        )
    else:
        data = dataset_for(cfg.model, cfg.data, cfg.signature, cfg.seed)
        example = take(data.val_x, slice(0, PARITY_ROWS))
        what = f"the inputs of dataset '{cfg.data.name or data.name}'"
    try:
        with torch.no_grad():
            call(model, example)
    except Exception as exc:  # the model rejects them: say so, not "an op ONNX cannot express" or a traceback
        reason = first_line(exc)
        given = [s.name for s in specs or []]
        fix = specs and (
            _nhwc_fix(model, specs)
            or _names_fix(model, given)
            or _float_dtype_fix(model, specs, example)
            or _ids_fix(model, specs, example)
        )
        hint = fix or input_shape_hint(model, random=bool(specs), given=given)
        raise ConfigError(f"model '{cfg.model.name}' rejects {what}: {reason}", hint=hint) from None
    return example


def _nhwc_fix(model: nn.Module, specs: list[TensorSpec]) -> str | None:
    """The fix where an image ``--input-shape`` is given channels last (``64,64,3``) to a model whose first
    ``Conv2d`` takes that many channels on axis 1 (PyTorch's NCHW): the same sizes, channels first. None where no
    input looks so."""
    conv = next((m for m in model.modules() if isinstance(m, nn.Conv2d)), None)
    if conv is None:
        return None
    for spec in specs:
        dims = spec.shape[1:]
        if len(dims) == 3 and dims[2] in (1, 3) and dims[2] == conv.in_channels and dims[0] != dims[2]:
            name = "" if spec.name == SINGLE_INPUT else f"{spec.name}="
            nchw = f"{dims[2]},{dims[0]},{dims[1]}"
            return (
                f"the shape {','.join(map(str, dims))} looks NHWC (channels last), and the model's first Conv2d "
                f"takes {conv.in_channels} channels on axis 1; give it as {nchw}: --input-shape {name}{nchw}"
                f"{'' if spec.dtype == 'float32' else ':' + spec.dtype}"
            )
    return None


def _float_dtype_fix(model: nn.Module, specs: list[TensorSpec], example: Inputs) -> str | None:
    """The fix where float inputs ``--input-shape`` gave in another float dtype than the model's weights
    (``:float16`` for float32 weights) are what it rejects: the model runs once they are in the weights' dtype
    (:func:`~kiln.stages.train.stage.wrong_float_inputs`). None where the weights have no one float dtype, no input
    is off, or converting them does not make it run."""
    found = wrong_float_inputs(model, example)
    if found is None:
        return None
    names, weights = [input_names(model, example)[i] for i in found[0]], str(found[1]).removeprefix("torch.")
    off = [s for s in specs if s.name in names]
    unnamed = isinstance(example, torch.Tensor)
    shown = " ".join(f"--input-shape {'' if unnamed else s.name + '='}{_flag_dims(s)}:{weights}" for s in off)
    said = ", ".join(f"'{s.name}' {s.dtype}" for s in off)
    return f"give {said} as {weights}, the dtype of the model's weights: {shown}"


def _ids_fix(model: nn.Module, specs: list[TensorSpec], example: Inputs) -> str | None:
    """The fix where float inputs ``--input-shape`` gave (no ``:int64``) are ids the model looks up (an embedding's
    table rows): the model runs once they are int64 zeros, and each of them is needed so. None otherwise."""
    floats = [s.name for s in specs if s.dtype.startswith("float")]
    if not floats or not isinstance(example, dict):
        return None

    def runs(as_ids: list[str]) -> bool:
        x = {k: torch.zeros_like(v, dtype=torch.int64) if k in as_ids else v for k, v in example.items()}
        try:
            with torch.no_grad():
                call(model, x)
        except Exception:  # noqa: BLE001 - any failure is a no
            return False
        return True

    if not runs(floats):
        return None
    ids = [n for n in floats if not runs([m for m in floats if m != n])] or floats
    shown = " ".join(f"--input-shape {n}={_flag_dims(s)}:int64" for s in specs for n in ids if s.name == n)
    are = "are" if len(ids) > 1 else "is"
    return f"{', '.join(ids)} {are} ids the model looks up (it runs once they are int64): {shown}"


def _flag_dims(spec: TensorSpec) -> str:
    """A spec's shape without the batch axis, as ``--input-shape`` writes it (``()`` for one value per sample)."""
    dims = [str(d) for d in spec.shape[1:]]
    return ",".join(dims) if dims else "()"


def _names_fix(model: nn.Module, given: list[str]) -> str | None:
    """The fix where the names ``--input-shape`` gives (``given``) do not match the forward's parameters: a name
    it has no parameter of (and no ``**kwargs``), or a required parameter (no default, not a label) none gives. None
    where they match, or the forward's signature cannot be read: the values, not the names, are then what it
    rejects. An unnamed shape is the forward's first argument."""
    params = _forward_params(model)
    if not params:
        return None
    names = [p.name for p in params if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    unnamed = given == [SINGLE_INPUT] and SINGLE_INPUT not in names
    if unnamed:
        given = names[:1]
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    unknown = [] if takes_any else [n for n in given if n not in names]
    required = [p.name for p in params if p.name in names and p.default is inspect.Parameter.empty]
    missing = [n for n in required if n not in given and not is_label_name(n)]
    if not unknown and not missing:
        return None
    fixes = []
    if unknown:
        said = ", ".join(f"'{n}'" for n in unknown)
        verb = "is not a parameter" if len(unknown) == 1 else "are not parameters"
        fixes.append(f"{said} {verb} of {type(model).__name__}.forward; it takes {', '.join(names)}")
    if missing:
        flags = " ".join(f"--input-shape {n}=DIMS" for n in ([*given, *missing] if unnamed else missing))
        fixes.append(f"name each input: {flags}" if unnamed else f"add {flags}")
    return "; ".join(fixes) + f" ({SHAPE_EXAMPLE})"


def _forward_params(model: nn.Module) -> list[inspect.Parameter] | None:
    """The forward's parameters; None for a builtin or C++ forward, which has no signature to read."""
    try:
        return list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return None


def input_shape_hint(model: nn.Module, random: bool = False, given: list[str] | None = None) -> str:
    """The fix for a model whose inputs Kiln cannot tell: one ``--input-shape`` per input it needs
    (:func:`_suggested`). With ``random``, for a model that rejected ``--input-shape``'s inputs: their random values
    (a box whose x0 > x1, a length of 0), not their shapes, may be what it rejects, and real inputs come from a data
    function (``--set data.name``: ``kiln export`` reads no arrays of its own)."""
    flags = " ".join(f"--input-shape {n}=DIMS" for n in _suggested(model, given or []))
    shapes = f"{flags} (e.g. image=3,224,224, ids=128:int64, t=():int64 for one value per sample)"
    if random:
        return (
            "the shapes may be right and the values not: --input-shape fills each input with random values (floats "
            "standard normal, integers 0 or 1, each drawn on its own), which the model may reject (a box whose "
            "x0 > x1, a length of 0); give real samples instead of --input-shape: --set data.name=MODULE:FUNCTION, a "
            "data function the model takes (or a config naming one: kiln export CONFIG --checkpoint FILE -o FILE); "
            f"else check each input's shape, one sample without the batch axis: {shapes}"
        )
    return (
        f"give each input's shape, one sample without the batch axis: {shapes}, or a config whose data.name is a "
        "data function the model takes"
    )


# What DIMS is, after the flags the fix asks for
SHAPE_EXAMPLE = "DIMS one sample's shape without the batch axis, e.g. image=3,224,224, ids=128:int64, t=():int64"


def _suggested(model: nn.Module, given: list[str]) -> list[str]:
    """The inputs to give ``--input-shape`` for: those ``given`` (an unnamed one: the forward's first) that may be
    tensors (:func:`_not_a_tensor`: a rejected ``use_cache`` is not suggested again) and the forward's required
    parameters (no default) they lack, not its optional ones, which are alternatives (``inputs_embeds`` for
    ``input_ids``) or extras it works without. With none given: the required ones; else, where all have defaults, a
    ``transformers`` model's main input (``main_input_name``, with ``attention_mask`` where the forward takes one),
    or every parameter that may be a tensor. Never labels (``labels``, ``targets``: training's ``y``, refused among
    the inputs)."""
    params = _forward_params(model) or []
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    named = [p for p in params if p.kind in kinds and not is_label_name(p.name)]
    required = [p.name for p in named if p.default is inspect.Parameter.empty]
    tensors = [p.name for p in named if not _not_a_tensor(p)]
    if given == [SINGLE_INPUT] and SINGLE_INPUT not in (p.name for p in named):  # an unnamed shape: the first one
        given = (required or tensors or [p.name for p in named])[:1] or given
    if given:
        kept = [n for n in given if n not in {p.name for p in named if _not_a_tensor(p)}]
        return kept + [n for n in required if n not in kept] or ["NAME"]
    return required or _main_inputs(model, tensors) or tensors or ["NAME"]


# Parameters of a forward that are no input tensor: switches (use_cache, output_attentions), a cache from an earlier
# step, and alternatives to the ids (inputs_embeds)
_NOT_INPUTS = re.compile(
    r"use_cache|return_dict|output_\w+|logits_to_keep|num_logits_to_keep|\w*cache\w*|"
    r"past_key_values|\w*_embeds"
)


def _not_a_tensor(param: inspect.Parameter) -> bool:
    """Whether a forward's parameter is a setting, a cache or an alternative input rather than an input tensor to
    give: a bool, number or text default, or a name :data:`_NOT_INPUTS` matches."""
    default = param.default
    setting = isinstance(default, (bool, int, float, str)) and default is not inspect.Parameter.empty
    return setting or bool(_NOT_INPUTS.fullmatch(param.name))


def _main_inputs(model: nn.Module, tensors: list[str]) -> list[str]:
    """A ``transformers`` model's inputs (one with ``main_input_name`` and a ``config``): its main input
    (``input_ids``, ``pixel_values``) and ``attention_mask`` where the forward takes it; none for another model."""
    main = getattr(model, "main_input_name", None)
    if not isinstance(main, str) or not hasattr(model, "config") or main not in tensors:
        return []
    return [main] + [n for n in ("attention_mask",) if n in tensors and n != main]


INPUT_SHAPE_FORM = "[NAME=]DIMS[:DTYPE]"
# What DIMS may be: sizes, or nothing for a sample without axes (one value per sample, the input is [batch])
INPUT_SHAPE_HINT = (
    f"give {INPUT_SHAPE_FORM}, DIMS one sample's shape without the batch axis: positive integers (3,224,224 or "
    "3x224x224), or () for one value per sample, an input of shape [batch] (a timestep: t=():int64, or t=:int64); "
    "e.g. image=3x224x224 or ids=128:int64"
)


def parse_input_shapes(texts: tuple[str, ...]) -> list[TensorSpec]:
    """``--input-shape`` values, ``[NAME=]DIMS[:DTYPE]``: one sample's shape (positive integers separated by ``,``
    or ``x``, in parentheses or not, no batch axis; ``()`` or nothing for a sample without axes, whose input is
    ``[batch]``: a timestep per sample) and dtype (float32 by default) per input, as specs with a leading ``batch``
    axis. An unnamed shape is the model's only input (``input``), so it stands alone."""
    specs = [_parse_input_shape(t) for t in texts]
    names = [s.name for s in specs]
    if SINGLE_INPUT in names and len(specs) > 1 and not all("=" in t for t in texts):
        raise ConfigError(
            f"--input-shape given {len(specs)} times, not every one named: {list(texts)}",
            hint="name each input of a model with several: --input-shape x=8 --input-shape meta=3",
        )
    if len(set(names)) < len(names):
        raise ConfigError(f"--input-shape names an input twice: {names}", hint="give one --input-shape per input")
    return specs


# The dtypes an --input-shape input may have: those a random array of it is made in (numpy) and torch takes
INPUT_DTYPES = ("float32", "float16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")


def _parse_input_shape(text: str) -> TensorSpec:
    name, sep, rest = text.rpartition("=")
    dims, _, dtype = rest.partition(":")
    shape = _dims(dims)
    if shape is None or not text.strip() or (sep and not name.isidentifier()):
        raise ConfigError(f"--input-shape '{text}' is not {INPUT_SHAPE_FORM}", hint=INPUT_SHAPE_HINT)
    if dtype and _dtype_name(dtype) not in INPUT_DTYPES:
        raise ConfigError(
            f"--input-shape '{text}': '{dtype}' is not a dtype it takes",
            hint=f"give one of {', '.join(INPUT_DTYPES)} after the ':' (float32 where none is given)",
        )
    return TensorSpec(name=name if sep else SINGLE_INPUT, shape=["batch", *shape], dtype=dtype or "float32")


def _dtype_name(text: str) -> str | None:
    """numpy's name of dtype ``text`` (``float32`` for ``f4``); None for no dtype numpy knows."""
    try:
        return np.dtype(text).name
    except (TypeError, ValueError):
        return None


def _dims(text: str) -> list[int] | None:
    """One sample's sizes: ``3,224,224``, ``3x224x224`` or ``(3, 224, 224)``; ``()`` or nothing is a sample without
    axes. None for anything else (a size below 1, a word)."""
    inner = text.strip()
    if inner.startswith("(") and inner.endswith(")"):
        inner = inner[1:-1].strip()
    if not inner:
        return []
    try:
        shape = [int(s) for s in re.split(r"[,x]", inner)]
    except ValueError:
        return None
    return shape if all(d >= 1 for d in shape) else None


def example_inputs(specs: list[TensorSpec], batch: int = 2) -> Inputs:
    """Random inputs of ``specs`` (floats standard normal, integers 0 or 1, which any embedding takes; an input
    named like an attention mask a valid one, :func:`valid_mask`; one named like lengths the whole length,
    :func:`full_lengths`): one tensor for an unnamed shape, else a dict by name (the model is called with
    keywords)."""
    arrays = random_inputs(specs, batch, hint="give every axis a size in --input-shape")
    arrays = {k: valid_mask(v, padding=is_padding_mask_name(k)) if is_mask_name(k) else v for k, v in arrays.items()}
    arrays |= full_lengths(arrays)
    x = {k: torch.from_numpy(v) for k, v in arrays.items()}
    return x[SINGLE_INPUT] if [s.name for s in specs] == [SINGLE_INPUT] else x


def full_lengths(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each integer ``[batch]`` or ``[batch, 1]`` input of ``arrays`` named like each row's length
    (:func:`kiln.core.shapes.is_length_name`: ``lengths``, ``seq_len``), filled with the size of the axis it
    measures, at most: the smallest axis of 2 or more besides the batch of the other inputs (a sequence's frames
    beside its features, or its features where they are fewer: a length within every axis, which
    ``pack_padded_sequence`` takes too). Lengths of 0 or 1 would mask every key but one, or all, and the parity
    check would blame the model for the NaN its masked attention gives."""
    out = {}
    for name, value in arrays.items():
        if not is_length_name(name) or value.dtype.kind not in "iu" or value.shape[1:] not in {(), (1,)}:
            continue
        sizes = [d for other, v in arrays.items() if other != name for d in v.shape[1:] if d >= 2]
        if sizes:
            out[name] = np.full_like(value, min(sizes))
    return out


def valid_mask(like: np.ndarray, padding: bool = False) -> np.ndarray:
    """An attention mask of ``like``'s shape and dtype as tokenizers pad: each row ones then zeros along its last
    axis, the first row whole and each next one a token shorter, never below one token; with ``padding``, a padding
    mask of the same rows (True or 1 marks padding: its inverse). Random 0/1 would mask a row's first token, whose
    query under a causal mask then attends to no key: PyTorch and ONNX Runtime answer such a row differently, and
    the parity check would fail a good graph."""
    if like.ndim < 2:
        return (np.zeros_like if padding else np.ones_like)(like)
    length = like.shape[-1]
    kept = np.maximum(1, length - np.arange(like.shape[0]) % length)
    shape = (like.shape[0],) + (1,) * (like.ndim - 1)
    real = np.arange(length) < kept.reshape(shape)
    return np.broadcast_to(~real if padding else real, like.shape).astype(like.dtype)


def _describe(specs: list[TensorSpec]) -> str:
    return ", ".join(f"'{s.name}' {s.dtype}[{', '.join(map(str, s.shape))}]" for s in specs)
