"""Kiln's orchestration layer: config, artifact store, stage runner, report and CLI."""
from pipeline.errors import KilnError

__all__ = ["KilnError"]
