"""The ``build:`` config section: which engine kinds to build, and each registered backend's own section.

A backend brings its section with it (``Backend.config``, in its folder's ``config.py``); this one lists the
backends to build and validates ``build.<name>`` with the section of the backend registered under that name, so a
new backend needs no field here. Every knob is documented in ``docs/engines.md``.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationError, ValidatorFunctionWrapHandler, field_validator, model_validator
from pydantic_core import InitErrorDetails

from kiln.core.sections import Section
from kiln.stages.engines.registry import BACKENDS


class BuildConfig(Section):
    """``build:``. Each registered backend's section is an attribute of the same name (``build.onnxruntime``)."""

    model_config = Section.model_config | {"extra": "allow"}

    backends: list[str] = Field(
        default_factory=lambda: ["onnxruntime", "tensorrt"],
        min_length=1,
        description="engine kinds to build; torch (Inductor, from the trained model) is opt-in",
    )

    @property
    def graph_readers(self) -> list[str]:
        """The listed backends that build from the precision stage's ONNX graphs (not from the PyTorch model):
        the precision stage converts a variant's graph only for them. Read as ``build.graph_readers``."""
        return [b for b in self.backends if BACKENDS[b].reads_graph]

    @property
    def graph_engines(self) -> list[str]:
        """``<backend>-<device>`` of each engine kind built from the precision stage's graphs: each graph reader on
        the devices its section lists (``build.<name>.devices``), else on every device it builds for. The precision
        stage reads it to know which INT8 graph (Q/DQ, or ONNX Runtime CPU's own) any engine of the run loads.
        Sorted: the order devices are listed in changes no graph. Read as ``build.graph_engines``."""
        engines = []
        for name in self.graph_readers:
            devices = getattr(getattr(self, name, None), "devices", None)
            listed = devices if isinstance(devices, list) else BACKENDS[name].devices
            engines += [f"{name}-{d}" for d in listed]
        return sorted(set(engines))

    @classmethod
    def subsections(cls) -> dict[str, type[Section]]:
        return {name: backend.config for name, backend in BACKENDS.items()}

    @field_validator("backends")
    @classmethod
    def _registered(cls, value: list[str]) -> list[str]:
        unknown = [b for b in value if b not in BACKENDS]
        if unknown:
            raise ValueError(f"unknown backend {unknown} (registered backends: {', '.join(sorted(BACKENDS))})")
        return value

    @model_validator(mode="wrap")
    @classmethod
    def _backend_sections(cls, data: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        """Validate ``build.<name>`` with that backend's section (defaults where absent); any other key is unknown."""
        if not isinstance(data, dict):
            return handler(data)  # an instance (assignment, copies): already validated
        data, errors, sections = dict(data), [], {}
        for name, section in cls.subsections().items():
            try:
                given = data.pop(name, None)
                sections[name] = given if isinstance(given, section) else section.model_validate(given or {})
            except ValidationError as exc:
                errors += [
                    InitErrorDetails(type=e["type"], loc=(name, *e["loc"]), input=e["input"], ctx=e.get("ctx", {}))
                    for e in exc.errors()
                ]
        errors += [
            InitErrorDetails(type="extra_forbidden", loc=(key,), input=data[key])
            for key in data
            if key not in cls.model_fields
        ]
        if errors:
            raise ValidationError.from_exception_data(cls.__name__, errors)
        out = handler(data)
        out.__pydantic_extra__.update(sections)
        return out
