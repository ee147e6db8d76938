"""The fix line of a run whose required precision has engines for another machine only: it does not ask for a
backend build.backends already has, and says why that backend built none of the precision here."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kiln.core.records import Summary
from kiln.core.stage import Stage, StageContext, StageSettings
from kiln.pipeline.config import config_from_dict
from kiln.pipeline.runner import Runner, gate_hint
from kiln.stages.engines.declaration import BuildSummary
from kiln.stages.validate.declaration import REQUIRED, UNVALIDATED
from tests.conftest import tiny_config_dict

KERNEL_FIX = (
    "ONNX Runtime's CPU provider has no integer kernel for ConvTranspose: its int8 engine would run it in float"
)
SKIPPED = [
    "onnxruntime-cpu-fp16: engine onnxruntime-cpu-fp16 is labelled fp16, it computes 0% in fp16 (fix: none needed)",
    f"onnxruntime-cpu-int8: engine onnxruntime-cpu-int8 is labelled int8, it computes 0% in int8 (fix: {KERNEL_FIX})",
]
FAILURE = f"{REQUIRED}int8 engines {UNVALIDATED} (tensorrt-int8: no CUDA GPU)"


def test_a_backend_already_in_build_backends_is_not_asked_for() -> None:
    assert "add a backend" in gate_hint([FAILURE], "ran", ["tensorrt"], SKIPPED)
    hint = gate_hint([FAILURE], "ran", ["onnxruntime", "tensorrt"], SKIPPED)
    assert "add a backend" not in hint and "build.backends: [onnxruntime]" not in hint, hint
    assert hint.startswith("validate the engines on a machine that runs them (`kiln validate` there)"), hint
    assert hint.endswith(f"not built here: onnxruntime-cpu-int8: {KERNEL_FIX}"), hint  # int8's skip only


@dataclass(frozen=True)
class NoSettings(StageSettings):
    pass


class Gated(Summary):
    failures: list[str]

    def gate_failures(self) -> list[str]:
        return self.failures


def build(ctx: StageContext[NoSettings]) -> BuildSummary:
    return BuildSummary(skipped=SKIPPED)


def validate(ctx: StageContext[NoSettings]) -> Gated:
    return Gated(failures=[FAILURE])


def test_the_run_s_fix_line_reads_its_backends_and_its_build_s_skips(tmp_path: Path) -> None:
    stages = [
        Stage("build", f"{__name__}:build", (), NoSettings, BuildSummary, (__name__,), lambda s: {}),
        Stage("validate", f"{__name__}:validate", ("build",), NoSettings, Gated, (__name__,), lambda s: {}),
    ]
    cfg = config_from_dict(tiny_config_dict(**{"build.backends": ["onnxruntime", "tensorrt"]}))
    result = Runner(cfg, tmp_path, stages).run()
    assert result.error is not None and result.error.hint is not None
    assert "add a backend" not in result.error.hint and KERNEL_FIX in result.error.hint, result.error.hint
    # a one-stage `kiln validate`: the build's skips from its manifest in the workdir
    again = Runner(cfg, tmp_path, stages[1:], upstream=stages).run(force={"validate"})
    assert again.error is not None and KERNEL_FIX in (again.error.hint or ""), again.error
