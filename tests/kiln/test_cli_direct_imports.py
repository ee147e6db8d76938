"""What the direct commands on ONNX files load: `kiln build FILE.onnx`, `kiln validate ENGINE --reference FILE.onnx`
and `kiln precision FILE.onnx` use no PyTorch, so they load none. A fresh interpreter each, as a user's shell starts
one."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parents[2]

# Runs each command given (JSON: a list of argument lists) in turn, then says which torch modules are loaded.
PROBE = """
import json, sys
from click.testing import CliRunner
from kiln.cli import main
codes = []
for args in json.loads(sys.argv[1]):
    result = CliRunner().invoke(main, args)
    codes.append((result.exit_code, result.output[-500:]))
loaded = sorted(m for m in sys.modules if m.split(".")[0] == "torch")
print(json.dumps({"codes": codes, "loaded": loaded}))
"""


def _tiny_onnx(path: Path) -> None:
    """One MatMul of a dynamic batch: [batch, 8] -> [batch, 4]."""
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["input", "w"], ["logits"])],
        "tiny",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 4])],
        [w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))


def _probe(cwd: Path, commands: list[list[str]]) -> dict[str, list]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(commands)], cwd=cwd, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.splitlines()[-1])


# Modules of the direct commands whose own code imports torch only inside the functions that make tensors or read
# weights; those left between the commands and torch are below.
OWN_LAZY = ["core/data.py", "models/model_io.py", "calibration/data.py", "stages/validate/direct.py"]
TORCH_FREE = [
    "kiln.core.data",
    "kiln.calibration.data",
    "kiln.stages.export.batch_axes",
    "kiln.stages.export.graph_inputs",
]
COMMANDS = {
    "build": [["build", "m.onnx", "-o", "engine"]],
    "validate": [
        ["build", "m.onnx", "-o", "engine"],
        ["validate", "engine", "--reference", "m.onnx", "--inputs", "d.npz"],
    ],
    "precision": [["precision", "m.onnx", "--calibration", "d.npz", "-o", "variants"]],
}


@pytest.mark.parametrize("path", OWN_LAZY)
def test_modules_of_the_direct_commands_import_torch_only_in_functions(path: str) -> None:
    tree = ast.parse((ROOT / path).read_text())
    top = [
        node.lineno
        for node in tree.body
        if isinstance(node, ast.Import)
        and any(a.name.split(".")[0] == "torch" for a in node.names)
        or isinstance(node, ast.ImportFrom)
        and (node.module or "").split(".")[0] == "torch"
    ]
    assert not top, f"{path} imports torch at module level (line {top})"


def test_data_and_graph_modules_load_no_torch(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = f"import sys\nimport {', '.join(TORCH_FREE)}\nprint(sorted(m for m in sys.modules if m.startswith('torch')))"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", f"{TORCH_FREE} loaded {out.stdout[:200]}"


@pytest.mark.parametrize(
    "command",
    [
        "build",
        "validate",
        "precision",
    ],
)
def test_direct_commands_on_onnx_files_load_no_torch(tmp_path: Path, command: str) -> None:
    _tiny_onnx(tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", input=np.random.default_rng(1).standard_normal((16, 8)).astype(np.float32))
    got = _probe(tmp_path, COMMANDS[command])
    assert all(code == 0 for code, _ in got["codes"]), got["codes"]
    assert got["loaded"] == [], f"kiln {command} on an ONNX file loaded {got['loaded'][:5]}"
