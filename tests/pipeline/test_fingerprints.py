"""User data read from files (a data module, a calibration reader) is part of the cache key by content: changing
the file reruns the stages that read it, even though the config and the user's code did not change."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kiln.pipeline.api import run_pipeline
from kiln.pipeline.config import config_from_dict
from kiln.pipeline.fingerprints import calibration_fingerprint, dataset_fingerprint
from kiln.pipeline.stage_list import stage_named
from tests.conftest import tiny_config_dict

USER_CODE = """
import numpy as np
import torch
from kiln.core.data import DatasetSplits
from kiln.models.datasets import digits

def load(path):
    d, k = digits(seed=0), float(np.load(path))
    return DatasetSplits(d.train_x * k, d.train_y, d.val_x * k, d.val_y, d.num_classes, "scaled digits")

def as_numpy():
    d = digits(seed=0)
    return DatasetSplits(d.train_x.numpy(), d.train_y.numpy(), d.val_x.numpy(), d.val_y.numpy(), 10)

def bf16():
    d = digits(seed=0)
    return DatasetSplits(d.train_x.bfloat16(), d.train_y, d.val_x.bfloat16(), d.val_y, 10)

CALLS = []

def counted(path, folder=None, unseen=None, count=None):
    # load(), noting each call in count; reads a folder's listing and a file through C (ctypes), if given
    import ctypes, glob, os
    open(count, "a").write("call\\n")
    d, k = digits(seed=0), float(np.load(path))
    if folder:
        k += len(glob.glob(os.path.join(folder, "*.txt")))
    if unseen:
        libc = ctypes.CDLL(None)
        libc.fopen.restype = ctypes.c_void_p
        f = libc.fopen(unseen.encode(), b"rb")
        buf = ctypes.create_string_buffer(8)
        libc.fread(buf, 1, 8, ctypes.c_void_p(f))
        libc.fclose(ctypes.c_void_p(f))
        k += buf.raw[0]
    return DatasetSplits(d.train_x * k, d.train_y, d.val_x * k, d.val_y, d.num_classes, "scaled digits")

def online(port, count):
    import socket
    open(count, "a").write("call\\n")
    socket.create_connection(("127.0.0.1", port)).close()
    return load_digits()

def forked(path, count):
    import multiprocessing
    open(count, "a").write("call\\n")
    with multiprocessing.get_context("fork").Pool(1) as pool:
        k = float(pool.apply(np.load, (path,)))
    d = digits(seed=0)
    return DatasetSplits(d.train_x * k, d.train_y, d.val_x * k, d.val_y, d.num_classes)

def dynamic(module, count):
    import importlib
    open(count, "a").write("call\\n")
    k = importlib.import_module(module).SCALE
    d = digits(seed=0)
    return DatasetSplits(d.train_x * k, d.train_y, d.val_x * k, d.val_y, d.num_classes)

def chooser(count, folder):
    import os
    open(count, "a").write("call\\n")
    try:  # an override file, if there is one
        k = float(np.load(os.path.join(folder, "override.npy")))
    except FileNotFoundError:
        k = float(np.load(os.path.join(folder, os.environ.get("KILN_FP_FILE", "a.npy"))))
    d = digits(seed=0)
    return DatasetSplits(d.train_x * k, d.train_y, d.val_x * k, d.val_y, d.num_classes)

def load_digits():
    d = digits(seed=0)
    return DatasetSplits(d.train_x, d.train_y, d.val_x, d.val_y, d.num_classes)

def calib(path, count=None):
    if count:
        open(count, "a").write("call\\n")
    x = np.load(path)
    return [x[i:i + 16] for i in range(0, len(x), 16)]
"""


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    (src / "my_files.py").write_text(USER_CODE)
    monkeypatch.syspath_prepend(str(src))
    yield src
    sys.modules.pop("my_files", None)


def statuses(result) -> dict[str, str]:
    return {r.name: r.status for r in result.records}


def test_changed_calibration_file_reruns_precision(tmp_path: Path, user_module: Path) -> None:
    calib = tmp_path / "calib.npy"
    x = np.random.default_rng(0).random((64, 1, 8, 8), dtype=np.float32)
    np.save(calib, x)
    cfg = config_from_dict(
        tiny_config_dict(
            **{
                "precision.variants": ["fp32", "int8"],
                "calibration.reader": "my_files:calib",
                "calibration.reader_params": {"path": str(calib)},
            }
        )
    )
    first, _ = run_pipeline(cfg, tmp_path / "wd", stop="precision")
    assert first.ok and set(statuses(first).values()) == {"ran"}
    same, _ = run_pipeline(cfg, tmp_path / "wd", stop="precision")
    assert set(statuses(same).values()) == {"cached"}
    np.save(calib, x * 4)  # same code, same config, other data
    changed, _ = run_pipeline(cfg, tmp_path / "wd", stop="precision")
    assert statuses(changed) == {"train": "cached", "export": "cached", "optimize": "cached", "precision": "ran"}


def test_changed_dataset_file_reruns_training(tmp_path: Path, user_module: Path) -> None:
    scale = tmp_path / "scale.npy"
    np.save(scale, np.float32(1.0))
    cfg = config_from_dict(tiny_config_dict(**{"data.name": "my_files:load", "data.params": {"path": str(scale)}}))
    first, _ = run_pipeline(cfg, tmp_path / "wd", stop="export")
    assert statuses(first) == {"train": "ran", "export": "ran"}
    assert set(statuses(run_pipeline(cfg, tmp_path / "wd", stop="export")[0]).values()) == {"cached"}
    np.save(scale, np.float32(0.5))
    changed, _ = run_pipeline(cfg, tmp_path / "wd", stop="export")
    assert statuses(changed) == {"train": "ran", "export": "ran"}


def test_built_in_data_and_no_reader_need_no_fingerprint() -> None:
    cfg = config_from_dict(tiny_config_dict(**{"precision.variants": ["fp32", "int8"]}))
    assert dataset_fingerprint(cfg) is None and calibration_fingerprint(cfg) is None


def test_reader_is_not_called_when_nothing_calibrates(tmp_path: Path, user_module: Path) -> None:
    cfg = config_from_dict(
        tiny_config_dict(
            **{
                "precision.variants": ["fp32"],
                "calibration.reader": "my_files:calib",
                "calibration.reader_params": {"path": str(tmp_path / "absent.npy")},
            }
        )
    )
    assert calibration_fingerprint(cfg) is None  # the file does not exist: calling the reader would fail


def test_changed_checkpoint_file_reruns_training(tmp_path: Path) -> None:
    """model.checkpoint names a file: new weights under the same path must not reuse the old export."""
    import torch

    from kiln.models.registry import build_model

    params = {"width": 8, "depth": 2}
    ckpt = tmp_path / "w.pt"
    torch.manual_seed(0)
    torch.save(build_model("cnn", params).state_dict(), ckpt)
    cfg = config_from_dict(tiny_config_dict(**{"model.checkpoint": str(ckpt)}))
    first, _ = run_pipeline(cfg, tmp_path / "wd", stop="export")
    assert statuses(first) == {"train": "skipped", "export": "ran"}  # 'skipped': weights loaded, no training
    assert set(statuses(run_pipeline(cfg, tmp_path / "wd", stop="export")[0]).values()) == {"cached"}
    torch.manual_seed(1)
    torch.save(build_model("cnn", params).state_dict(), ckpt)
    changed, _ = run_pipeline(cfg, tmp_path / "wd", stop="export")
    assert statuses(changed) == {"train": "skipped", "export": "ran"}


def test_editing_a_helper_module_of_user_code_reruns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """mymodels.py imports its layers from a sibling file: editing that file counts as editing the model."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "kiln_fp_layers.py").write_text("import torch\nACT = torch.nn.ReLU\n")
    (src / "kiln_fp_models.py").write_text(
        "import torch\nfrom kiln_fp_layers import ACT\n\n"
        "def build():\n    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 16), ACT(), "
        "torch.nn.Linear(16, 10))\n"
    )
    monkeypatch.syspath_prepend(str(src))
    try:
        cfg = config_from_dict(
            tiny_config_dict(**{"model.name": "kiln_fp_models:build", "model.params": {}, "data.name": "digits"})
        )
        assert set(statuses(run_pipeline(cfg, tmp_path / "wd", stop="train")[0]).values()) == {"ran"}
        (src / "kiln_fp_layers.py").write_text("import torch\nACT = torch.nn.Tanh\n")
        assert statuses(run_pipeline(cfg, tmp_path / "wd", stop="train")[0]) == {"train": "ran"}
    finally:
        for m in ("kiln_fp_models", "kiln_fp_layers"):
            sys.modules.pop(m, None)


def test_odd_user_datasets_fingerprint_or_fail_cleanly(user_module: Path) -> None:
    """numpy arrays in DatasetSplits once crashed the fingerprint with a traceback; bfloat16 has no numpy type."""
    from kiln.core.errors import ConfigError

    assert dataset_fingerprint(config_from_dict(tiny_config_dict(**{"data.name": "my_files:bf16"})))
    with pytest.raises(ConfigError, match="not a torch.Tensor"):
        dataset_fingerprint(config_from_dict(tiny_config_dict(**{"data.name": "my_files:as_numpy"})))


def test_the_report_does_not_reload_user_data(
    tmp_path: Path, user_module: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stages a command did not run are labelled kept/stale without calling the user's dataset or reader (a
    one-stage command once loaded both, seconds each, and crashed when a reader's file had moved)."""
    from kiln.pipeline import fingerprints
    from kiln.pipeline.report import build_report
    from kiln.pipeline.runner import RunResult

    scale = tmp_path / "scale.npy"
    np.save(scale, np.float32(1.0))
    cfg = config_from_dict(tiny_config_dict(**{"data.name": "my_files:load", "data.params": {"path": str(scale)}}))
    assert run_pipeline(cfg, tmp_path / "wd", stop="export")[0].ok

    def no(config):
        raise AssertionError("user data loaded by the report")

    monkeypatch.setitem(fingerprints.FINGERPRINTS, "dataset", no)
    monkeypatch.setitem(fingerprints.FINGERPRINTS, "calibration", no)
    report = build_report(RunResult(tmp_path / "wd", []), cfg, tmp_path / "wd")
    assert {n: s["status"] for n, s in report["stages"].items()} == {"train": "kept", "export": "kept"}


def test_new_external_weights_beside_the_same_onnx_graph_change_its_fingerprint(tmp_path: Path) -> None:
    """The dynamo exporter keeps weights in ``model.onnx.data``: new weights there, the graph file unchanged, must
    not reuse what the old weights built."""
    from kiln.pipeline.fingerprints import onnx_fingerprint
    from tests.pipeline.test_faults import tiny_onnx

    path = tiny_onnx(tmp_path / "m.onnx", external=True)  # a 4x3 weight in m.onnx.data
    cfg = config_from_dict({"model": {"onnx": str(path)}})
    before, graph_bytes = onnx_fingerprint(cfg), path.read_bytes()
    data = tmp_path / "m.onnx.data"
    data.write_bytes(np.full((4, 3), 2.0, np.float32).tobytes())
    assert path.read_bytes() == graph_bytes and onnx_fingerprint(cfg) != before


def test_files_named_in_model_params_are_in_trains_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A factory building from a config.json or a from_pretrained folder named in model.params: editing a file
    there retrains. A parameter that is no path, or the working folder itself, counts for nothing."""
    from kiln.pipeline.fingerprints import model_files_fingerprint

    monkeypatch.chdir(tmp_path)
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text('{"hidden": 8}')
    (tmp_path / "arch.json").write_text('{"width": 8}')

    def stamp(**params: object) -> str | None:
        return model_files_fingerprint(config_from_dict(tiny_config_dict(**{"model.params": params})))

    assert stamp(act="relu", width=8, root=".", parent="..") is None
    (tmp_path / "wd").mkdir()
    params = config_from_dict(tiny_config_dict(**{"model.params": {"w": "wd"}}))
    assert model_files_fingerprint(params, Path("wd")) is None  # the workdir would change with every run
    before = (stamp(spec="arch.json"), stamp(layers=[{"pretrained": "bert"}]))
    (tmp_path / "arch.json").write_text('{"width": 32}')
    (tmp_path / "bert" / "config.json").write_text('{"hidden": 16}')
    after = (stamp(spec="arch.json"), stamp(layers=[{"pretrained": "bert"}]))
    assert None not in before and before[0] != after[0] and before[1] != after[1]
    assert "model_files" in stage_named("train").data


def _skipping(tmp_path: Path, **params: object) -> tuple[Any, Path]:
    count = tmp_path / "calls.txt"
    cfg = {"data.name": "my_files:counted", "data.params": {**params, "count": str(count)}, "data.skip_unchanged": True}
    return config_from_dict(tiny_config_dict(**cfg)), count


def _calls(count: Path) -> int:
    return len(count.read_text().splitlines()) if count.exists() else 0


def test_skip_unchanged_calls_the_data_function_only_when_what_it_read_changed(
    tmp_path: Path, user_module: Path
) -> None:
    """With data.skip_unchanged, a second run takes the data's hash from the workdir's cache without calling the
    function; a file it opened rewritten at the same size (one clock tick: same mtime), or a new file in a folder it
    listed, calls it again."""
    scale, folder, wd = tmp_path / "scale.npy", tmp_path / "texts", tmp_path / "wd"
    np.save(scale, np.float32(1.0))
    folder.mkdir()
    cfg, count = _skipping(tmp_path, path=str(scale), folder=str(folder))
    first = dataset_fingerprint(cfg, wd)
    assert dataset_fingerprint(cfg, wd) == first and _calls(count) == 1
    np.save(scale, np.float32(2.0))  # same size
    second = dataset_fingerprint(cfg, wd)
    assert second != first and _calls(count) == 2
    assert dataset_fingerprint(cfg, wd) == second and _calls(count) == 2
    (folder / "a.txt").write_text("x")
    assert dataset_fingerprint(cfg, wd) != second and _calls(count) == 3
    off = config_from_dict(tiny_config_dict(**{"data.name": "my_files:counted", "data.params": cfg.data.params}))
    assert dataset_fingerprint(off, wd) == dataset_fingerprint(cfg, wd) and _calls(count) == 4  # off: always called


def test_depends_on_covers_files_read_unseen(tmp_path: Path, user_module: Path) -> None:
    """A file read in C is not seen; named in data.depends_on, a change to it calls the function again. A path
    there that does not exist is an error naming it."""
    from kiln.core.errors import InputFileError

    scale, unseen, wd = tmp_path / "scale.npy", tmp_path / "raw.bin", tmp_path / "wd"
    np.save(scale, np.float32(1.0))
    unseen.write_bytes(bytes([1] * 8))
    cfg, count = _skipping(tmp_path, path=str(scale), unseen=str(unseen))
    first = dataset_fingerprint(cfg, wd)
    unseen.write_bytes(bytes([2] * 8))
    assert dataset_fingerprint(cfg, wd) == first and _calls(count) == 1  # not seen, not named: the limit
    named = config_from_dict(tiny_config_dict(**{**_flat(cfg), "data.depends_on": [str(unseen)]}))
    assert dataset_fingerprint(named, wd) != first and _calls(count) == 2
    unseen.write_bytes(bytes([3] * 8))
    dataset_fingerprint(named, wd)
    assert _calls(count) == 3
    gone = config_from_dict(tiny_config_dict(**{**_flat(cfg), "data.depends_on": [str(tmp_path / "nope")]}))
    with pytest.raises(InputFileError, match="data.depends_on names .*nope"):
        dataset_fingerprint(gone, wd)


def _flat(cfg: Any) -> dict[str, Any]:
    return {f"data.{k}": v for k, v in cfg.data.model_dump().items()}


def test_a_data_function_reaching_the_network_is_called_every_run(
    tmp_path: Path, user_module: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import socket

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        count = tmp_path / "calls.txt"
        params = {"port": server.getsockname()[1], "count": str(count)}
        cfg = config_from_dict(
            tiny_config_dict(**{"data.name": "my_files:online", "data.params": params, "data.skip_unchanged": True})
        )
        dataset_fingerprint(cfg, tmp_path / "wd")
        dataset_fingerprint(cfg, tmp_path / "wd")
    assert _calls(count) == 2
    assert "whose reads are not seen (socket.connect)" in caplog.text


def test_skip_unchanged_is_not_in_any_stages_key(tmp_path: Path, user_module: Path) -> None:
    """Turning it on changes how the run checks the data, not the data: nothing reruns."""
    scale = tmp_path / "scale.npy"
    np.save(scale, np.float32(1.0))
    cfg = config_from_dict(tiny_config_dict(**{"data.name": "my_files:load", "data.params": {"path": str(scale)}}))
    assert statuses(run_pipeline(cfg, tmp_path / "wd", stop="train")[0]) == {"train": "ran"}
    on = config_from_dict(
        tiny_config_dict(**{**_flat(cfg), "data.skip_unchanged": True, "data.depends_on": [str(scale)]})
    )
    assert statuses(run_pipeline(on, tmp_path / "wd", stop="train")[0]) == {"train": "cached"}


def test_calibration_skip_unchanged_calls_the_reader_only_when_its_file_changed(
    tmp_path: Path, user_module: Path
) -> None:
    calib, count, wd = tmp_path / "calib.npy", tmp_path / "calls.txt", tmp_path / "wd"
    np.save(calib, np.ones((32, 1, 8, 8), np.float32))
    cfg = config_from_dict(
        tiny_config_dict(
            **{
                "precision.variants": ["fp32", "int8"],
                "calibration.reader": "my_files:calib",
                "calibration.reader_params": {"path": str(calib), "count": str(count)},
                "calibration.skip_unchanged": True,
            }
        )
    )
    first = calibration_fingerprint(cfg, wd)
    assert calibration_fingerprint(cfg, wd) == first and _calls(count) == 1
    np.save(calib, np.full((32, 1, 8, 8), 2, np.float32))
    assert calibration_fingerprint(cfg, wd) != first and _calls(count) == 2


def test_a_file_is_known_by_its_stat_and_by_its_content_only_when_just_modified(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reading every data file on every cached run would cost what calling the function costs. Its size, mtime,
    inode and ctime say whether it changed (the ctime too: a reproducible archive unpacked over it keeps the size
    and mtime); a file modified just before it was stamped may be rewritten within the file clock's tick with all
    of those the same, so its content's digest is kept too."""
    import os

    from kiln.pipeline import fingerprints
    from kiln.pipeline.fingerprints import _data_stamp, _still

    new = tmp_path / "new.npy"
    new.write_bytes(b"a" * 64)
    just = _data_stamp(new)
    assert just.count(":") == 4 and _still(new, just)
    size, mtime, ino, ctime, _ = just.split(":")
    assert not _still(new, f"{size}:{mtime}:{ino}:{ctime}:{'0' * 64}")  # the content decides
    monkeypatch.setattr(fingerprints, "RACY_NS", 0)  # long after it was written
    settled = _data_stamp(new)
    assert settled.count(":") == 3 and _still(new, settled)
    st = new.stat()
    new.write_bytes(b"b" * 64)
    os.utime(new, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size, same mtime, same inode: `tar -x` of another
    assert not _still(new, settled)  # its ctime moved


def test_a_declared_folder_holding_the_workdir_is_stamped_without_it(tmp_path: Path) -> None:
    """``depends_on: ["."]`` with the workdir inside: what the run writes there changes nothing."""
    from kiln.pipeline.fingerprints import _declared

    (tmp_path / "data.csv").write_text("1,2\n")
    (tmp_path / "kiln-out" / "train").mkdir(parents=True)
    before = _declared([str(tmp_path)], tmp_path / "kiln-out")
    (tmp_path / "kiln-out" / "train" / "model.safetensors").write_bytes(b"weights")
    assert _declared([str(tmp_path)], tmp_path / "kiln-out") == before
    (tmp_path / "data.csv").write_text("1,3\n")
    assert _declared([str(tmp_path)], tmp_path / "kiln-out") != before


def test_a_run_calls_the_data_function_once_and_every_stage_reads_those_splits(
    tmp_path: Path, user_module: Path
) -> None:
    """It was called for the key's hash and again by each stage that read the data (5 times a run): an unseeded
    function gave train, precision and validate different splits."""
    scale = tmp_path / "scale.npy"
    np.save(scale, np.float32(1.0))
    count = tmp_path / "calls.txt"
    cfg = config_from_dict(
        tiny_config_dict(**{"data.name": "my_files:counted", "data.params": {"path": str(scale), "count": str(count)}})
    )
    result, _ = run_pipeline(cfg, tmp_path / "wd", stop="validate")
    assert result.ok and _calls(count) == 1


def test_reads_the_hook_cannot_see_or_tell_apart_still_call_the_function(
    tmp_path: Path, user_module: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file read in a forked worker (a pool, a DataLoader's workers): called every run. A helper module imported
    by name at run time: watched as a file. A link re-pointed at another file: another file."""
    import os

    wd, count = tmp_path / "wd", tmp_path / "calls.txt"
    scale = tmp_path / "scale.npy"
    np.save(scale, np.float32(1.0))

    def config(name: str, **params: object) -> Any:
        flat = {"data.name": f"my_files:{name}", "data.params": {**params, "count": str(count)}}
        return config_from_dict(tiny_config_dict(**flat, **{"data.skip_unchanged": True}))

    forked = config("forked", path=str(scale))
    dataset_fingerprint(forked, wd)
    dataset_fingerprint(forked, wd)
    assert _calls(count) == 2

    (user_module / "kiln_fp_scale.py").write_text("SCALE = 1.0\n")
    dyn = config("dynamic", module="kiln_fp_scale")
    try:
        first = dataset_fingerprint(dyn, wd)
        (user_module / "kiln_fp_scale.py").write_text("SCALE = 5.0\n")
        sys.modules.pop("kiln_fp_scale", None)
        assert dataset_fingerprint(dyn, wd) != first
    finally:
        sys.modules.pop("kiln_fp_scale", None)

    v1, v2, link = tmp_path / "v1.npy", tmp_path / "v2.npy", tmp_path / "latest.npy"
    np.save(v1, np.float32(1.0))
    np.save(v2, np.float32(2.0))
    os.symlink(v1, link)
    linked = config("counted", path=str(link))
    first = dataset_fingerprint(linked, wd)
    link.unlink()
    os.symlink(v2, link)
    assert dataset_fingerprint(linked, wd) != first


def test_a_digest_kept_for_a_just_written_file_is_dropped_once_the_file_settles(
    tmp_path: Path, user_module: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Else every cached run would read the whole file again, for good."""
    import json

    from kiln.pipeline import fingerprints

    scale, wd = tmp_path / "scale.npy", tmp_path / "wd"
    np.save(scale, np.float32(1.0))
    cfg, count = _skipping(tmp_path, path=str(scale))
    monkeypatch.setattr(fingerprints, "RACY_NS", 10**15)  # just written however long a busy machine took to get here
    dataset_fingerprint(cfg, wd)
    stamps = lambda: list(json.loads((wd / "cache" / "data-hashes.json").read_text()).values())[0]["read"]  # noqa: E731
    assert stamps()[str(scale)].count(":") == 4  # just written: its digest kept
    monkeypatch.setattr(fingerprints, "RACY_NS", 0)  # as if the file's clock tick were long past
    dataset_fingerprint(cfg, wd)
    assert stamps()[str(scale)].count(":") == 3 and _calls(count) == 1


def test_an_environment_variable_or_a_file_that_appears_calls_the_function_again(
    tmp_path: Path, user_module: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file chosen by an environment variable, and an override file that did not exist and then does: both
    were kept as unchanged (neither a read nor an absence was recorded)."""
    wd, count = tmp_path / "wd", tmp_path / "calls.txt"
    np.save(tmp_path / "a.npy", np.float32(1.0))
    np.save(tmp_path / "b.npy", np.float32(2.0))
    monkeypatch.delenv("KILN_FP_FILE", raising=False)
    flat = {"data.name": "my_files:chooser", "data.params": {"count": str(count), "folder": str(tmp_path)}}
    cfg = config_from_dict(tiny_config_dict(**flat, **{"data.skip_unchanged": True}))
    first = dataset_fingerprint(cfg, wd)
    assert dataset_fingerprint(cfg, wd) == first and _calls(count) == 1
    monkeypatch.setenv("KILN_FP_FILE", "b.npy")
    second = dataset_fingerprint(cfg, wd)
    assert second != first and _calls(count) == 2
    np.save(tmp_path / "override.npy", np.float32(3.0))
    assert dataset_fingerprint(cfg, wd) not in (first, second) and _calls(count) == 3


def test_a_file_changed_while_the_function_ran_is_not_kept_as_read(
    tmp_path: Path, user_module: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its new stamp beside the old data's hash would say "unchanged" for good."""
    from kiln.pipeline import fingerprints

    scale, wd = tmp_path / "scale.npy", tmp_path / "wd"
    np.save(scale, np.float32(1.0))
    cfg, count = _skipping(tmp_path, path=str(scale))
    real = fingerprints._dataset_hash

    def meanwhile(config: Any, load: Any = None) -> str:
        value = real(config, load)
        np.save(scale, np.float32(2.0))  # a logger appending while the function tokenizes
        return value

    monkeypatch.setattr(fingerprints, "_dataset_hash", meanwhile)
    dataset_fingerprint(cfg, wd)
    monkeypatch.setattr(fingerprints, "_dataset_hash", real)
    dataset_fingerprint(cfg, wd)
    assert _calls(count) == 2


def test_the_runs_dataset_is_let_go_after_the_last_stage_that_reads_it(tmp_path: Path, user_module: Path) -> None:
    from kiln.pipeline.runner import Runner
    from kiln.pipeline.stage_list import STAGES

    scale = tmp_path / "scale.npy"
    np.save(scale, np.float32(1.0))
    cfg = config_from_dict(tiny_config_dict(**{"data.name": "my_files:load", "data.params": {"path": str(scale)}}))
    runner = Runner(cfg, tmp_path / "wd", [s for s in STAGES if s.name in ("train", "export")])
    assert runner.run().ok and runner._dataset == []
