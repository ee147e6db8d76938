"""What a torch engine records for its runner (``kiln-engine.json`` "backend_info"): nothing beyond the common
fields; its builder settings (Inductor options, rewrites, compiled batch sizes) are in ``builder_settings``."""

from __future__ import annotations

from kiln.core.records import Part


class TorchRecord(Part):
    """Empty: the runner reads the flavour, files and builder settings every engine has."""
