"""What opening a packaged engine costs before it runs: ``from kiln import load_engine`` imports every backend's
config section and Kiln's records, and builds none of their pydantic validators until one is used. A fresh
interpreter, as a server's process starts one."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import json
from pydantic import BaseModel
from kiln import load_engine
from kiln.stages.engines.registry import BACKENDS

def below(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from below(sub)

kiln_models = {c for c in below(BaseModel) if c.__module__.startswith("kiln.")}
built = sorted(c.__qualname__ for c in kiln_models if c.__pydantic_complete__)
configs = [b.config for b in BACKENDS.values()]
settings = [c().model_dump() for c in configs]  # deferred, not missing: a section still validates when used
print(json.dumps({"models": len(kiln_models), "built": built, "usable": all(c.__pydantic_complete__ for c in configs)}))
"""


def test_load_engine_builds_no_config_or_record_validator_on_import() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    got = json.loads(out.stdout.splitlines()[-1])
    assert got["models"] > 10, got  # the backends' config sections and the records were imported
    assert got["built"] == [], f"built on import: {got['built']}"
    assert got["usable"], got
