"""The processes of an ``mlx.launch`` of ranks on loopback: free ports for its ring, its ranks, whether each runs.

Shared by ``tests/runtime_core/test_distributed.py`` and ``benches/gpu/distributed_stop.py`` (Linux: ranks are read from ``/proc``).
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
from pathlib import Path

__all__ = ["free_port_pair", "children_of", "ranks_of", "alive", "kill_all"]


def free_port_pair() -> int:
    """A port P with P and P + 1 free (the ring backend listens on one port per rank), below the kernel's
    ephemeral range: a port from that range can be taken between this check and the ranks' binds by any
    outgoing connection, the ranks' own included (CI once saw rank 1's bind fail: error 98, in use)."""
    low = _ephemeral_low()
    if low < 12000:  # no room below it: a pair from the ephemeral range, as the kernel hands them out
        return _ephemeral_port_pair()
    pick = random.Random()
    for _ in range(200):
        port = pick.randrange(10000, low - 2)
        try:
            with socket.socket() as first, socket.socket() as second:
                first.bind(("127.0.0.1", port))
                second.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports below the ephemeral range")


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default 32768 where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _ephemeral_port_pair() -> int:
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports")


def children_of(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (the ranks ``mlx.launch`` started), from ``/proc``."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def ranks_of(launcher: int) -> list[int]:
    """The processes ``mlx.launch`` (pid ``launcher``) started, in rank order (their ``MLX_RANK``): pids are
    not (a test that took the higher pid for rank 1 sometimes signalled rank 0)."""
    def rank(pid: int) -> int:
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            return 1 << 30
        found = [int(e.split(b"=", 1)[1]) for e in env if e.startswith(b"MLX_RANK=")]
        return found[0] if found else 1 << 30

    return sorted(children_of(launcher), key=rank)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def kill_all(proc: subprocess.Popen[str], ranks: list[int]) -> None:
    """SIGKILL the ranks and ``mlx.launch`` (whichever are left) and reap the launcher."""
    for pid in (*ranks, proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
