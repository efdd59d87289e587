"""File-system steps: atomic file replacement, private folders, batches of atomic writes, safe reads.

:func:`write_atomic` is kvmem's one atomic, durable file replacement. A file is
written as ``<name>.<random>.tmp`` in its final directory (created ``0o600``,
exclusively, never through a symlink), flushed and fsynced, then renamed over
``<name>`` with :func:`os.replace`, and the directory is fsynced so that the
rename itself is durable. A crash leaves the old file or the new one, whole.
It writes the cache directory's manifests, and outside the cache directory the
home folder's conversations (:mod:`runtime.home`) and a scenario run's state.

An :class:`AtomicBatch` takes the same steps for many files at once, and makes
them durable together. An ordinary exception removes the temporary files; a
kill leaves them behind, and :func:`remove_temp_files` (run when a cache
directory is opened) deletes them. Reads never follow a symlink and never
block on a FIFO.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import shutil
import stat
from pathlib import Path

__all__ = [
    "FILE_MODE",
    "DIR_MODE",
    "TEMP_SUFFIX",
    "create_temp",
    "fsync_dir",
    "clear_directory",
    "write_atomic",
    "ensure_private_dir",
    "AtomicBatch",
    "read_regular_file",
    "open_regular_file",
    "read_exactly_into",
    "IOV_MAX",
    "read_header",
    "regular_file_size",
    "remove_file",
    "remove_temp_files",
]

log = logging.getLogger("kvmem.persist")

FILE_MODE = 0o600
DIR_MODE = 0o700
TEMP_SUFFIX = ".tmp"

IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
"""Most buffers one ``preadv`` takes."""

_WRITE_FLAGS = (
    os.O_WRONLY
    | os.O_CREAT
    | os.O_EXCL
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_CLOEXEC", 0)
    | getattr(os, "O_BINARY", 0)
)

_READ_FLAGS = (
    os.O_RDONLY
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_CLOEXEC", 0)
    | getattr(os, "O_NONBLOCK", 0)  # a FIFO squatting on a name must not block the open
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


def ensure_private_dir(path: Path, *, fsync: bool) -> None:
    """Create ``path`` (mode ``0o700``) unless it is a directory already.

    Something else squatting on the name (a file, a symlink) is removed first:
    only this package writes inside a cache directory.
    """
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        pass
    else:
        if stat.S_ISDIR(info.st_mode):
            return
        log.warning("replacing non-directory %s with a directory", path)
        os.unlink(path)
    os.mkdir(path, DIR_MODE)
    os.chmod(path, DIR_MODE)  # exact mode whatever the umask
    if fsync:
        fsync_dir(path.parent)


class AtomicBatch:
    """Files written as :func:`write_atomic` writes one, but made durable together.

    :meth:`write` writes ``<name>.<random>.tmp`` and has the kernel start
    writing it back at once (``POSIX_FADV_DONTNEED`` starts writeback of dirty
    pages and drops none of them, the fallback PostgreSQL uses where
    ``sync_file_range`` is missing); :meth:`commit` fsyncs every temporary
    file, renames each over its name, then fsyncs each directory involved once.
    Syncing file by file instead waits for each file's writeback and journal
    commit in turn, and for its directory's: a third of a save's time for a
    large cache. A crash still leaves every name old or new and whole, and
    nothing written by an uncommitted batch in place.

    Use as a context manager: an ordinary exception removes the temporary
    files (a kill leaves them to :func:`remove_temp_files`). At most
    ``max_pending`` files wait for a commit; more commit the earlier ones, so a
    caller must not rely on a name staying old until :meth:`commit`.
    """

    def __init__(self, *, fsync: bool, max_pending: int = 64) -> None:
        self._fsync = fsync
        self._max_pending = max_pending
        self._pending: list[tuple[int, Path, Path]] = []
        self._dirs: dict[Path, None] = {}

    def __enter__(self) -> AtomicBatch:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        pending, self._pending = self._pending, []
        for fd, tmp, _path in pending:
            with contextlib.suppress(OSError):
                os.close(fd)
            if kind is not None and issubclass(kind, Exception):
                with contextlib.suppress(OSError):
                    os.unlink(tmp)

    def ensure_dir(self, path: Path) -> None:
        """Create ``path`` like :func:`ensure_private_dir`; its entry is made durable on commit."""
        try:
            if stat.S_ISDIR(os.lstat(path).st_mode):
                return
        except FileNotFoundError:
            pass
        ensure_private_dir(path, fsync=False)
        self._dirs[path.parent] = None

    def write(self, path: Path, data: bytes | memoryview) -> None:
        """Write ``data`` to a temporary file that :meth:`commit` renames to ``path``."""
        if len(self._pending) >= self._max_pending:
            self.commit()
        fd, tmp = create_temp(path)
        self._pending.append((fd, tmp, path))
        view = memoryview(data).cast("B")
        written = 0
        while written < len(view):
            written += os.write(fd, view[written:])
        if self._fsync and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def commit(self) -> None:
        """Make every file written so far durable under its name."""
        if self._fsync:
            for fd, _, _ in self._pending:
                os.fsync(fd)
        while self._pending:
            fd, tmp, path = self._pending[0]
            os.close(fd)
            self._pending[0] = (-1, tmp, path)
            clear_directory(path)
            os.replace(tmp, path)
            self._pending.pop(0)
            self._dirs[path.parent] = None
        if self._fsync:
            for directory in self._dirs:
                fsync_dir(directory)
        self._dirs.clear()


def _open_regular(path: Path, *, size: int | None = None) -> int | None:
    """A read-only descriptor of ``path`` if it is a regular file (of ``size`` bytes, when given), else None.

    Symlinks are not followed (O_NOFOLLOW refuses them); absent is None too.

    Raises:
        OSError: the file exists but cannot be opened or examined.
    """
    try:
        fd = os.open(path, _READ_FLAGS)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return None
        raise
    try:
        info = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    if stat.S_ISREG(info.st_mode) and (size is None or info.st_size == size):
        return fd
    os.close(fd)
    return None


def read_regular_file(path: Path) -> bytes | None:
    """The bytes of ``path``, or None when absent or not a regular file.

    Raises:
        OSError: the file exists but cannot be read.
    """
    fd = _open_regular(path)
    if fd is None:
        return None
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 24):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def open_regular_file(path: Path, *, size: int) -> int | None:
    """A read-only descriptor of ``path`` with read-ahead of the whole file started.

    None when ``path`` is absent, not a regular file (symlinks are not
    followed) or not ``size`` bytes long. The caller closes the descriptor.
    Asking the kernel to read every file of a load ahead up front lets the
    disk work while the caller checks and copies the files before it.

    Raises:
        OSError: the file exists but cannot be opened.
    """
    fd = _open_regular(path, size=size)
    if fd is not None and hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, 0, size, os.POSIX_FADV_WILLNEED)
        except BaseException:
            os.close(fd)
            raise
    return fd


def read_exactly_into(fd: int, buffers: list[memoryview]) -> bool:
    """Fill ``buffers`` (byte views) in order from the start of ``fd``; False if the file ends early or goes on.

    One ``preadv`` per :data:`IOV_MAX` buffers (the kernel copies straight
    into each), more only where a read comes back short.
    """
    pending = list(filter(len, buffers))
    position = 0
    index = 0
    while index < len(pending):
        batch = pending[index : index + IOV_MAX]
        got = os.preadv(fd, batch, position)
        if got == 0:
            return False
        position += got
        if got == sum(map(len, batch)):
            index += len(batch)
            continue
        while got:
            size = len(pending[index])
            if got < size:
                pending[index] = pending[index][got:]
                break
            got -= size
            index += 1
    return len(os.pread(fd, 1, position)) == 0


def read_header(path: Path, *, size: int, limit: int = 1 << 20) -> bytes | None:
    """The first ``8 + N`` bytes of a safetensors file (N from its length prefix).

    None unless ``path`` is a regular file of exactly ``size`` bytes whose
    header fits in it and in ``limit``.
    """
    try:
        fd = _open_regular(path, size=size)
    except OSError:
        return None
    if fd is None:
        return None
    try:
        prefix = os.pread(fd, 8, 0)
        header_len = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
        if not 0 <= header_len <= min(limit, size - 8):
            return None
        header = os.pread(fd, header_len, 8)
        return prefix + header if len(header) == header_len else None
    except OSError:
        return None
    finally:
        os.close(fd)


def regular_file_size(path: Path) -> int | None:
    """Size of ``path`` if it is a regular file (not following symlinks), else None."""
    try:
        info = os.lstat(path)
    except OSError:
        return None
    return info.st_size if stat.S_ISREG(info.st_mode) else None


def remove_file(path: Path) -> bool:
    """Unlink ``path`` if it is there; return whether something was removed."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    except IsADirectoryError:  # a directory where a cache file belongs (EISDIR on Linux)
        clear_directory(path)
    return True


def remove_temp_files(directory: Path) -> int:
    """Delete ``*.tmp`` files directly inside ``directory``; return how many."""
    removed = 0
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return 0
    for entry in entries:
        if entry.name.endswith(TEMP_SUFFIX) and entry.is_file(follow_symlinks=False):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
                removed += 1
    return removed
