"""The model's signature as a run declares it: which input axes vary, the sizes engines are built and validated
for, and which output holds class logits.

Several stages read it (export names the axes, precision calibrates at those sizes, build sizes its profiles,
validate runs at them), so it is one record of the lowest layer, handed to each stage that declares it, rather
than keys of one stage's section that other stages reach into. In a config file it is the ``signature:`` section;
its keys are also taken where earlier versions of Kiln read them (``export.dynamic_axes``,
``validate.batch_sizes``, ``validate.shapes``, ``validate.logits_output``).
"""

from __future__ import annotations

from typing import Any, Protocol

from pydantic import Field, PositiveInt, field_validator

from kiln.core.errors import ConfigError
from kiln.core.sections import Section

BATCH_AXIS = "batch"  # the name of axis 0 in every exported graph

# key -> the section that held it before it became part of the signature
FORMER_PLACES = {
    "dynamic_axes": "export",
    "batch_sizes": "validate",
    "shapes": "validate",
    "logits_output": "validate",
}


class HintedValueError(ValueError):
    """A config value's error that carries its own fix: pydantic keeps the exception in the error's context, and
    the config layer gives ``hint`` as the fix line in place of its generic one (:mod:`kiln.pipeline.config`)."""

    def __init__(self, message: str, hint: str) -> None:
        super().__init__(message)
        self.hint = hint


def _batch_of_one(axes: dict[str, dict[int, str]]) -> str:
    """``signature.dynamic_axes`` as ``axes`` declares it, each axis counted one later (a flow-style YAML mapping):
    the axes of its inputs given as a batch of one."""
    shifted = []
    for name, dims in axes.items():
        kept = ", ".join(f"{axis + 1}: {dim}" for axis, dim in dims.items() if axis >= 0)
        shifted.append(f"{name}: {{{kept}}}")
    return "{" + ", ".join(shifted) + "}"


def _axis_zero_fix(name: str, dim: str, axes: dict[str, dict[int, str]]) -> str:
    """The fix for axis 0 named in ``signature.dynamic_axes`` (``axes``): Kiln's export ties every input's axis 0
    into the one batch axis. Inputs without a batch axis (a graph neural network's ``x [nodes, F]`` beside
    ``edge_index [2, edges]``) are given as a batch of one, through a wrapper that unwraps it (docs/byom.md, whose
    recipe this words alike: an ONNX file in the batchless layout is refused too); a model taking inputs in counts
    of their own is exported by the user, with a name per first axis, and given as ``model.onnx`` (whose axis names
    Kiln keeps: docs/serving.md)."""
    taken = ", ".join(f"{n}[0]" for n in axes)
    return (
        "for inputs without a batch axis (a graph neural network's nodes and edges), give each sample as a batch of "
        f"one: a wrapper whose forward takes {taken} and returns out.unsqueeze(0), data with an axis of 1 in front, "
        f"signature.batch_sizes: [1] and signature.dynamic_axes: {_batch_of_one(axes)} (docs/byom.md); for inputs "
        "taken in counts of their own (a two-tower model's images and texts), export the model yourself "
        f"with a name per first axis (torch.onnx.export(..., dynamic_axes={{'{name}': {{0: '{dim}'}}, ...}})) and "
        "give it as model.onnx, whose axis names Kiln keeps; else drop axis 0 from signature.dynamic_axes (the "
        "batch axis is dynamic already)"
    )


class Signature(Section):
    """``signature:``: the model's inputs and outputs beyond what its code says."""

    dynamic_axes: dict[str, dict[int, str]] = Field(
        default_factory=dict,
        description="axes besides batch that vary, per input: {input_ids: {1: seq}}; the same name ties axes of "
        "several inputs together",
    )
    batch_sizes: list[PositiveInt] = Field(
        default_factory=lambda: [1, 32],
        min_length=1,
        description="batch sizes engines are validated and timed at; the largest also sizes engine profiles",
    )
    shapes: dict[str, list[int]] = Field(
        default_factory=dict,
        description="sizes of each dynamic axis (a dynamic_axes name -> sizes) to validate at; default: the "
        "smallest and largest in the data",
    )
    logits_output: str | int | None = Field(
        None,
        description="the class-logit output (name or index) for top-1 agreement and accuracy; null: the only "
        "output, else one named 'logits', else none (outputs compared by error and cosine only)",
    )

    # Axis 0 of every input is one batch axis in Kiln's export; a model taking inputs in counts of their own has a
    # way: a graph whose first axes carry names of their own is taken as they are (docs/serving.md).
    @field_validator("dynamic_axes")
    @classmethod
    def _axes_besides_batch(cls, value: dict[str, dict[int, str]]) -> dict[str, dict[int, str]]:
        # Axis 0 is the batch (export.dynamic_batch); an axis named "batch" would be tied to it: a channel axis
        # named so became the engines' batch axis.
        for name, axes in value.items():
            for axis, dim in axes.items():
                if axis < 1:
                    raise HintedValueError(
                        f"input '{name}' axis {axis}: axes are counted from 1 here (0 is the batch, which "
                        "export.dynamic_batch makes dynamic; negative indices are not taken)"
                        + (". Kiln's export gives every input's axis 0 the one batch axis" if axis == 0 else ""),
                        _axis_zero_fix(name, str(dim), value)
                        if axis == 0
                        else f"count the axes from 1, axis 1 the first after the batch (e.g. {{{name}: {{1: {dim}}}}})",
                    )
                if not str(dim).strip() or str(dim) == BATCH_AXIS:
                    raise ValueError(
                        f"input '{name}' axis {axis} is named {dim!r}: give it a name of its own "
                        f"('{BATCH_AXIS}' is the batch axis 0), e.g. seq"
                    )
        return value

    @field_validator("shapes")
    @classmethod
    def _sizes_taken(cls, value: dict[str, list[int]]) -> dict[str, list[int]]:
        """Sizes of 0 or more: an axis besides the batch may be empty (a decoder's past at the prefill step, which
        engines then take at 0); the batch never is (ONNX Runtime's LSTM and GRU kernels abort on an empty batch)."""
        for name, sizes in value.items():
            if name == BATCH_AXIS and 0 in sizes:
                raise ValueError(
                    f"axis '{name}' sizes {sizes}: the batch takes no size 0; give batch sizes of at least 1 in "
                    "signature.batch_sizes (signature.shapes sizes the axes besides the batch)"
                )
            if not sizes or any(size < 0 for size in sizes):
                raise ValueError(
                    f"axis '{name}' sizes {sizes}: give one or more sizes of 0 or more (0: an empty axis, a "
                    "decoder's past at its first step)"
                )
        return value

    @field_validator("batch_sizes")
    @classmethod
    def _sorted_unique(cls, value: list[int]) -> list[int]:
        # Reports and the CLI read the last batch size as the largest one.
        return sorted(set(value))

    @property
    def max_batch(self) -> int:
        return self.batch_sizes[-1]

    def declared_axes(self) -> list[str]:
        """The axis names ``dynamic_axes`` declares besides the batch, sorted."""
        return sorted({str(d) for axes in self.dynamic_axes.values() for d in axes.values()} - {BATCH_AXIS})

    def refuse_undeclared_shapes(self) -> None:
        """``shapes`` keyed by axes ``dynamic_axes`` declares, or the error naming those it does not (a model whose
        graph Kiln exports has the axes ``dynamic_axes`` declares and no other)."""
        names = self.declared_axes()
        unknown = sorted(set(self.shapes) - set(names))
        if unknown:
            raise ConfigError(
                f"signature.shapes names axes {unknown}; signature.dynamic_axes declares {names or 'none'}",
                hint=undeclared_hint(unknown, names),
            )

    def axis_ranges(self, seen: dict[str, list[int]] | None = None) -> dict[str, list[int]]:
        """Each dynamic axis besides batch -> [smallest, largest]: the sizes ``shapes`` asks for, else ``seen``
        (the sizes the data holds)."""
        return {k: [min(v), max(v)] for k, v in ((seen or {}) | self.shapes).items() if v}


def undeclared_hint(unknown: list[str], names: list[str]) -> str:
    """The fix where signature.shapes names axes ``unknown`` that signature.dynamic_axes does not declare (``names``:
    those it does): keyed by a declared name; where it declares none, the axis declared there (the graph is then
    exported with it dynamic) or the sizes left out."""
    if names:
        return f"key signature.shapes by the axis names of signature.dynamic_axes, e.g. {{{names[0]}: [8, 32]}}"
    return (
        f"declare {', '.join(unknown)} in signature.dynamic_axes, by input and axis (e.g. {{input_ids: {{1: "
        f"{unknown[0]}}}}}), and export again; or leave signature.shapes out"
    )


class _ExportsModel(Protocol):
    """Settings of a stage that exports the model: the model's section (``onnx``: the file that replaces it) and
    the signature."""

    @property
    def model(self) -> Any: ...

    @property
    def signature(self) -> Signature: ...


def check_declared_shapes(settings: _ExportsModel) -> None:
    """A stage's quick check (:attr:`kiln.core.stage.Stage.checks`, run before the first stage does work): where
    Kiln exports the PyTorch model, ``signature.shapes`` names only axes ``signature.dynamic_axes`` declares, said
    before training and export rather than after them. A run from ``model.onnx`` takes the file's own axis names,
    which the stages that read the file check; so do the direct commands on a file, which run no stage checks."""
    if not settings.model.onnx:
        settings.signature.refuse_undeclared_shapes()


def gather(data: dict[str, Any]) -> dict[str, Any]:
    """A raw config with the signature's keys moved from their former places into ``signature:`` (a key given in
    both places is an error, not a silent choice)."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()}
    signature = dict(out.get("signature") or {})
    for key, section in FORMER_PLACES.items():
        held = out.get(section)
        if isinstance(held, dict) and key in held:
            if key in signature:
                raise ValueError(f"{section}.{key} and signature.{key} are both given: keep one (signature.{key})")
            signature[key] = held.pop(key)
    if signature or "signature" in out:
        out["signature"] = signature
    return out
