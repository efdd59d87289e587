"""Starting a rank of ``kvmem serve --distributed``: the group, the handshake, and what each rank runs.

``mlx.launch`` starts one process per rank with ``MLX_RANK`` and (ring backend)
``MLX_HOSTFILE`` set. :func:`open_rank` joins the ``mx.distributed`` group,
refuses a model that does not split evenly before anything is loaded, and
connects the ranks' command channel:

1. rank 0 listens on an ephemeral TCP port of its own address in the hostfile
   (``127.0.0.1`` on one machine, the Thunderbolt or Ethernet address across
   two), so a follower reaches it the way the ring backend does;
2. one ``all_sum`` tells every rank that port (rank 0 adds it, the others zeros);
3. each follower connects and says which rank it is.

Then rank 0 gets a :class:`LeaderRank` (the engine and cache directory
``kvmem serve`` runs with) and every other rank a follower to run.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.config import Config
from runtime.distributed.directory import ShardedDirectory
from runtime.distributed.follower import Follower
from runtime.distributed.leader import Leader, LeaderEngine
from runtime.distributed.shard import check_shardable
from runtime.distributed.wire import Hello, recv_hello, send_frame
from runtime.errors import DistributedError, ModelError
from runtime.execution.mlx_engine import MlxEngine
from runtime.persist import CacheDirectory

__all__ = ["LeaderRank", "open_rank", "rank_cache_dir", "leader_host", "stop_when_orphaned", "ORPHAN_POLL_S"]

log = logging.getLogger("kvmem.distributed")

CONNECT_TIMEOUT_S = 120.0
"""How long ranks wait for each other at the handshake (a slow rank may still be importing)."""


ORPHAN_POLL_S = 0.5
"""How often a rank checks that the process that started it (``mlx.launch``) is still there."""


def stop_when_orphaned() -> threading.Thread:
    """Send this rank SIGTERM once the process that started it is gone, on a daemon thread.

    ``mlx.launch`` does not pass a SIGTERM or SIGINT of its own on to the ranks: killed, it left both
    serving, a port held and nothing to stop them. A rank whose parent changes (the kernel hands an
    orphan to init or a subreaper) stops as if it had got SIGTERM itself: rank 0 shuts down, flushes and
    tells the followers to exit; a follower waits :data:`FOLLOWER_GRACE_S` for that and then goes.
    """
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(ORPHAN_POLL_S)
        log.warning("the process that started this rank (pid %d) is gone: stopping", parent)
        os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=watch, name="kvmem-orphan-watch", daemon=True)
    thread.start()
    return thread


FOLLOWER_GRACE_S = 6
"""A follower told to stop (SIGTERM, SIGINT, or its launcher gone) exits this long after, unless rank 0 (told
too, by the same Ctrl-C or by ``mlx.launch`` once this rank has gone) has flushed and told it sooner. Rank 0
stops in a second or two with durable turns (each turn's cache was saved when it was answered), so both ranks
are gone within 10 s of any of these signals to either."""


@dataclass
class LeaderRank:
    """What rank 0 serves with: the wrapped engine and cache directory, and the followers to stop at the end."""

    engine: LeaderEngine
    directory: ShardedDirectory
    leader: Leader

    def close(self) -> None:
        """Tell the followers to exit (call after the server stopped and flushed its caches)."""
        self.leader.close()


def rank_cache_dir(caches: Path, *, rank: int, size: int) -> Path:
    """Where rank ``rank`` of ``size`` keeps its part of every cache: ``<caches>/tp<size>/rank<rank>``."""
    return caches / f"tp{size}" / f"rank{rank}"


def leader_host() -> str:
    """Rank 0's address, as the backend's launch named it.

    The ring backend's hostfile (``MLX_HOSTFILE``: rank 0's first ``ip:port``), else
    the JACCL coordinator (``MLX_JACCL_COORDINATOR``, rank 0's address), else
    ``KVMEM_LEADER_HOST``, else loopback.
    """
    path = os.environ.get("MLX_HOSTFILE")
    if path:
        try:
            hosts = json.loads(Path(path).read_text())
            return str(hosts[0][0]).rpartition(":")[0]
        except (OSError, ValueError, IndexError, KeyError, TypeError) as exc:
            log.warning("cannot read rank 0's address from %s: %s", path, exc)
    coordinator = os.environ.get("MLX_JACCL_COORDINATOR")
    if coordinator:
        return coordinator.rpartition(":")[0]
    return os.environ.get("KVMEM_LEADER_HOST", "127.0.0.1")


def open_rank(config: Config) -> LeaderRank | Follower:
    """Join the group started by ``mlx.launch`` and connect the ranks (see the module docstring).

    Raises:
        DistributedError: not started by ``mlx.launch`` with two ranks or more, or
            the ranks cannot reach each other.
        UnsupportedModelError: the model's heads do not divide by the number of ranks.
    """
    import mlx.core as mx

    if config.store is not None:
        raise DistributedError("--distributed does not support a shared tier (--store)")
    if config.api_keys is not None:
        # Tenants keep caches in subtrees the ranks' directories do not mirror yet.
        raise DistributedError("--distributed does not support tenants (--api-keys)")
    if "MLX_RANK" not in os.environ:
        raise DistributedError("--distributed runs under mlx.launch (e.g. mlx.launch -n 2 --backend ring "
                               "--python $(which python) -- -m gateway.cli serve --distributed ...)")
    group = mx.distributed.init(strict=True)
    rank, size = group.rank(), group.size()
    if size < 2:
        raise DistributedError(f"--distributed needs two ranks or more; mlx.launch started {size}")
    _check_model(config, size)
    engine = MlxEngine.from_config(config, group)
    root = rank_cache_dir(config.caches_path, rank=rank, size=size)
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    if rank == 0:
        server = socket.create_server((leader_host(), 0))
        _share_port(mx, group, server.getsockname()[1])
        leader = Leader(_accept(server, size), size=size)
        log.info("rank 0 of %d: %d other ranks connected", size, size - 1)
        return LeaderRank(LeaderEngine(engine, leader), ShardedDirectory(root, fsync=config.fsync, leader=leader),
                          leader)
    port = _share_port(mx, group, 0)
    sock = _connect(leader_host(), port)
    send_frame(sock, Hello(rank, size))
    log.info("rank %d of %d: following rank 0 at %s:%d", rank, size, leader_host(), port)
    return Follower(sock, engine=engine, directory=CacheDirectory(root, fsync=config.fsync), rank=rank, size=size)


def _check_model(config: Config, size: int) -> None:
    """Refuse a model that does not split evenly, from its config alone (before any rank loads weights)."""
    from runtime.model.loaded import prepare_model_files

    for name in (config.model, *config.models):
        try:
            folder = prepare_model_files(name, config.models_path)
            model_config = json.loads((folder / "config.json").read_text())
        except (ModelError, OSError, ValueError):
            continue  # a Hugging Face id: checked when it loads
        check_shardable(model_config, size, name=name)


def _share_port(mx: Any, group: Any, port: int) -> int:
    """Rank 0's port, on every rank (the others contribute zeros)."""
    return int(mx.distributed.all_sum(mx.array([port], dtype=mx.int32), group=group).item())


def _accept(server: socket.socket, size: int) -> list[socket.socket]:
    followers: dict[int, socket.socket] = {}
    server.settimeout(CONNECT_TIMEOUT_S)
    try:
        while len(followers) < size - 1:
            try:
                sock, _addr = server.accept()
            except TimeoutError:
                raise DistributedError(f"only {len(followers)} of {size - 1} other ranks connected "
                                       f"within {CONNECT_TIMEOUT_S:.0f} s") from None
            sock.settimeout(CONNECT_TIMEOUT_S)
            hello = recv_hello(sock)
            sock.settimeout(None)
            if hello.size != size or not 0 < hello.rank < size or hello.rank in followers:
                sock.close()
                raise DistributedError(f"a rank said it is {hello.rank} of {hello.size}; this is rank 0 of {size}")
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # one small frame per decode step
            followers[hello.rank] = sock
    finally:
        server.close()
    return [followers[r] for r in range(1, size)]


def _connect(host: str, port: int) -> socket.socket:
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
        except OSError as exc:
            if time.monotonic() > deadline:
                raise DistributedError(f"cannot reach rank 0 at {host}:{port}: {exc}") from exc
            time.sleep(0.2)
            continue
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock
