"""Atomic, durable file replacement: kvmem's one ``write_atomic``.

A file is written as ``<name>.<random>.tmp`` in its final directory (created
``0o600``, exclusively, never through a symlink), flushed and fsynced, then
renamed over ``<name>`` with :func:`os.replace`, and the directory is fsynced
so that the rename itself is durable. A crash leaves the old file or the new
one, whole. An exception removes the temporary file; a kill leaves it behind
(a cache directory deletes those when it is opened).

Used for the cache directory's manifests (:mod:`runtime.persist`), the home
folder's conversations (:mod:`runtime.home`) and a scenario run's state; the
cache directory's batches of files (:class:`runtime.persist.files.AtomicBatch`)
are made of the same steps.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import stat
from pathlib import Path

__all__ = [
    "FILE_MODE",
    "TEMP_SUFFIX",
    "create_temp",
    "fsync_dir",
    "clear_directory",
    "write_atomic",
]

log = logging.getLogger("kvmem.atomic")

FILE_MODE = 0o600
TEMP_SUFFIX = ".tmp"

_WRITE_FLAGS = (
    os.O_WRONLY
    | os.O_CREAT
    | os.O_EXCL
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_CLOEXEC", 0)
    | getattr(os, "O_BINARY", 0)
)


def create_temp(path: Path) -> tuple[int, Path]:
    """Create ``<name>.<random>.tmp`` beside ``path`` (``0o600``, exclusively); return its descriptor and path."""
    tmp = path.with_name(f"{path.name}.{secrets.token_hex(6)}{TEMP_SUFFIX}")
    return os.open(tmp, _WRITE_FLAGS, FILE_MODE), tmp


def fsync_dir(path: Path) -> None:
    """Make renames and creations inside ``path`` durable (no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def clear_directory(path: Path) -> None:
    """Remove a directory that stands where a file is about to be renamed (os.replace cannot)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(info.st_mode):
        log.warning("removing directory %s that stands where a file belongs", path)
        shutil.rmtree(path)


def write_atomic(
    path: Path, data: bytes | memoryview, *, fsync: bool = True, replace_directory: bool = False
) -> None:
    """Write ``data`` to ``path`` so that a crash leaves the old file or the new, whole.

    Args:
        path: the file to replace; its directory must exist.
        data: the new content.
        fsync: fsync the file and its directory (off only where durability
            across power loss does not matter: tests, benchmarks).
        replace_directory: remove a directory standing at ``path`` (for a
            folder whose names only kvmem writes); otherwise the rename fails.
    """
    fd, tmp = create_temp(path)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            if fsync:
                os.fsync(file.fileno())
        if replace_directory:
            clear_directory(path)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if fsync:
        fsync_dir(path.parent)
