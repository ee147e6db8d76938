"""The run configuration: typed sections, loaded from YAML or TOML, validated with clear errors.

Each stage owns its section's model (``stages/<stage>/config.py``); this module assembles them. Unknown keys,
wrong types and missing files become one :class:`ConfigError` naming the key and the valid choices.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Callable
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import tomllib
import yaml
from pydantic import Field, ValidationError, model_validator

from kiln.calibration.config import CalibrationConfig
from kiln.core.errors import ConfigError, InputFileError
from kiln.core.sections import Section, Seed
from kiln.core.signature import FORMER_PLACES, Signature, gather
from kiln.models.config import DataConfig, ModelConfig
from kiln.models.registry import DATASETS, MODELS, check_name
from kiln.stages.accuracy.config import GatesConfig
from kiln.stages.engines.config import BuildConfig
from kiln.stages.export.config import ExportConfig
from kiln.stages.optimize.config import OptimizeConfig
from kiln.stages.package.config import PackageConfig
from kiln.stages.precision.config import PRECISIONS, PrecisionConfig
from kiln.stages.train.config import TrainConfig
from kiln.stages.validate.config import ValidateConfig

DEMO_CONFIG = Path(__file__).with_name("demo.yaml")
# How errors name a config given as a Python dict, and an override a Python caller gave (not a --set)
DICT_SOURCE = "(config dict)"
PYTHON_OVERRIDE = "override"
CONFIG_SUFFIXES = (".yaml", ".yml", ".toml", ".json")
# The sections live with the stages that read them; importable from here too.
__all__ = [
    "KilnConfig",
    "Signature",
    "load_config",
    "config_from_dict",
    "set_value",
    "DEMO_CONFIG",
    "PRECISIONS",
    "ModelConfig",
    "DataConfig",
    "TrainConfig",
    "ExportConfig",
    "OptimizeConfig",
    "PrecisionConfig",
    "CalibrationConfig",
    "BuildConfig",
    "ValidateConfig",
    "GatesConfig",
    "PackageConfig",
]


class KilnConfig(Section):
    """The run config: one section per stage (each defined beside its stage), the data and model, and the
    model's signature, which several stages read."""

    name: str = "kiln"
    seed: Seed = 0
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    signature: Signature = Field(default_factory=Signature)
    train: TrainConfig = Field(default_factory=TrainConfig)
    export: ExportConfig = Field(default_factory=ExportConfig)
    optimize: OptimizeConfig = Field(default_factory=OptimizeConfig)
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig)
    calibration: CalibrationConfig = Field(default_factory=CalibrationConfig)
    build: BuildConfig = Field(default_factory=BuildConfig)
    validate_: ValidateConfig = Field(default_factory=ValidateConfig, alias="validate")
    package: PackageConfig = Field(default_factory=PackageConfig)

    model_config = Section.model_config | {"populate_by_name": True}

    @model_validator(mode="before")
    @classmethod
    def _signature_keys(cls, data: Any) -> Any:
        """The signature's keys are also taken where earlier versions read them (``signature.batch_sizes``...)."""
        return gather(data) if isinstance(data, dict) else data

    def section(self, name: str) -> Section:
        return getattr(self, "validate_" if name == "validate" else name)

    def dump(self) -> dict[str, Any]:
        """The config as plain data that reads back the same: a run from ``model.onnx`` that names no PyTorch model
        leaves ``model.name`` out (its default, written, would make it a PyTorch model's run)."""
        out = self.model_dump(mode="json", by_alias=True)
        if self.model.onnx and "name" not in self.model.model_fields_set:
            del out["model"]["name"]
        return out


# A value quoted back longer than this is a section or a list the message already points into: left out
MAX_QUOTED = 80
PRINTS_KEYS = "`kiln config` prints every key and its default"
# Keys whose value below their least is most often meant as something else, with the fix that says what
BELOW_LEAST_FIXES = {
    "train.epochs": "to skip training, set train.enabled: false (model.checkpoint loads your weights); else give "
    "train.epochs 1 or more",
}


def _explain(err: ValidationError, source: str, given: dict[str, str]) -> ConfigError:
    """One error for all of a validation's errors, each said under where it came from: the file (``invalid config
    kiln.yaml: ...``), the ``--set`` that gave the value (``invalid --set train.epochs=abc: ...``; ``given`` maps
    each override's key to the words that gave it), or both, for a check across keys that names a ``--set`` key.
    The fix is the first error's."""
    said: dict[str, list[str]] = {}
    hint = None
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]).replace("validate_", "validate")
        msg = e["msg"].removeprefix("Value error, ")
        own, shared = _origin(key, msg, given, unknown=e["type"] == "extra_forbidden")
        if own:
            label = f"invalid {given[own]}"
        elif shared:
            label = f"invalid config {source or DICT_SOURCE} with {given[shared]}"
        else:
            label = f"invalid config {source or DICT_SOURCE}"
        said.setdefault(label, []).append(_said(e, key, msg, at_set=own is not None and key in _places(own)))
        if hint is None:
            hint = _fix(e, key, own, shared, given)
    return ConfigError("; ".join(f"{label}: {'; '.join(lines)}" for label, lines in said.items()), hint=hint)


def _said(e: Any, key: str, msg: str, at_set: bool) -> str:
    """One error, said. At the key a ``--set`` names, the value is not quoted again (the ``--set`` shows it)."""
    got = repr(e.get("input"))
    if e["type"] == "extra_forbidden":
        return f"unknown key '{key}' (valid keys here: {', '.join(sorted(_valid_keys(e['loc']))) or '?'})"
    if not key:  # the whole config's own check (keys given twice): its message names the keys
        return msg
    if at_set:
        return msg
    if e["type"] == "literal_error":
        return f"'{key}': {msg}, got {got}"
    return f"'{key}': {msg}" + (f" (got {got})" if len(got) <= MAX_QUOTED else "")


def _closest_key(e: Any) -> str | None:
    """The valid key nearest an unknown one's spelling (``train`` for ``trian``), or None."""
    close = difflib.get_close_matches(str(e["loc"][-1]), _valid_keys(e["loc"]), n=1, cutoff=0.6)
    return close[0] if close else None


def _valid_keys(loc: tuple[Any, ...]) -> list[str]:
    parent = _model_at(tuple(p for p in loc[:-1]))
    return _field_names(parent) if parent else []


def _places(dotted: str) -> list[str]:
    """Where a key's value is validated: itself, and ``signature.<key>`` for a signature key given in its former
    section (``validate.batch_sizes``)."""
    section, _, leaf = dotted.partition(".")
    return [dotted, *([f"signature.{leaf}"] if FORMER_PLACES.get(leaf) == section else [])]


def _origin(key: str, msg: str, given: dict[str, str], unknown: bool) -> tuple[str | None, str | None]:
    """The ``--set`` key an error is in (its key is that key or under it; an unknown key may be one above it:
    ``--set trian.epochs=3``), else one a check across keys names (its key is a section above that key, or the
    whole config, and its message names the key), else neither: the error is the file's."""
    for dotted in sorted(given, key=len, reverse=True):
        for place in _places(dotted):
            if key == place or key.startswith(f"{place}.") or (unknown and place.startswith(f"{key}.")):
                return dotted, None
    for dotted in sorted(given, key=len, reverse=True):
        for place in _places(dotted):
            above = not key or place.startswith(f"{key}.")
            if above and re.search(rf"(?<![\w.])(?:{_named_as(place, key)})(?!\w)", msg):
                return None, dotted
    return None, None


def _named_as(place: str, key: str) -> str:
    """A pattern of the ways a check on section ``key`` names the key ``place`` under it: by its path below the
    section, or with any of the sections above it (``loss_scale``, ``amp.loss_scale``, ``train.amp.loss_scale``)."""
    parts, below = place.split("."), len(place.removeprefix(f"{key}.").split(".")) if key else len(place.split("."))
    names = [".".join(parts[i:]) for i in range(len(parts) - below + 1)]
    return "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))


def _fix(e: Any, key: str, own: str | None, shared: str | None, given: dict[str, str]) -> str:
    """The fix of one error: for a ``--set``, the ``--set`` as it should be written where that is known (a key
    spelt as the schema has it, a list in brackets), else which ``--set`` to change. A check that knows its own
    fix (a ValueError with a ``hint``: :class:`kiln.core.signature.HintedValueError`) gives that one."""
    own_fix = getattr((e.get("ctx") or {}).get("error"), "hint", None)
    if own_fix:
        return str(own_fix)
    if key in BELOW_LEAST_FIXES and e["type"] in ("greater_than_equal", "greater_than"):
        return BELOW_LEAST_FIXES[key]
    if shared:
        return f"change {given[shared]} or the config's setting it conflicts with ({PRINTS_KEYS})"
    if own is None:
        close = _closest_key(e) if e["type"] == "extra_forbidden" else None
        return (
            f"write '{close}' for '{key}' ({PRINTS_KEYS})"
            if close
            else "see `kiln config` for every key and its default"
        )
    words = given[own]
    python = words.startswith(f"{PYTHON_OVERRIDE} ")
    text = words.partition("=")[2] if words.startswith(f"--set {own}=") else None
    if e["type"] == "extra_forbidden":
        leaf = str(e["loc"][-1])
        close = [c] if (c := _closest_key(e)) else []
        parts, at = own.split("."), len(e["loc"]) - 1
        if close and (text is not None or python) and ".".join(parts[: at + 1]) == key:  # the override key's part
            parts[at] = close[0]
            if python:
                return f"write '{'.'.join(parts)}' for '{own}' in the overrides (the key as `kiln config` prints it)"
            return f"--set {'.'.join(parts)}={text} (the key as `kiln config` prints it)"
        if close:
            return f"write '{close[0]}' for '{leaf}' in {words} (`kiln config` prints every key)"
        return f"use one of the keys listed, in {words} ({PRINTS_KEYS})"
    scalar = isinstance(e.get("input"), (str, int, float))
    if e["type"] in ("list_type", "tuple_type") and key in _places(own) and scalar:
        if python:
            return f"give the list as a Python list: {{'{own}': {_as_list(own, e['input'])!r}}}"
        if text is not None:
            return f"write the list in brackets: --set {own}=[{text}]"
    what = f"the {words.partition('=')[0]}" if python else words.partition("=")[0]
    return f"give {what} a value the key takes ({PRINTS_KEYS})"


def _as_list(dotted: str, value: str | int | float) -> list[Any]:
    """A single value given for a list key, as the list it most likely meant (``'1,8'`` -> ``[1, 8]``)."""
    try:
        out = set_value(dotted, value) if isinstance(value, str) else [value]
    except ConfigError:
        out = [value]
    return out if isinstance(out, list) else [out]


def _field_names(model: type[Section]) -> list[str]:
    return [f.alias or n for n, f in model.model_fields.items()] + list(model.subsections())


def _types(model: type[Section]) -> dict[str, Any]:
    """Each key of a section (by its alias) -> its declared type, sections held beyond the fields included."""
    declared = {(f.alias or n): f.annotation for n, f in model.model_fields.items()}
    return declared | {n: f.annotation for n, f in model.model_fields.items()} | model.subsections()


def _model_at(loc: tuple[Any, ...]) -> type[Section] | None:
    model: Any = KilnConfig
    for part in loc:
        annotation = _types(model).get(part)
        if not (isinstance(annotation, type) and issubclass(annotation, Section)):
            return None
        model = annotation
    return model


def config_from_dict(
    data: dict[str, Any],
    source: str = DICT_SOURCE,
    given: dict[str, str] | None = None,
    *,
    base: str | Path | None = None,
) -> KilnConfig:
    """Validate a raw config, with the checks :func:`load_config` makes: ``model.checkpoint`` and ``model.onnx``
    must exist (a relative path is relative to ``base``, by default the current folder, and is made absolute),
    built-in names must be known, and settings that cannot work together are refused before any stage runs.
    ``given``: the keys set from the command line -> the words that set them, for its errors to name those words
    rather than the config (``source``)."""
    config = _validated(data, source, given)
    folder = Path(base) if base is not None else Path()
    rule = f"relative to {folder.resolve()}" if base is not None else "relative to the current folder"
    _check_config(config, folder, {}, f"a relative path in a config dict is {rule}", "an override")
    return config


def _validated(data: dict[str, Any], source: str, given: dict[str, str] | None) -> KilnConfig:
    """The config's schema alone: its types, keys and checks across keys, errors said under ``source``."""
    try:
        return KilnConfig.model_validate(data)
    except ValidationError as err:
        raise _explain(err, source, given or {}) from None


def _check_config(config: KilnConfig, base: Path, overrides: dict[str, Any], rule: str, set_by: str) -> None:
    """The checks beyond the schema, made on every config however it was given: its files (``base`` and ``rule``
    as :func:`_check_files` takes them), its built-in names and its combinations."""
    _check_files(config, base, overrides, rule, set_by)
    _check_names(config)
    _check_combinations(config)


def load_config(
    path: str | Path | None, overrides: dict[str, Any] | None = None, given: dict[str, str] | None = None
) -> KilnConfig:
    """Read a YAML/TOML/JSON file (or the built-in demo, ``demo.yaml``, when ``path`` is None) and validate it,
    with ``overrides`` (dotted key -> value) set over it. ``given`` maps an override's key to the words that gave
    it on the command line (``--set train.epochs=abc``), which its errors quote; a key it leaves out is quoted as
    ``--set key=value``. Without ``given`` (a Python caller) an override is quoted as Python wrote it
    (``override train.epochs='abc'``) and its fixes say how to write it in Python."""
    data: dict[str, Any] = {}
    source = "(built-in demo)"
    if path is None:
        data = _demo(overrides or {})
    else:
        data, source = _read(Path(path)), str(path)
    said = {k: _words(k, v, given) for k, v in (overrides or {}).items()}
    for dotted, value in (overrides or {}).items():
        _set_dotted(data, dotted, value, said[dotted])
    _check_size(data, Path(source))  # file and --set values alike
    config = _validated(data, source, said)
    rule = "a path in the config file is relative to the file's folder"
    set_by = "--set" if given is not None else "an override"
    _check_config(config, Path(path).parent if path else Path(), overrides or {}, rule, set_by)
    return config


def _demo(overrides: dict[str, Any]) -> dict[str, Any]:
    """The built-in demo's config; without its model and dataset where ``overrides`` give an ONNX file as the model
    (and name neither): the demo's 8x8 digits and CNN are the demo's, and a user who brings their own graph gets
    what a config of only ``model.onnx`` gets (random inputs, said loudly by the stages), not errors asking them to
    change data they never gave."""
    data = yaml.safe_load(DEMO_CONFIG.read_text())
    if "model.onnx" in overrides:
        if "model.name" not in overrides:
            del data["model"]["name"]
        if not any(k == "data" or k.startswith("data.") for k in overrides):
            del data["data"]
    return data


def _words(key: str, value: Any, given: dict[str, str] | None) -> str:
    """The words an error quotes for an override: the command line's where the CLI gave them (``given``), the
    ``--set`` that would write it for a key the CLI set otherwise, else the override as Python wrote it."""
    if given is None:
        return f"{PYTHON_OVERRIDE} {key}={_shown(value, repr)}"
    return given.get(key) or f"--set {key}={_shown(value)}"


def _read(p: Path) -> dict[str, Any]:
    """The mapping a config file holds, refused with one error where the file is missing, of a kind Kiln does not
    read, too large, not text, empty, unparsable or not a mapping of sections."""
    if not p.is_file():
        raise InputFileError(
            f"config file not found: {p}", hint="pass an existing .yaml/.toml file, or none for the demo"
        )
    _check_kind(p)
    if p.stat().st_size > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"config {p} is {p.stat().st_size} bytes; a run config is at most {MAX_CONFIG_BYTES}",
            hint="pass the run config itself, not a data file",
        )
    try:
        text = p.read_text()
    except UnicodeDecodeError:
        raise ConfigError(f"config {p} is not a text file", hint="pass a .yaml/.toml/.json run config") from None
    if not text.strip() or (p.suffix.lower() not in (".toml", ".json") and _only_comments(text)):
        raise ConfigError(
            f"config {p} is empty",
            hint="write at least the model: section (`kiln config` "
            "prints a full one), or pass no CONFIG to run the demo",
        )
    data = _parse(p, text)
    if not isinstance(data, dict):
        raise ConfigError(
            f"config {p} must be a mapping of sections, got {type(data).__name__}",
            hint="start the file with sections such as `model:` (see `kiln config`)",
        )
    return data


def _check_kind(p: Path) -> None:
    """The file's kind by its suffix, in any case (``.YAML``, ``.Json``): a suffix Kiln does not read is refused
    rather than parsed as YAML."""
    if p.suffix.lower() not in CONFIG_SUFFIXES:
        raise ConfigError(
            f"config {p} has the suffix '{p.suffix}', not one of a run config: {', '.join(CONFIG_SUFFIXES)}",
            hint=f"rename it to {p.stem}.yaml (or .toml / .json, as its content is written)",
        )


def _check_combinations(config: KilnConfig) -> None:
    """Settings each valid alone that cannot work together, named both: a checkpoint or a backend that builds from
    the PyTorch model (torch) on a run that starts from an ONNX file with no PyTorch model named."""
    if not config.model.onnx or "name" in config.model.model_fields_set:
        return
    if config.model.checkpoint is not None:
        raise ConfigError(
            f"model.checkpoint {Path(config.model.checkpoint).name} holds a PyTorch model's weights, but model.onnx "
            f"starts the run from {Path(config.model.onnx).name} with no model.name: the checkpoint would be unused",
            hint="set model.name to the PyTorch model the checkpoint belongs to, or drop model.checkpoint",
        )
    graph_readers = set(config.build.graph_readers)
    torch_only = [b for b in config.build.backends if b not in graph_readers]
    if torch_only:
        raise ConfigError(
            f"build.backends {torch_only} builds from the PyTorch model, but model.onnx starts the run from "
            f"{Path(config.model.onnx).name} with no model.name",
            hint=f"drop {', '.join(torch_only)} from build.backends, or name the PyTorch model (model.name) "
            "that model.onnx was exported from",
        )


def _check_names(config: KilnConfig) -> None:
    """A misspelt built-in model or dataset name, said before any stage runs (an import path is resolved by the
    stage that uses it: importing user code is that stage's business)."""
    for kind, name, table in (("model", config.model.name, MODELS), ("dataset", config.data.name, DATASETS)):
        if name is not None:
            check_name(name, table, kind)


# Configuration is hostile input: bounded in bytes, in values after YAML alias expansion, and in nesting.
MAX_CONFIG_BYTES = 1 << 20
MAX_CONFIG_VALUES = 100_000
MAX_CONFIG_DEPTH = 32


class _StrictLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing duplicate keys (YAML keeps the last silently: a gate set twice would be
    decided by line order). The error marks both places: the first as its context, the repeat as its problem."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, yaml.Mark] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: the base class reports it
                continue
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    "first given", first, f"duplicate key '{key}'", key_node.start_mark
                )
            seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key '{key}'")
        out[key] = value
    return out


def _parse(p: Path, text: str) -> Any:
    try:
        if p.suffix.lower() == ".toml":
            return tomllib.loads(text)  # TOML itself forbids duplicate keys
        if p.suffix.lower() == ".json":
            return json.loads(text, object_pairs_hook=_no_duplicate_keys)
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except (yaml.YAMLError, tomllib.TOMLDecodeError, ValueError, RecursionError) as exc:
        message, hint = _syntax(exc, p)
        raise ConfigError(f"cannot parse config {p}: {' '.join(message.split())[:400]}", hint=hint) from None


def _at(mark: yaml.Mark) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}"


def _syntax(exc: BaseException, p: Path) -> tuple[str, str]:
    """What a parser said of the file, with the line and column it gave, and a fix for that mistake: a key given
    twice, an unclosed bracket or quote, a tab, a key indented off its section's, or else the place to fix."""
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        return _yaml_syntax(exc, exc.problem_mark)
    if isinstance(exc, json.JSONDecodeError):
        where = f"line {exc.lineno}, column {exc.colno}"
        return f"{where}: {exc.msg}", f"correct the JSON at {where} ({exc.msg[:1].lower()}{exc.msg[1:]})"
    if isinstance(exc, tomllib.TOMLDecodeError):
        said = str(exc)
        if "twice" in said or "overwrite" in said:
            return said, "give each key and table once (TOML takes none twice): keep one and merge their values"
        found = re.search(r"\s*\((at [^)]*)\)$", said)
        problem = said[: found.start()] if found else said
        where = found.group(1) if found else "there"
        return said, f"correct the TOML {where} ({problem[:1].lower()}{problem[1:]})"
    if isinstance(exc, RecursionError):
        return "its values are nested too deeply to read", "write the config with fewer nested levels"
    said = str(exc)
    found = re.match(r"duplicate key ('.*')$", said)
    if found:  # JSON's (no position)
        return said, f"keep one {found.group(1)} in that object, merging their values"
    if isinstance(exc, yaml.reader.ReaderError):
        exc.name = str(p)
        return str(exc), f"remove the character at position {exc.position} of {p.name} (or save the file as UTF-8)"
    return said, f"correct the syntax of {p.name}"


def _yaml_syntax(exc: yaml.MarkedYAMLError, mark: yaml.Mark) -> tuple[str, str]:
    """YAML's problem at its line and column, what it was parsing and from where, and the fix for that problem."""
    problem, context = exc.problem or "", exc.context or ""
    where = _at(mark)
    start = _at(exc.context_mark) if exc.context_mark is not None else where
    opened = "" if context == "first given" else " started"  # a key given twice; what YAML was parsing
    message = f"{where}: {problem}" + (f" ({context}{opened} at {start})" if exc.context_mark is not None else "")
    found = re.match(r"duplicate key ('.*')$", problem)
    if found and exc.context_mark is not None:
        lines = f"lines {exc.context_mark.line + 1} and {mark.line + 1}"
        hint = f"keep one {found.group(1)} in that section ({lines} both give it), merging their values"
    elif "flow sequence" in context:
        hint = f"close the [ opened at {start} with ], with a comma between its items"
    elif "flow mapping" in context:
        hint = f"close the {{ opened at {start} with }}, with a comma between its entries"
    elif "quoted scalar" in context:
        hint = f"close the quote opened at {start} with the same quote"
    elif "'\\t'" in problem:
        hint = f"indent with spaces at {where}: YAML takes no tabs there"
    elif "mapping values are not allowed" in problem:
        hint = f"write one `key: value` per line at {where}, and quote a value that holds ': '"
    elif "could not find expected ':'" in problem:
        hint = f"write the key at {start} as `key: value`, with ': ' after it"
    elif problem.endswith(("found ']'", "found '}'")):
        hint = f"remove the {problem[-2]} at {where}: it closes nothing opened before it"
    elif "block mapping" in context and ("<block mapping start>" in problem or "did not find expected key" in problem):
        hint = f"indent line {mark.line + 1} as the other keys of its section (the section starts at {start})"
    elif problem.endswith("found '-'"):
        hint = f"indent the list item at {where} under the key it belongs to (`key:`, then `  - item`)"
    else:
        hint = f"correct the YAML at {where} ({problem})"
    return message, hint


def _only_comments(text: str) -> bool:
    return all(
        not line.strip() or line.lstrip().startswith("#") or line.strip() in ("---", "...")
        for line in text.splitlines()
    )


def _check_size(data: Any, p: Path) -> None:
    """Count values as they would be expanded (YAML aliases are shared references until something copies them:
    a few lines of nested aliases expand to billions) and refuse deep or self-referencing structures."""
    count = 0
    stack: list[tuple[Any, int]] = [(data, 0)]
    while stack:
        node, depth = stack.pop()
        count += 1
        if count > MAX_CONFIG_VALUES or depth > MAX_CONFIG_DEPTH:
            raise ConfigError(
                f"config {p} expands to more than {MAX_CONFIG_VALUES} values or {MAX_CONFIG_DEPTH} "
                "levels (YAML aliases?)",
                hint="write the config without nested aliases (&/*)",
            )
        if isinstance(node, dict):
            stack += [(v, depth + 1) for v in node.values()]
        elif isinstance(node, list):
            stack += [(v, depth + 1) for v in node]


def _shown(value: Any, written: Callable[[Any], str] | None = None) -> str:
    """A value as a ``--set`` would write it (text as is, anything else as YAML), or as ``written`` writes it
    (``repr``: as Python wrote it), cut short if long."""
    if written is not None:
        out = written(value)
    elif isinstance(value, str):
        out = value
    else:
        try:
            out = yaml.safe_dump(value, default_flow_style=True, width=1 << 20).strip().removesuffix("...").strip()
        except yaml.YAMLError:
            out = repr(value)
    return out if len(out) <= 2 * MAX_QUOTED else out[: 2 * MAX_QUOTED] + "..."


def _set_dotted(data: dict[str, Any], dotted: str, value: Any, words: str) -> None:
    node = data
    *parents, leaf = dotted.split(".")
    for i, part in enumerate(parents):
        if node.get(part) is None:  # missing, or an empty section in YAML (`validate:`)
            node[part] = {}
        node = node[part]
        if not isinstance(node, dict):
            prefix = ".".join(parents[: i + 1])
            raise ConfigError(
                f"invalid {words}: '{prefix}' is a value ({node!r}), not a section",
                hint=f"use {_as_set(words, prefix)}, or see `kiln config` for the keys under each section",
            )
    node[leaf] = value


def _as_set(words: str, key: str) -> str:
    """How the caller that gave ``words`` sets ``key``: ``--set key=VALUE`` on the command line, else an override
    ``{'key': VALUE}`` in Python."""
    return f"--set {key}=VALUE" if words.startswith("--set ") else f"the override {{'{key}': VALUE}}"


def set_value(dotted: str, text: str) -> Any:
    """The value of ``--set dotted=text``, read as the schema's type for that key wants: a key that takes only
    text (a str, or a Literal of strings such as on/off) gets ``text`` as written, since YAML would turn
    ``off`` into False and ``1.10`` into 1.1; a list of such text is read as YAML with every item kept as
    text (``[a, off]``); every other key (numbers, bools, free-form params) gets ``text`` parsed as YAML.
    ``null``/``~`` still mean None where the key accepts None.

    A key that takes only a list of fixed choices or of numbers (``precision.variants``, ``signature.batch_sizes``)
    also takes the comma form ``fp32,int8``, as ``kiln precision --variants`` does: no item of such a list can
    hold a comma and no single value is valid there, so it means nothing else. A list of free text (paths, node
    names) is not split, as an item may hold a comma: ``[a, b]`` is its form; one such item without brackets or a
    comma is a list of one (``build.backends=onnxruntime``), as no single value is valid there either."""
    path = dotted.split(".")
    if len(path) == 2 and FORMER_PLACES.get(path[1]) == path[0]:  # validate.batch_sizes is signature.batch_sizes
        path = ["signature", path[1]]
    annotation = _annotation_at(path)
    if annotation is not None and _takes_text_only(annotation):
        return None if text in ("null", "~") and _accepts_none(annotation) else text
    text_items = annotation is not None and get_origin(annotation) is list and _takes_text_only(get_args(annotation)[0])
    items = _comma_items(annotation)
    bare = text.strip() and text.lstrip()[:1] not in "[{" and text not in ("null", "~")
    if text_items and not items and bare and "," not in text:
        return [text]
    try:
        if items and bare:
            as_text = all(_takes_text_only(i) for i in items)
            return [p.strip() if as_text else yaml.load(p, Loader=_StrictLoader) for p in text.split(",")]  # noqa: S506
        return yaml.load(text, Loader=yaml.BaseLoader if text_items else _StrictLoader)  # noqa: S506
    except yaml.YAMLError as exc:
        raise ConfigError(
            f"--set {dotted}={text}: the value is not valid YAML ({exc.problem})",
            hint="quote it, or write a YAML value: 2, 0.5, true, [1, 8]",
        ) from None


def _comma_items(annotation: Any) -> list[Any]:
    """The item types of a key that takes only a list (or tuple) of fixed choices or numbers, else none."""
    kinds = [m for m in _members(annotation) if m is not type(None)]
    if not kinds or any(get_origin(m) not in (list, tuple) for m in kinds):
        return []
    items = [_bare(a) for m in kinds for a in get_args(m) if a is not Ellipsis]
    choices = all(
        (get_origin(i) is Literal and all(isinstance(v, str) and "," not in v for v in get_args(i)))
        or i in (int, float)
        for i in items
    )
    return items if items and choices else []


def _bare(annotation: Any) -> Any:
    """``Annotated[int, Gt(0)]`` -> ``int``."""
    return get_args(annotation)[0] if get_origin(annotation) is Annotated else annotation


def _annotation_at(path: list[str]) -> Any:
    """The declared type of a dotted key, through sections and dict values; None where the schema does not say."""
    annotation: Any = KilnConfig
    for part in path:
        if isinstance(annotation, type) and issubclass(annotation, Section):
            types = _types(annotation)
            if part not in types:
                return None
            annotation = types[part]
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
    return bool(kinds) and all(
        m is str or (get_origin(m) is Literal and all(isinstance(v, str) for v in get_args(m))) for m in kinds
    )


def _from_command_line(overrides: dict[str, Any], key: str) -> bool:
    """Whether ``--set`` gave ``model.<key>`` (``--set model.onnx=...``, or the whole ``--set model={...}``)."""
    model = overrides.get("model")
    return f"model.{key}" in overrides or (isinstance(model, dict) and key in model)


def _check_files(config: KilnConfig, base: Path, overrides: dict[str, Any], rule: str, set_by: str) -> None:
    """``model.checkpoint`` and ``model.onnx`` made absolute. A relative path in the config is relative to ``base``
    (``rule`` says so: the file's folder, or the folder a config dict is read from); one given as an override
    (``set_by``: ``--set`` or a Python caller's override) to the current folder, as any command's path."""
    for key, hint in (
        ("checkpoint", "fix the path or remove model.checkpoint to train"),
        ("onnx", "fix the path, or remove model.onnx to start from the PyTorch model"),
    ):
        given = getattr(config.model, key)
        if given is None:
            continue
        here = _from_command_line(overrides, key)
        p = Path(given) if Path(given).is_absolute() or here else base / given
        if not p.is_file():
            said = (
                ""
                if Path(given).is_absolute()
                else f" (a path given with {set_by} is relative to the current folder)"
                if here
                else f" ({rule})"
            )
            raise InputFileError(f"model.{key} not found: {p}{said}", hint=hint)
        setattr(config.model, key, str(p.resolve()))


StageName = Literal["train", "export", "optimize", "precision", "build", "validate", "package"]
