"""The run configuration: typed sections, loaded from YAML or TOML, validated with clear errors.

Each stage owns its section's model (``stages/<stage>/config.py``); this module assembles them. Unknown keys,
wrong types and missing files become one :class:`ConfigError` naming the key and the valid choices.
"""
from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any, Literal, get_args

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


class GatesConfig(Section):
    min_cosine: float = Field(0.9999, le=1.0, description="cosine similarity of outputs vs PyTorch")
    max_abs_err: float | None = Field(None, description="max abs output error vs PyTorch; null = unchecked")
    min_top1_agreement: float = Field(0.99, le=1.0, description="fraction of samples whose argmax matches PyTorch")
    max_accuracy_drop: float = Field(0.01, description="allowed task-accuracy drop vs PyTorch (0.01 = 1 point)")
    max_latency_p50_ms: float | None = Field(None, description="latency budget at the largest batch size")
    # Reduced precisions get their own looser defaults: FP16/INT8 cannot match FP32 to 1e-4.
    per_precision: dict[str, dict[str, float]] = Field(
        default_factory=lambda: {"fp16": {"min_cosine": 0.999}, "int8": {"min_cosine": 0.99, "min_top1_agreement": 0.97,
                                                                          "max_accuracy_drop": 0.02}},
        description="overrides of the gates above per precision")

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
    triton: bool = Field(True, description="write a Triton model repository for the stock backends (triton/)")
    triton_python: bool = Field(True, description="write a Triton Python-backend repository running the Kiln engines "
                                                  "as validated (triton-python/; needs kiln in Triton's Python)")
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
