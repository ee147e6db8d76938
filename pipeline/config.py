"""The run configuration: typed sections, loaded from YAML or TOML, validated with clear errors.

Each stage owns its section's model (``stages/<stage>/config.py``); this module assembles them. Unknown keys,
wrong types and missing files become one :class:`ConfigError` naming the key and the valid choices.
"""
from __future__ import annotations

import json
import tomllib
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import Field, PositiveInt, ValidationError, field_validator

from kiln.calibration.config import CalibrationConfig
from kiln.core.errors import ConfigError, InputFileError
from kiln.core.sections import Section
from kiln.stages.engines.config import BuildConfig
from kiln.stages.optimize.config import OptimizeConfig
from kiln.stages.precision.config import Precision, PrecisionConfig
from kiln.stages.train.config import TrainConfig


DEMO_CONFIG = Path(__file__).with_name("demo.yaml")
PRECISIONS: tuple[str, ...] = get_args(Precision)


class ModelConfig(Section):
    name: str = Field("cnn", description="built-in model name or import path 'package.module:function'")
    params: dict[str, Any] = Field(default_factory=dict, description="keyword arguments for the model factory")
    checkpoint: str | None = Field(None, description="state dict (.safetensors/.pt) to start from; skips training")


class DataConfig(Section):
    name: str | None = Field(None, description="built-in dataset or 'package.module:function'; default per model")
    params: dict[str, Any] = Field(default_factory=dict)


class ExportConfig(Section):
    opset: int = Field(18, ge=13, le=23, description="the dynamo exporter needs >= 18")
    dynamic_batch: bool = Field(True, description="false: a fixed-batch graph; direct `kiln export` only")
    parity_atol: float = Field(1e-4, gt=0, description="max abs error allowed between ONNX Runtime and PyTorch")


def _default_per_precision() -> dict[str, dict[str, float]]:
    return {"fp16": {"min_cosine": 0.999}, "int8": {"min_cosine": 0.99, "min_top1_agreement": 0.97,
                                                      "max_accuracy_drop": 0.02}}


class GatesConfig(Section):
    min_cosine: float = Field(0.9999, le=1.0, description="cosine similarity of outputs vs PyTorch")
    max_abs_err: float | None = Field(None, description="max abs output error vs PyTorch; null = unchecked")
    min_top1_agreement: float = Field(0.99, le=1.0, description="fraction of samples whose argmax matches PyTorch")
    max_accuracy_drop: float = Field(0.01, description="allowed task-accuracy drop vs PyTorch (0.01 = 1 point)")
    max_latency_p50_ms: float | None = Field(None, description="latency budget at the largest batch size")
    # Reduced precisions get their own looser defaults: FP16/INT8 cannot match FP32 to 1e-4.
    per_precision: dict[str, dict[str, float]] = Field(
        default_factory=lambda: _default_per_precision(),
        description="overrides of the gates above per precision, merged into these defaults gate by gate")

    @field_validator("per_precision", mode="before")
    @classmethod
    def _merge_with_defaults(cls, value: Any) -> Any:
        # Relaxing one gate must not drop the other defaults (which would tighten them to the FP32 gates).
        if not isinstance(value, dict):
            return value  # pydantic reports the type error
        merged: dict[str, Any] = _default_per_precision()
        for precision, overrides in value.items():
            both = isinstance(overrides, dict) and isinstance(merged.get(precision), dict)
            merged[precision] = {**merged[precision], **overrides} if both else overrides
        return merged

    @field_validator("per_precision")
    @classmethod
    def _known_overrides(cls, value: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
        # A dict of dicts escapes the strict section check: a misspelt gate would be silently ignored.
        gates = sorted(set(cls.model_fields) - {"per_precision"})
        for precision, overrides in value.items():
            if precision not in PRECISIONS:
                raise ValueError(f"unknown precision '{precision}' (valid: {', '.join(PRECISIONS)})")
            unknown = sorted(set(overrides) - set(gates))
            if unknown:
                raise ValueError(f"unknown gate {unknown} for {precision} (valid gates: {', '.join(gates)})")
        return value


class ValidateConfig(Section):
    batch_sizes: list[PositiveInt] = Field(default_factory=lambda: [1, 32], min_length=1,
                                           description="latency batch sizes; the largest also sizes engine profiles")
    warmup: int = Field(5, ge=0)
    iterations: int = Field(30, ge=1)
    max_samples: int | None = Field(None, ge=1, description="cap on held-out samples used for accuracy")
    gates: GatesConfig = Field(default_factory=GatesConfig)

    @field_validator("batch_sizes")
    @classmethod
    def _sorted_unique(cls, value: list[int]) -> list[int]:
        # Reports and the CLI read the last batch size as the largest one.
        return sorted(set(value))


class PackageConfig(Section):
    enabled: bool = True
    triton: bool = Field(True, description="write a Triton model repository")
    max_batch_size: int = Field(32, ge=0)


class KilnConfig(Section):
    name: str = "kiln"
    seed: int = 0
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    export: ExportConfig = Field(default_factory=ExportConfig)
    optimize: OptimizeConfig = Field(default_factory=OptimizeConfig)
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig)
    calibration: CalibrationConfig = Field(default_factory=CalibrationConfig)
    build: BuildConfig = Field(default_factory=BuildConfig)
    validate_: ValidateConfig = Field(default_factory=ValidateConfig, alias="validate")
    package: PackageConfig = Field(default_factory=PackageConfig)

    model_config = Section.model_config | {"populate_by_name": True}

    def section(self, name: str) -> Section:
        return getattr(self, "validate_" if name == "validate" else name)

    def dump(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True)


def _format_validation_error(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]).replace("validate_", "validate")
        if e["type"] == "extra_forbidden":
            parent = _model_at(tuple(p for p in e["loc"][:-1]))
            valid = ", ".join(sorted(_field_names(parent))) if parent else "?"
            lines.append(f"unknown key '{key}' (valid keys here: {valid})")
        elif e["type"] == "literal_error":
            lines.append(f"'{key}': {e['msg']}, got {e.get('input')!r}")
        else:
            lines.append(f"'{key}': {e['msg']} (got {e.get('input')!r})")
    return f"invalid config {source}: " + "; ".join(lines)


def _field_names(model: type[Section]) -> list[str]:
    return [f.alias or n for n, f in model.model_fields.items()]


def _model_at(loc: tuple[Any, ...]) -> type[Section] | None:
    model: Any = KilnConfig
    for part in loc:
        fields = {(f.alias or n): f for n, f in model.model_fields.items()} | model.model_fields
        field = fields.get(part)
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, Section)):
            return None
        model = field.annotation
    return model


def config_from_dict(data: dict[str, Any], source: str = "") -> KilnConfig:
    try:
        return KilnConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, source), hint="see `kiln config` for every key and its default") from None


def load_config(path: str | Path | None, overrides: dict[str, Any] | None = None) -> KilnConfig:
    """Read a YAML/TOML/JSON file (or the built-in demo, ``demo.yaml``, when ``path`` is None) and validate it."""
    data: dict[str, Any] = {}
    source = "(built-in demo)"
    if path is None:
        data = yaml.safe_load(DEMO_CONFIG.read_text())
    else:
        p = Path(path)
        source = str(p)
        if not p.is_file():
            raise InputFileError(f"config file not found: {p}", hint="pass an existing .yaml/.toml file, or none for the demo")
        try:
            text = p.read_text()
        except UnicodeDecodeError:
            raise ConfigError(f"config {p} is not a text file", hint="pass a .yaml/.toml/.json run config") from None
        try:
            if p.suffix == ".toml":
                data = tomllib.loads(text)
            elif p.suffix == ".json":
                data = json.loads(text)
            else:
                data = yaml.safe_load(text) or {}
        except (yaml.YAMLError, tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(f"cannot parse config {p}: {exc}", hint="fix the file's syntax") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config {p} must be a mapping of sections, got {type(data).__name__}")
    for dotted, value in (overrides or {}).items():
        _set_dotted(data, dotted, value)
    config = config_from_dict(data, source)
    _check_files(config, Path(path).parent if path else Path.cwd())
    return config


def set_value(dotted: str, text: str) -> Any:
    """The value of ``--set dotted=text``, read as the schema's type for that key wants: a key that takes only
    text (a str, or a Literal of strings such as on/off) gets ``text`` as written, since YAML would turn
    ``off`` into False and ``1.10`` into 1.1; a list of such text is read as YAML with every item kept as
    text (``[a, off]``); every other key (numbers, bools, free-form params) gets ``text`` parsed as YAML.
    ``null``/``~`` still mean None where the key accepts None."""
    annotation = _annotation_at(dotted.split("."))
    if annotation is not None and _takes_text_only(annotation):
        return None if text in ("null", "~") and _accepts_none(annotation) else text
    text_items = annotation is not None and get_origin(annotation) is list and _takes_text_only(get_args(annotation)[0])
    try:
        return yaml.load(text, Loader=yaml.BaseLoader) if text_items else yaml.safe_load(text)  # noqa: S506
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {dotted}={text}: the value is not valid YAML ({exc.problem})",
                          hint="quote it, or write a YAML value: 2, 0.5, true, [1, 8]") from None


def _annotation_at(path: list[str]) -> Any:
    """The declared type of a dotted key, through sections and dict values; None where the schema does not say."""
    annotation: Any = KilnConfig
    for part in path:
        if isinstance(annotation, type) and issubclass(annotation, Section):
            fields = {(f.alias or n): f for n, f in annotation.model_fields.items()} | annotation.model_fields
            if part not in fields:
                return None
            annotation = fields[part].annotation
        elif get_origin(annotation) is dict:
            annotation = get_args(annotation)[1]
        else:
            return None
    return annotation


def _members(annotation: Any) -> list[Any]:
    if get_origin(annotation) in (Union, UnionType):
        return [m for a in get_args(annotation) for m in _members(a)]
    return [annotation]


def _accepts_none(annotation: Any) -> bool:
    return type(None) in _members(annotation)


def _takes_text_only(annotation: Any) -> bool:
    kinds = [m for m in _members(annotation) if m is not type(None)]
    return bool(kinds) and all(m is str or (get_origin(m) is Literal and all(isinstance(v, str) for v in get_args(m)))
                               for m in kinds)


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    node = data
    *parents, leaf = dotted.split(".")
    for i, part in enumerate(parents):
        if node.get(part) is None:  # missing, or an empty section in YAML (`validate:`)
            node[part] = {}
        node = node[part]
        if not isinstance(node, dict):
            prefix = ".".join(parents[:i + 1])
            raise ConfigError(f"cannot set '{dotted}': '{prefix}' is a value ({node!r}), not a section",
                              hint=f"use --set {prefix}=VALUE, or see `kiln config` for the keys under each section")
    node[leaf] = value


def _check_files(config: KilnConfig, base: Path) -> None:
    ckpt = config.model.checkpoint
    if ckpt is not None:
        p = Path(ckpt) if Path(ckpt).is_absolute() else base / ckpt
        if not p.is_file():
            raise InputFileError(f"model.checkpoint not found: {p}", hint="fix the path or remove model.checkpoint to train")
        config.model.checkpoint = str(p.resolve())


StageName = Literal["train", "export", "optimize", "precision", "build", "validate", "package"]
