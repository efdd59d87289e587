"""One owner per cache directory: an OS lock taken before anything is read, written or collected.

Two processes writing one cache directory lose data: each keeps its own hot
copies (a forget in one leaves the other serving and saving the agent again),
and one's clean-up removes the other's half-written temporary files. So a
process that opens a cache directory for a runtime first takes
:class:`OwnerLock`: an exclusive ``flock`` on ``<root>/owner.lock``, held for
the runtime's life.

The lock is the kernel's, never a lock file's existence: when its process
exits, however (``kill -9`` included), the kernel releases it, so there is no
stale lock to clean up. ``flock`` locks belong to the open file, not the
process, so a second runtime in the *same* process is refused too.

The holder writes who it is into the locked file (:class:`OwnerInfo`: pid,
command, and the control socket through which other processes may ask it to
forget or list agents, :mod:`actors.control`). A process refused the lock
reads that and either talks to the holder or names it in its error.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec

from runtime.errors import DirectoryInUseError

__all__ = ["OwnerLock", "OwnerInfo", "LOCK_NAME", "CONTROL_NAME", "read_owner", "unless_owned"]

LOCK_NAME = "owner.lock"
"""The locked file, directly inside the cache directory."""

CONTROL_NAME = "control.sock"
"""The holder's control socket (:mod:`actors.control`), beside the lock."""


class OwnerInfo(msgspec.Struct, frozen=True, kw_only=True):
    """Who holds a cache directory, as the holder wrote it into the lock file.

    Attributes:
        pid: the holder's process id.
        command: what it runs (``kvmem serve``, ``kvmem chat``, a Python program).
        since: when it took the lock (Unix time).
        control: the path of its control socket, or None while it has none.
    """

    pid: int
    command: str
    since: float
    control: str | None = None

    def describe(self) -> str:
        """``pid 1234 (kvmem serve, since 12:00:03)``."""
        return f"pid {self.pid} ({self.command}, since {time.strftime('%H:%M:%S', time.localtime(self.since))})"


def _command() -> str:
    argv = [Path(sys.argv[0]).name, *sys.argv[1:2]] if sys.argv and sys.argv[0] else ["python"]
    return " ".join(argv) if argv[0] == "kvmem" else f"python {argv[0]}"


class OwnerLock:
    """The exclusive lock on one cache directory (see the module docstring).

    Args:
        root: the cache directory (created ``0o700`` if missing).
        command: what this process runs, for the message another process shows.

    Raises:
        DirectoryInUseError: another open :class:`OwnerLock` holds ``root``, in
            this process or another live one.
        OSError: the lock file cannot be created.
    """

    def __init__(self, root: Path, *, command: str | None = None) -> None:
        self._fd: int | None = None
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.path = self.root / LOCK_NAME
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise DirectoryInUseError(self.root, read_owner(self.root)) from None
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self.info = OwnerInfo(pid=os.getpid(), command=command or _command(), since=time.time())
        self._write()

    @property
    def held(self) -> bool:
        return self._fd is not None

    def announce_control(self, socket_path: Path | None) -> None:
        """Tell other processes where this holder's control socket is (None: it has none now)."""
        self.info = msgspec.structs.replace(self.info, control=None if socket_path is None else str(socket_path))
        self._write()

    def _write(self) -> None:
        # In place, never by rename: the lock belongs to this file's inode.
        assert self._fd is not None
        data = msgspec.json.encode(self.info)
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)

    def release(self) -> None:
        """Give the directory up (idempotent). The file stays: a new holder locks and rewrites it."""
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
            os.close(fd)  # closing the last descriptor releases the flock

    def __enter__(self) -> OwnerLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        self.release()


def read_owner(root: Path) -> OwnerInfo | None:
    """What the holder of ``root`` wrote about itself; None when nothing readable is there.

    The holder rewrites the file in place, so a read can meet it half written: a few tries.
    """
    for _ in range(5):
        try:
            data = (Path(root) / LOCK_NAME).read_bytes()
        except OSError:
            return None
        if data:
            try:
                return msgspec.json.decode(data, type=OwnerInfo)
            except msgspec.DecodeError:
                pass
        time.sleep(0.01)
    return None


@contextlib.contextmanager
def unless_owned(root: Path) -> Iterator[bool]:
    """Whether no live runtime owns ``root``; while True, none can take it (a shared lock is held).

    For code that opens a cache directory outside a runtime (tools, tests): it may clean up
    what a killed process left only while no owner may be writing there.
    """
    path = Path(root) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        yield True  # never owned: a runtime creates the file before it writes anything
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)
