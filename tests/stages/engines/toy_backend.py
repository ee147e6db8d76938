"""A backend defined outside Kiln: ONNX's own reference evaluator (``onnx.reference``, numpy kernels) as an engine.

Everything a backend is, in one module that imports only Kiln's public backend interface: its config section,
its record, its build and its runner. ``register(TOY)`` is the one line that adds it.
"""

from __future__ import annotations

import shutil
from typing import Literal

import numpy as np
import onnx
from pydantic import Field

from kiln.core.records import Part
from kiln.core.sections import Section
from kiln.stages.engines.backend import Backend, BuildRequest, Built, Runner


class ToyConfig(Section):
    devices: list[Literal["cpu"]] = Field(default_factory=lambda: ["cpu"])
    optimized: bool = Field(False, description="a setting of its own, recorded in the engine")


class ToyRecord(Part):
    evaluator: str
    optimized: bool


def build(req: BuildRequest) -> Built:
    shutil.copy(req.onnx_path, req.out / "model.onnx")
    info = ToyRecord(evaluator="onnx.reference.ReferenceEvaluator", optimized=req.settings.optimized)
    return Built({"model": "model.onnx"}, "onnx-reference", {"onnx": onnx.__version__}, info)


class ToyRunner(Runner):
    def _activate(self) -> None:
        from onnx.reference import ReferenceEvaluator

        self.evaluator = ReferenceEvaluator(str(self.engine_dir / self.meta.files["model"]))
        self.output_names = [o.name for o in self.meta.outputs]

    def _infer(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(self.output_names, self.evaluator.run(None, feed)))


TOY = Backend(
    name="toy",
    devices=("cpu",),
    config=ToyConfig,
    record=ToyRecord,
    build=build,
    runners={"cpu": ToyRunner},
    libraries=("onnx",),
)
