"""The torch build runs the model on the precision stage's saved samples where it has them, and says why a package
failed on its example inputs: a model that indexes a table with a difference of two input columns (a layout model's
box width ``x1 - x0``) gets a negative index from random corners, which a compiled kernel's check aborts on."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from kiln.calibration.feeds import save_feeds
from kiln.core.errors import BuildError
from kiln.core.records import TensorSpec
from kiln.stages.engines.backend import BuildRequest
from kiln.stages.engines.torch.build import INDEX_HINT, LOADER_HINT, _compile_failed, _example_feed, _load_failed

WIDTHS = 64  # the width table's rows; corners are drawn within it


class BoxWidths(nn.Module):
    """Embeds each box's corners and its width ``bbox[..., 2] - bbox[..., 0]`` (as LayoutLM does), masked by
    ``mask``: the corners' table is the range the graph gives ``bbox``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.corner, self.width = nn.Embedding(WIDTHS, 8), nn.Embedding(WIDTHS, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, bbox: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        boxes = self.corner(bbox).sum(-2) + self.width(bbox[..., 2] - bbox[..., 0])
        return self.head(boxes * mask[..., None])


SPECS = [
    TensorSpec(name="bbox", dtype="int64", shape=["batch", "seq", 4]),
    TensorSpec(name="mask", dtype="int64", shape=["batch", "seq"]),
]


def boxes(rows: int, seq: int, seed: int) -> dict[str, np.ndarray]:
    """Valid boxes (``x0 <= x1 < WIDTHS``), each row's mask holding its row number so rows can be matched."""
    rng = np.random.default_rng(seed)
    x0 = rng.integers(0, WIDTHS // 2, (rows, seq))
    x1 = x0 + rng.integers(0, WIDTHS // 2, (rows, seq))
    bbox = np.stack([x0, np.zeros_like(x0), x1, np.zeros_like(x0)], axis=-1)
    return {"bbox": bbox, "mask": np.repeat(np.arange(rows)[:, None] + 100 * seed, seq, axis=1)}


def _request(tmp_path: Path, calibration: Path | None) -> BuildRequest:
    return BuildRequest(
        tmp_path / "m.onnx",
        tmp_path,
        "cpu",
        "fp32",
        None,
        tmp_path,
        SPECS,
        max_batch=8,
        axis_sizes={"seq": [3, 6]},
        calibration=calibration,
        index_ranges={"bbox": [0, WIDTHS - 1]},
    )


def test_the_example_feed_takes_the_saved_rows_in_turn(tmp_path: Path) -> None:
    """With saved samples the example holds only valid boxes, at the data's own length, row i of both inputs from
    one sample; a batch at another length is left out of the pool. Random corners give negative widths."""
    saved = [boxes(3, 5, seed=1), boxes(4, 3, seed=2), boxes(2, 5, seed=3)]
    save_feeds(saved, ["bbox", "mask"], tmp_path / "calibration.npz")
    req = _request(tmp_path, tmp_path / "calibration.npz")
    for batch in (1, 2, 8):
        feed = _example_feed(req, batch)
        assert feed["bbox"].shape == (batch, 5, 4) and feed["mask"].shape == (batch, 5)
        width = feed["bbox"][..., 2] - feed["bbox"][..., 0]
        assert width.min() >= 0 and width.max() < WIDTHS
        pool = {"bbox": np.concatenate([saved[0]["bbox"], saved[2]["bbox"]])}
        for i in range(batch):  # the 5 rows at length 5, in turn; each mask row names its own sample
            j = i % 5
            np.testing.assert_array_equal(feed["bbox"][i], pool["bbox"][j])
            assert feed["mask"][i, 0] == (100 + j if j < 3 else 300 + j - 3)
    with torch.inference_mode():
        BoxWidths()(*(torch.from_numpy(_example_feed(req, 8)[s.name]) for s in SPECS))
    random = _example_feed(_request(tmp_path, None), 8)
    assert (random["bbox"][..., 2] - random["bbox"][..., 0]).min() < 0  # what the engine's kernel aborted on


def test_saved_rows_that_do_not_fit_the_inputs_give_random_ones(tmp_path: Path) -> None:
    """Samples missing an input, or at a length outside the engine's, are not used."""
    save_feeds([{"bbox": boxes(2, 5, 1)["bbox"]}], ["bbox"], tmp_path / "one.npz")
    save_feeds([boxes(2, 9, 1)], ["bbox", "mask"], tmp_path / "long.npz")
    for name in ("one.npz", "long.npz"):
        feed = _example_feed(_request(tmp_path, tmp_path / name), 2)
        assert feed["bbox"].shape == (2, 6, 4)  # random, at the largest length


KERNEL_STDERR = """\
Error: index out of bounds: 0 <= tmp4 < 64L
Exception raised from cpp_fused_embedding_select_sub_0 at /tmp/cm/cy77.kernel.cpp:26 (most recent call first):
frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x9d (0x7f182d179b8d in libc10.so)
frame #1: c10::detail::torchCheckFail(char const*, char const*, unsigned int, char const*) + 0x69 (0x7f1 in libc10.so)
<omitting python frames>
frame #29: __libc_start_main + 0x85 (0x7f182f445305 in /lib/x86_64-linux-gnu/libc.so.6)

Traceback (most recent call last):
  File "<string>", line 7, in <module>
RuntimeError: index out of bounds: 0 <= tmp4 < 64L
Exception raised from cpp_fused_embedding_select_sub_0 at /tmp/cm/cy77.kernel.cpp:26 (most recent call first):
frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x9d (0x7f182d179b8d in libc10.so)
frame #30: _start + 0x21 (0x562cb550d081 in /work/venv/bin/python)
"""
TERMINATE_STDERR = """\
terminate called after throwing an instance of 'c10::Error'
  what():  index out of bounds: 0 <= tmp37 < 1024L
Exception raised from kernel at main.cpp:74 (most recent call first):
frame #30: _start + 0x21 (0x562cb550d081 in /work/venv/bin/python)
"""


@pytest.mark.parametrize("stderr", [KERNEL_STDERR, TERMINATE_STDERR], ids=["kernel", "terminate"])
def test_a_kernel_index_check_is_said_by_its_message_with_the_inputs_fix(stderr: str) -> None:
    """A C++ exception of the package's kernels is the model failing on the example inputs: its message is said,
    not the backtrace's last frame, and the fix is the inputs, not the libraries."""
    error = _load_failed(stderr, 1)
    assert isinstance(error, BuildError)
    assert "index out of bounds: 0 <=" in error.message and "frame" not in error.message
    assert "example inputs: an index out of range" in error.message
    assert "data.name" in error.hint and "libstdc++" not in error.hint


DLOPEN_STDERR = """\
Traceback (most recent call last):
  File "<string>", line 4, in <module>
RuntimeError: Error in dlopen: libstdc++.so.6: version `GLIBCXX_3.4.32' not found
Exception raised from DynamicLibrary at ../aten/src/ATen/DynamicLibrary.cpp:38 (most recent call first):
frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x9d (0x7f182d179b8d in libc10.so)
frame #30: _start + 0x21 (0x562cb550d081 in /work/venv/bin/python)
"""


def test_a_loader_that_fails_keeps_the_libraries_fix() -> None:
    """A loader's own failure (a library the package needs, a crash) keeps the libraries' fix; a C++ one is still
    said by its message, not by the backtrace's last frame."""
    assert _load_failed("", -11).message.endswith("(killed by SIGSEGV)")
    error = _load_failed(DLOPEN_STDERR, 1)
    assert "GLIBCXX_3.4.32' not found" in error.message and "frame" not in error.message
    assert "does not load in a fresh process" in error.message and error.hint == LOADER_HINT


def test_the_compiled_flavour_says_an_index_check_is_no_compiler_failure() -> None:
    error = _compile_failed(RuntimeError("kernel, /tmp/x/main.cpp:74, index out of bounds: 0 <= tmp37 < 1024L"))
    assert "failed on the build's example inputs" in error.message and error.hint == INDEX_HINT
    assert "could not compile" in _compile_failed(RuntimeError("C++ compile error")).message


@pytest.mark.slow
def test_a_box_width_model_builds_its_cpu_package_from_the_saved_rows(tmp_path: Path) -> None:
    """The package runs and passes its load check on valid boxes; on random corners its kernel aborted."""
    from kiln.stages.engines.config import BuildConfig
    from kiln.stages.engines.registry import load_engine
    from kiln.stages.engines.stage import build_engine
    from kiln.stages.engines.torch.config import TorchConfig
    from kiln.stages.export.torch_export import export_onnx

    sample = boxes(2, 5, seed=1)
    axes = {"bbox": {1: "seq"}, "mask": {1: "seq"}}
    export_onnx(
        BoxWidths().eval(), {k: torch.from_numpy(v) for k, v in sample.items()}, tmp_path / "m.onnx", dynamic_axes=axes
    )
    save_feeds([boxes(4, 5, seed=2)], ["bbox", "mask"], tmp_path / "calibration.npz")
    build_engine(
        tmp_path / "m.onnx",
        tmp_path / "e",
        "torch",
        "cpu",
        "fp32",
        BuildConfig(backends=["torch"], torch=TorchConfig(flavour="aotinductor", devices=["cpu"])),
        tmp_path / "c",
        max_batch=4,
        torch_model=BoxWidths,
        axis_sizes={"seq": [3, 6]},
        calibration=tmp_path / "calibration.npz",
        int_ranges={"bbox": [0, WIDTHS - 1]},
    )
    with load_engine(tmp_path / "e") as runner:
        got = runner.infer(sample)
    with torch.inference_mode():
        want = BoxWidths()(*(torch.from_numpy(sample[s.name]) for s in SPECS))
    np.testing.assert_allclose(next(iter(got.values())), want.numpy(), atol=1e-5, rtol=1e-5)
