"""The ``package:`` config section: which serving repositories the package stage writes."""

from __future__ import annotations

from pydantic import Field

from kiln.core.sections import Section


class PackageConfig(Section):
    enabled: bool = True
    triton: bool = Field(True, description="write a Triton model repository for the stock backends (triton/)")
    triton_python: bool = Field(
        True,
        description="write a Triton Python-backend repository running the Kiln engines "
        "as validated (triton-python/; needs kiln in Triton's Python)",
    )
    max_batch_size: int = Field(32, ge=0)
