"""What the accuracy check reads: the gates per precision, the user's metric and how many held-out samples. Keys
of the ``validate:`` section (validation applies them to engines; the precision stage to variants)."""

from __future__ import annotations

import difflib
import logging
import math
from typing import Any

from pydantic import (
    Field,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)

from kiln.core.sections import Section
from kiln.stages.precision.config import PRECISIONS

log = logging.getLogger("kiln.config")
# The validation context of a per-precision value checked against its gate's bounds, as a top-level gate alone:
# no gate the user set there to hold against the per-precision defaults
BOUNDS_ONLY: dict[str, bool] = {"bounds_only": True}

# The gate whose default each precision derives from its min_cosine (derived_rel_err)
REL = "max_rel_err"

BUILTIN_METRICS = (
    "accuracy",
    "macro_f1",
    "multilabel_f1",
    "token_accuracy",
    "mse",
    "rmse",
    "mae",
    "smape",
    "detection_recall",
)


# max_systematic_err's defaults (kiln.core.compare.systematic): several times the systematic part real engines of
# each precision carry, and under a scale of x1.05 (0.05) or an offset a user would call a broken engine
SYSTEMATIC_FP32 = 0.002
SYSTEMATIC_FP16 = 0.01
SYSTEMATIC_8BIT = 0.03


def _default_per_precision() -> dict[str, dict[str, float]]:
    return {
        "fp16": {"min_cosine": 0.999, "max_systematic_err": SYSTEMATIC_FP16},
        "int8": {
            "min_cosine": 0.99,
            "min_top1_agreement": 0.97,
            "max_accuracy_drop": 0.02,
            "max_systematic_err": SYSTEMATIC_8BIT,
        },
        "fp8": {  # as INT8: 8 bits
            "min_cosine": 0.99,
            "min_top1_agreement": 0.97,
            "max_accuracy_drop": 0.02,
            "max_systematic_err": SYSTEMATIC_8BIT,
        },
    }


class GatesConfig(Section):
    min_cosine: float = Field(
        0.9999,
        ge=-1.0,
        le=1.0,
        description="cosine similarity vs PyTorch of each float output, flattened, and of its worst sample "
        "(kiln.core.compare 'cosine', 'sample_cosine')",
    )
    max_abs_err: float | None = Field(None, ge=0, description="max abs output error vs PyTorch; null = unchecked")
    max_rel_err: float | None = Field(
        None,
        ge=0,
        description="relative error of each float output vs PyTorch: the RMS of the error over how the reference "
        "varies between held-out samples (RMS of its deviation from its mean over them, at least 1 % of its RMS; "
        "a mask's fill alike in both, -inf or -1e9, left out); "
        "null = sqrt(2 * (1 - min_cosine)), the error min_cosine allows in any direction (cosine alone misses an "
        "offset or a scale), for every float output; the class logits' error is over their norm, and in INT8/FP8 "
        "engines only a set max_rel_err holds them (top-1 agreement guards them there)",
    )
    max_systematic_err: float | None = Field(
        SYSTEMATIC_FP32,
        ge=0,
        description="the systematic part of each float output's error vs PyTorch, from the least-squares line of the "
        "engine's values on the reference's: sqrt((slope - 1)^2 + (mean(got - ref) / d)^2), d what max_rel_err's "
        "error is over, less what noise alone may give (kiln.core.compare 'systematic_err'). Rounding and "
        "quantization scatter around got = ref; a scale or an "
        "offset (a wrong calibrated range, a dropped bias) is on the line for every sample, which cosine cannot see "
        "and max_rel_err's noise allowance passes. Held by the outputs max_rel_err holds (unless it is set, not an "
        "INT8/FP8 engine's softmax class logits); null = unchecked at FP32 (a precision's own default stays: "
        "per_precision.<precision>.max_systematic_err: null turns that one off)",
    )
    min_top1_agreement: float = Field(
        0.99,
        ge=0,
        le=1.0,
        description="fraction of samples whose argmax matches PyTorch, on the class-logit output of a task with "
        "classes (integer labels, or num_classes in the data) or the one signature.logits_output names (with "
        "positions, [N, A, C] or [N, C, H, W]: the labelled ones, else those where PyTorch's top class has a "
        "probability of 0.5 or more); of a binary classifier's one logit or a multi-label head's logits (float 0/1 "
        "targets shaped like them), the share of their decisions (the logit above 0; one per sample, or per "
        "(sample, label) pair) that match; an integer output's share of equal values",
    )
    max_accuracy_drop: float = Field(
        0.01, ge=0, le=1.0, description="allowed task-accuracy drop vs PyTorch (0.01 = 1 point)"
    )
    max_metric_drop: float = Field(
        0.01,
        ge=0,
        description="allowed drop of validate.metric vs the reference: in the metric's own units for a share "
        "(accuracy, the F1s, detection_recall: 0.01 = 1 point); for an error metric (mse, rmse, mae, smape, and a "
        "pkg.mod:fn with relative = True) its rise over the targets' spread in its units (mse: their variance, "
        "0.01 = one point of R^2; rmse: their standard deviation; mae: their mean absolute deviation), else over the "
        "reference's value (0.01 = 1 % more error; in its own units where that is 0)",
    )
    max_latency_p50_ms: float | None = Field(None, gt=0, description="latency budget at the largest batch size")
    gated_outputs: list[str] | None = Field(
        None,
        min_length=1,
        description="the outputs the gates above hold (cosine, errors, top-1 agreement), by name: the others are "
        "still compared and reported, and their misses fail no engine and no precision fallback round (a seq2seq "
        "model's encoder_last_hidden_state beside its logits); task accuracy and validate.metric stay gated; "
        "null = every output",
    )
    # Reduced precisions get their own looser defaults: FP16/INT8 cannot match FP32 to 1e-4.
    per_precision: dict[str, dict[str, float | None]] = Field(
        default_factory=lambda: _default_per_precision(),
        description="overrides of the gates above per precision, merged into these defaults gate by gate; a gate "
        "above set stricter than its default holds every precision whose own value here is not set, and one set "
        "looser leaves a precision's stricter default (said in a warning); max_rel_err's default for a precision "
        "is the one its min_cosine derives",
    )

    @model_validator(mode="wrap")
    @classmethod
    def _set_gates_hold(cls, data: Any, handler: ValidatorFunctionWrapHandler, info: ValidationInfo) -> Any:
        """The gates as validated, with the top-level ones the user set held against the per-precision defaults
        (:meth:`_hold_set_gates`); the per-precision values the raw ``data`` names are the user's own. Not where
        a per-precision value is checked against its gate's bounds alone (:data:`BOUNDS_ONLY`)."""
        gates = handler(data)
        if isinstance(data, dict) and info.context is not BOUNDS_ONLY:  # an instance (assignment, copies): held
            given = data.get("per_precision")
            gates._hold_set_gates(given if isinstance(given, dict) else {})
        return gates

    def _hold_set_gates(self, given: dict[str, Any]) -> None:
        """Each top-level gate the user set, against the per-precision values they did not (``given``: those they
        did). Tightened past its default, it replaces a looser per-precision default: a user who tightens "the
        gate" expects every engine held to it. Set looser than a precision's default, that default stays, and a
        warning names the key that loosens it: the per-precision defaults are the looser gates reduced precisions
        need, never tightened by loosening the FP32 one. ``max_rel_err`` has no per-precision default of its own:
        each precision's is the one its ``min_cosine`` derives, so it comes after ``min_cosine`` and is held or
        left precision by precision."""
        defaults = _default_per_precision()
        for gate in sorted(self.model_fields_set - {"per_precision", "gated_outputs"}, key=lambda g: (g == REL, g)):
            value, default = getattr(self, gate), type(self).model_fields[gate].default
            if gate == REL and value is None:
                continue  # max_rel_err: null is every precision's derived default
            tightened = value != default and _stricter(gate, value, default) == value
            held, kept = {}, {}  # the looser defaults it replaces; the stricter ones that stay
            for precision, own in self.per_precision.items():
                mine = (given.get(precision) or {}).get(gate)  # a value equal to the default (a printed config) is not
                current = self._own_default(gate, own)
                if current is None or current == value or mine not in (None, defaults.get(precision, {}).get(gate)):
                    continue
                stricter = _stricter(gate, value, current) == value
                if gate != REL and stricter != tightened:
                    continue
                (held if stricter else kept)[precision] = current
                if stricter or gate == REL:
                    own[gate] = value if stricter else None  # None: the derived default, not the top-level value
            for touched, tighter in ((held, True), (kept, False)):
                if touched:
                    _warn_defaults(gate, value, touched, tighter)

    def _own_default(self, gate: str, own: dict[str, float | None]) -> float | None:
        """A precision's own limit of ``gate`` (None: it has none to hold against the top-level one); for
        ``max_rel_err`` unset, the one its ``min_cosine`` derives."""
        if gate == REL and own.get(REL) is None:
            return derived_rel_err(own.get("min_cosine", self.min_cosine))
        return own.get(gate)

    @field_validator("per_precision", mode="before")
    @classmethod
    def _merge_with_defaults(cls, value: Any) -> Any:
        # Relaxing one gate must not drop the other defaults (which would tighten them to the FP32 gates).
        if not isinstance(value, dict):
            return value  # pydantic reports the type error
        merged: dict[str, Any] = _default_per_precision()
        for precision, overrides in value.items():
            if isinstance(overrides, dict) and "gated_outputs" in overrides:
                raise ValueError(
                    f"{precision}.gated_outputs: one list for every precision (validate.gates.gated_outputs)"
                )
            both = isinstance(overrides, dict) and isinstance(merged.get(precision), dict)
            merged[precision] = {**merged[precision], **overrides} if both else overrides
        return merged

    def of_precision(self, precision: str) -> dict[str, Any]:
        """The gates an engine of ``precision`` is held to: these, with that precision's ``per_precision`` values
        merged in gate by gate; ``gated_outputs`` only where set (absent: every output)."""
        gates = self.model_dump(exclude=None if self.gated_outputs else {"gated_outputs"})
        own = gates.pop("per_precision").get(precision, {})
        return gates | own

    @field_validator("per_precision")
    @classmethod
    def _known_overrides(cls, value: dict[str, dict[str, float | None]]) -> dict[str, dict[str, float | None]]:
        # A dict of dicts escapes the strict section check: a misspelt gate would be silently ignored.
        gates = sorted(set(cls.model_fields) - {"per_precision", "gated_outputs"})
        for precision, overrides in value.items():
            if precision not in PRECISIONS:
                raise ValueError(f"unknown precision '{precision}' (valid: {', '.join(PRECISIONS)})")
            unknown = sorted(set(overrides) - set(gates))
            if unknown:
                raise ValueError(f"unknown gate {unknown} for {precision} (valid gates: {', '.join(gates)})")
            for gate, limit in overrides.items():  # the same bounds as the gate itself (a plain dict escapes them)
                try:
                    cls.model_validate({gate: limit}, context=BOUNDS_ONLY)
                except ValidationError as exc:
                    raise ValueError(f"{precision}.{gate}: {exc.errors()[0]['msg']} (got {limit!r})") from None
        return value


class CheckConfig(Section):
    """The keys of ``validate:`` the accuracy check reads."""

    max_samples: int | None = Field(None, ge=1, description="cap on held-out samples used for accuracy")
    gates: GatesConfig = Field(default_factory=GatesConfig)
    metric: str | None = Field(
        None,
        description="the task's metric on the held-out split, gated by gates.max_metric_drop: a built-in ("
        + ", ".join(BUILTIN_METRICS)
        + ") or pkg.mod:fn taking (outputs by name, labels) as NumPy arrays and returning a float (where the data "
        "has no labels, its labels are the reference's outputs by name, and the reference's own score is the baseline; "
        "its attributes higher_is_better = False and relative = True make it an error metric, judged by its relative "
        "rise); the precision fallback searches against it too; null: mse for float targets (a regression's) whose "
        "prediction is one output, else none",
    )
    metric_higher_is_better: bool | None = Field(
        None, description="the metric's direction; null: the function's higher_is_better attribute, else higher"
    )

    @field_validator("metric")
    @classmethod
    def _known_metric(cls, value: str | None) -> str | None:
        if value is not None and value not in BUILTIN_METRICS and ":" not in value:
            close = difflib.get_close_matches(value, list(BUILTIN_METRICS), n=1)
            raise ValueError(
                f"unknown metric '{value}'{f' (did you mean {close[0]!r}?)' if close else ''}: use one of "
                f"{list(BUILTIN_METRICS)} or an import path 'pkg.mod:fn'"
            )
        return value


def derived_rel_err(min_cosine: float) -> float:
    """The relative error ``min_cosine`` allows at right angles to the reference, sqrt(2 (1 - c)), now in any
    direction, since cosine alone passes an offset or a scale: ``max_rel_err`` where none is set."""
    return round(math.sqrt(2.0 * (1.0 - min_cosine)), 6)


def _stricter(gate: str, a: float | None, b: float | None) -> float | None:
    """The stricter of two limits of ``gate``: the higher of a ``min_`` gate's, the lower of a ``max_`` gate's
    (None, unchecked, is the loosest)."""
    if a is None or b is None:
        return b if a is None else a
    return max(a, b) if gate.startswith("min_") else min(a, b)


def _warn_defaults(gate: str, value: float | None, defaults: dict[str, float], tightened: bool) -> None:
    """Said where a top-level gate the user set replaces the looser ``defaults`` of some precisions (``tightened``:
    an INT8 variant that met its own default may now be left unmade), or leaves their stricter ones."""
    keys = [f"validate.gates.per_precision.{p}.{gate}" for p in defaults]
    values = ", ".join(f"{p} {v}" for p, v in defaults.items())
    if tightened:
        said = f"holds {', '.join(defaults)} engines too, in place of their looser defaults ({values}); to keep one, "
        said += f"set {' or '.join(keys)}"
    else:
        said = f"does not hold {', '.join(defaults)} engines: their own defaults ({values}) are stricter and stay; "
        said += f"to loosen them too, set {', '.join(keys)}"
    log.warning("validate.gates.%s %s %s", gate, "null" if value is None else value, said)
