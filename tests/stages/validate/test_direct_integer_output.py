"""`kiln validate ENGINE` of a model whose one output is an argmax's class ids: they are held to their share of
equal values, with no warning that they are compared by cosine or could be named as class logits."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.pipeline.test_faults import invoke
from tests.stages.accuracy.test_check_extra_outputs import _argmax


def test_class_ids_get_no_float_output_warning(tmp_path: Path) -> None:
    model, engine, inputs = _argmax(tmp_path / "pred.onnx", False), tmp_path / "e", tmp_path / "x.npz"
    assert invoke("build", model, "-o", engine).exit_code == 0
    np.savez(inputs, input=np.random.default_rng(1).standard_normal((32, 4)).astype(np.float32))
    out = invoke("validate", engine, "--reference", model, "--inputs", inputs)
    said = " ".join(out.output.split())  # the log's lines wrap at the terminal's width
    assert out.exit_code == 0 and '"passed": true' in said, said
    assert "not held to top-1 agreement" not in said and "compared by cosine" not in said, said
