"""write_atomic (runtime.persist.files), the one atomic file replacement (cache manifests, conversations, scenario state)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from runtime.persist.files import write_atomic


def test_write_atomic_replaces_the_file_whole_and_private(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    path.write_bytes(b"old")
    write_atomic(path, b"new")
    assert path.read_bytes() == b"new"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


class _Interrupted(BaseException):
    pass


def test_a_failed_rename_leaves_the_old_file_and_no_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "conversation.json"
    path.write_bytes(b"old")

    def replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        raise _Interrupted

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(_Interrupted):
        write_atomic(path, b"new", fsync=False)
    monkeypatch.undo()
    assert path.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["conversation.json"]


def test_a_directory_in_the_way_is_replaced_only_when_asked(tmp_path: Path) -> None:
    path = tmp_path / "manifest.json"
    path.mkdir()
    (path / "junk").write_text("x")
    with pytest.raises(OSError):  # IsADirectoryError on Linux
        write_atomic(path, b"data", fsync=False)
    assert path.is_dir()
    write_atomic(path, b"data", fsync=False, replace_directory=True)
    assert path.read_bytes() == b"data"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json"]


def test_a_symlink_at_the_name_is_replaced_not_followed(tmp_path: Path) -> None:
    path = tmp_path / "file"
    write_atomic(path, b"one", fsync=False)
    outside = tmp_path / "outside"
    outside.write_bytes(b"untouched")
    (tmp_path / "link").symlink_to(outside)
    write_atomic(tmp_path / "link", b"two", fsync=False)  # replaces the link itself
    assert outside.read_bytes() == b"untouched"
    assert (tmp_path / "link").read_bytes() == b"two" and not (tmp_path / "link").is_symlink()
