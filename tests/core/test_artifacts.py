from pathlib import Path

import pytest

from kiln.core.artifacts import atomic_dir, clean_stale_staging, hash_file, hash_tree, write_json_atomic


def test_atomic_dir_replaces_on_success(tmp_path: Path) -> None:
    final = tmp_path / "stage"
    final.mkdir()
    (final / "old.txt").write_text("old")
    with atomic_dir(final) as d:
        (d / "new.txt").write_text("new")
    assert sorted(p.name for p in final.iterdir()) == ["new.txt"]
    assert not list(tmp_path.glob(".*"))


def test_atomic_dir_keeps_previous_on_failure(tmp_path: Path) -> None:
    final = tmp_path / "stage"
    final.mkdir()
    (final / "old.txt").write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_dir(final) as d:
            (d / "half.txt").write_text("partial")
            raise RuntimeError("interrupted")
    assert (final / "old.txt").read_text() == "old" and not (final / "half.txt").exists()


def test_hashes_are_of_content_not_names(tmp_path: Path) -> None:
    a, b = tmp_path / "a" / "m.onnx", tmp_path / "b" / "m.onnx"
    a.parent.mkdir()
    b.parent.mkdir()
    a.write_bytes(b"one")
    b.write_bytes(b"two")
    assert hash_file(a) != hash_file(b)
    assert hash_tree(a.parent) != hash_tree(b.parent)


def test_stale_staging_is_cleaned(tmp_path: Path) -> None:
    (tmp_path / ".train.staging-1234").mkdir()
    write_json_atomic(tmp_path / "x.json", {"a": 1})
    clean_stale_staging(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["x.json"]


def test_interrupted_swap_restores_the_previous_result(tmp_path: Path) -> None:
    # Cut off after `final` was moved aside and before staging took its place: before, both were deleted.
    old = tmp_path / ".train.old-1234abcd"
    old.mkdir()
    (old / "model.safetensors").write_bytes(b"w")
    (tmp_path / ".train.staging-5678abcd").mkdir()
    clean_stale_staging(tmp_path)
    assert (tmp_path / "train" / "model.safetensors").read_bytes() == b"w"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train"]


def test_old_folder_beside_its_final_is_removed(tmp_path: Path) -> None:
    (tmp_path / "train").mkdir()
    (tmp_path / ".train.old-1234abcd").mkdir()
    clean_stale_staging(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train"]


def test_atomic_writes_get_the_umask_permissions_not_mkstemps_0600(tmp_path: Path) -> None:
    # Before: every artifact was 0600, unreadable for a serving process running as another user.
    import os
    import stat

    from kiln.core.artifacts import write_bytes_atomic

    old = os.umask(0o022)
    try:
        write_bytes_atomic(tmp_path / "engine.plan", b"x")
        os.umask(0o077)
        write_bytes_atomic(tmp_path / "private.plan", b"x")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "engine.plan").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "private.plan").stat().st_mode) == 0o600
